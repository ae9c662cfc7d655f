"""Tiny random-weight models built from a config (no download), and their tokenizer.

``tiny_model(arch)`` gives a model of each architecture actstore captures (``TINY_ARCHS``) small
enough for tests: about 64 hidden units, 4 heads, 2-3 layers, float32, weights a function of the
seed alone.  ``tiny_tokenizer()`` is a byte-level BPE tokenizer trained offline on a fixed list
of English sentences.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel, PreTrainedTokenizerFast

from .base import LoadedModel, ModelError, prepare, weight_hash

__all__ = ["TINY_ARCHS", "tiny_arch", "tiny_model", "tiny_tokenizer"]

TINY_ARCHS: tuple[str, ...] = ("llama", "qwen2", "qwen3", "gemma3", "gpt2", "gpt_neox")


def tiny_model(arch: str, *, seed: int = 0, **overrides: Any) -> LoadedModel:
    """A random-weight tiny model of architecture ``arch`` (one of :data:`TINY_ARCHS`).

    Built from a config, no download: about 64 hidden units, 4 heads, 2-3 layers, in float32,
    eval mode.  Weights are a function of ``seed`` alone (the global RNG state is left as it
    was); biases and norm weights are moved away from their 0/1 defaults by small random
    values so that code handling them is exercised.  ``overrides`` are config fields.  The
    tokenizer is :func:`tiny_tokenizer` (with a BOS token for llama and gemma3).
    """
    resolved = tiny_arch(arch)
    if resolved is None:
        raise ModelError(f"unknown tiny architecture {arch!r}: expected one of {', '.join(TINY_ARCHS)}")
    tokenizer = tiny_tokenizer(add_bos=resolved in ("llama", "gemma3"))
    config = _tiny_config(resolved, len(tokenizer), overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
        _perturb_defaults(model, seed)
    model = prepare(model, "cpu", torch.float32)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=f"tiny-{resolved}",
        source=f"config:tiny-{resolved}",
        weight_hash=weight_hash(model),
    )


def tiny_arch(arch: str) -> str | None:
    """The canonical name of tiny architecture ``arch`` (``"gpt-neox"`` -> ``"gpt_neox"``), or None."""
    key = arch.strip().lower().replace("-", "_")
    key = {"gemma3_text": "gemma3", "neox": "gpt_neox", "gptneox": "gpt_neox"}.get(key, key)
    return key if key in TINY_ARCHS else None


_TINY_CORPUS: tuple[str, ...] = (
    "The capital of France is Paris.",
    "The capital of Germany is Berlin, and the capital of Italy is Rome.",
    "Tokyo is the capital of Japan and its largest city.",
    "Madrid is the capital of Spain; Lisbon is the capital of Portugal.",
    "The Eiffel Tower is located in Paris, the capital of France.",
    "Albert Einstein was born in Ulm, in the Kingdom of Wurttemberg.",
    "Marie Curie was a physicist and chemist who worked in Paris.",
    "William Shakespeare wrote Hamlet, Macbeth and King Lear.",
    "The Beatles were an English rock band formed in Liverpool in 1960.",
    "Leonardo da Vinci painted the Mona Lisa.",
    "The Amazon River flows through Brazil into the Atlantic Ocean.",
    "Mount Everest is the highest mountain on Earth.",
    "The Nile is a river in Africa that flows north into the Mediterranean Sea.",
    "Barack Obama was the president of the United States from 2009 to 2017.",
    "Microsoft was founded by Bill Gates and Paul Allen.",
    "Apple is headquartered in Cupertino, California.",
    "The official language of Brazil is Portuguese.",
    "Python is a programming language created by Guido van Rossum.",
    "The mother tongue of Victor Hugo was French.",
    "Lionel Messi plays football and was born in Rosario, Argentina.",
    "The Louvre is a museum in Paris that holds many famous paintings.",
    "Isaac Newton described the laws of motion and universal gravitation.",
    "Charles Darwin proposed the theory of evolution by natural selection.",
    "The Pacific Ocean is the largest ocean in the world.",
    "Canada is a country in North America; its capital is Ottawa.",
    "Australia is a country and continent; its capital is Canberra.",
    "The Great Wall of China was built over many centuries.",
    "Johann Sebastian Bach was a German composer of the Baroque period.",
    "Wolfgang Amadeus Mozart was born in Salzburg in 1756.",
    "Toyota is a car company based in Japan.",
    "The Hubble Space Telescope was launched into orbit in 1990.",
    "Neil Armstrong was the first person to walk on the Moon.",
    "The river Thames flows through London, the capital of England.",
    "A relation links a subject to an object, such as a city to its country.",
    "She works as a doctor at the hospital, and he works as a teacher at the school.",
    "They played music together and released their first album in 1975.",
    "The company was acquired by a larger firm for one billion dollars.",
    "He studied at the University of Cambridge and later taught at Oxford.",
    "The novel was written in English and translated into Spanish and German.",
    "Water boils at one hundred degrees Celsius at sea level.",
    "Numbers like 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 42 and 2024 appear in text.",
    'Questions? Answers! Quotes "like this", (parentheses), [brackets] and - dashes.',
    "The quick brown fox jumps over the lazy dog.",
    "In 1969, the Apollo program landed astronauts on the Moon.",
    "The film was directed by a famous director and won an award.",
    "The team is a member of the league and plays its home games in the stadium.",
    "Her father was a farmer, and her mother was a singer.",
    "The language spoken in Mexico is Spanish.",
    "The instrument he played was the piano; she played the violin.",
    "This sentence is here only so that the tokenizer sees more common English words.",
)


@functools.cache
def _tiny_tokenizer_json(add_bos: bool) -> str:
    """The trained tiny tokenizer, serialized (trained once per process and flavour)."""

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        min_frequency=1,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(_TINY_CORPUS), trainer=trainer)
    byte_level = processors.ByteLevel(trim_offsets=False)
    if add_bos:
        tok.post_processor = processors.Sequence(
            [
                byte_level,
                processors.TemplateProcessing(
                    single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
                ),
            ]
        )
    else:
        tok.post_processor = byte_level
    return str(tok.to_str())


def tiny_tokenizer(*, add_bos: bool = False) -> PreTrainedTokenizerFast:
    """A deterministic byte-level BPE tokenizer (vocabulary about 512, trained offline on a fixed
    list of English sentences; ``<pad>``=0, ``<s>``=1, ``</s>``=2).  A new wrapper every call, so
    changing e.g. ``padding_side`` on one does not affect others."""

    backend = Tokenizer.from_str(_tiny_tokenizer_json(add_bos))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        padding_side="right",
        model_max_length=256,
    )
    return tokenizer


# Each tiny architecture: its transformers config class and how it differs from the shared small sizes
# (the GPT-2 config names its sizes its own way, so it lists them all).
_SMALL: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 256,
}
_TINY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": (
        "LlamaConfig",
        _SMALL | {"num_key_value_heads": 2, "head_dim": 16, "tie_word_embeddings": True},
    ),
    "qwen2": ("Qwen2Config", _SMALL | {"num_key_value_heads": 2, "tie_word_embeddings": False}),
    # Qwen3: RMS-normed queries and keys per head (q_norm, k_norm), no q/k/v biases, head_dim set apart
    "qwen3": (
        "Qwen3Config",
        _SMALL | {"num_key_value_heads": 2, "head_dim": 16, "tie_word_embeddings": True},
    ),
    "gemma3": (
        "Gemma3TextConfig",
        _SMALL
        | {
            "num_hidden_layers": 3,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "sliding_window": 4,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
            "query_pre_attn_scalar": 16,
            "tie_word_embeddings": True,
        },
    ),
    "gpt2": (
        "GPT2Config",
        {
            "n_positions": 256,
            "n_embd": 64,
            "n_layer": 2,
            "n_head": 4,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
            "tie_word_embeddings": True,
        },
    ),
    "gpt_neox": (
        "GPTNeoXConfig",
        _SMALL
        | {
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
            "use_parallel_residual": True,
            "tie_word_embeddings": False,
        },
    ),
}


def _tiny_config(arch: str, vocab_size: int, overrides: dict[str, Any]) -> PretrainedConfig:
    if arch not in _TINY_CONFIGS:  # pragma: no cover
        raise ModelError(f"unknown tiny architecture {arch!r}")
    class_name, sizes = _TINY_CONFIGS[arch]
    common = {"vocab_size": vocab_size, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    config: PretrainedConfig = getattr(transformers, class_name)(**(common | sizes | overrides))
    return config


def _perturb_defaults(model: PreTrainedModel, seed: int, scale: float = 0.1) -> None:
    """Add small random values to biases and norm weights (which start as 0 or 1)."""
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for _name, module in sorted(model.named_modules(), key=lambda item: item[0]):
            is_norm = "norm" in type(module).__name__.lower()
            for param_name, param in module.named_parameters(recurse=False):
                if is_norm or param_name == "bias" or param_name.endswith("_bias"):
                    noise = torch.randn(param.shape, generator=generator, dtype=torch.float32) * scale
                    param.add_(noise.to(param.dtype))
