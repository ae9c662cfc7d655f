"""The lenses' final readout (the store's final norm and unembedding) against the model itself.

For every tiny architecture, the readout built from a store alone must turn the final norm's
input (hooked on the model) into the norm's output (hooked as the unembedding's input) and into
the model's own logits.  The configurations make every stored constant matter: a large norm
epsilon (0.5, so reading the default 1e-6 or flipping its sign shows), Gemma's final logit
soft-capping, GPT-2's and GPT-NeoX's LayerNorm bias.  A synthetic readout covers what no tiny
model has (an unembedding bias) against torch's own layer_norm / linear.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import actstore
from actstore.ingest.models.tiny import TINY_ARCHS, tiny_model
from actstore.query.analyses.lens import FinalReadout

pytestmark = pytest.mark.usefixtures("one_thread")

EPS = 0.5
OVERRIDES: dict[str, dict[str, Any]] = {
    "llama": {"rms_norm_eps": EPS},
    "qwen2": {"rms_norm_eps": EPS},
    "qwen3": {"rms_norm_eps": EPS},
    "gemma3": {"rms_norm_eps": EPS, "final_logit_softcapping": 0.7},
    "gpt2": {"layer_norm_epsilon": EPS},
    "gpt_neox": {"layer_norm_eps": EPS},
}


def final_norm_module(arch: str, model: Any) -> torch.nn.Module:
    """Found by name, per architecture, without the library's adapters."""
    names = {
        "llama": "model.norm",
        "qwen2": "model.norm",
        "qwen3": "model.norm",
        "gemma3": "model.norm",
        "gpt2": "transformer.ln_f",
        "gpt_neox": "gpt_neox.final_layer_norm",
    }
    module: torch.nn.Module = model.get_submodule(names[arch])
    return module


def write_store(out: Path, loaded: Any) -> actstore.Store:
    from actstore.ingest.align import tokenize_records
    from actstore.ingest.datasets.dispatch import load_dataset
    from actstore.ingest.pipeline import ingest_prompts
    from actstore.ingest.settings import IngestConfig

    prompts = tokenize_records(load_dataset("demo", limit_per_relation=1).records, loaded.tokenizer)
    cfg = IngestConfig(
        out=str(out),
        batch_size=4,
        storage_dtype="float32",
        segment_size=8,
        chunk_rows=4,
        chunk_flat=64,
        progress=False,
    )
    ingest_prompts(
        loaded.model,
        loaded.tokenizer,
        {"name": loaded.name, "architecture": loaded.architecture, "weight_hash": loaded.weight_hash},
        prompts,
        cfg,
    )
    return actstore.open(out)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_readout_from_store_equals_the_models_final_norm_and_logits(arch: str, tmp_path: Path) -> None:
    assert set(OVERRIDES) == set(TINY_ARCHS)
    loaded = tiny_model(arch, **OVERRIDES[arch])
    model = loaded.model
    store = write_store(tmp_path / arch, loaded)
    readout = FinalReadout.from_store(store)
    if arch == "gemma3":
        assert readout.softcap == pytest.approx(0.7)

    seen: dict[str, torch.Tensor] = {}
    hooks = [
        final_norm_module(arch, model).register_forward_pre_hook(
            lambda m, a: seen.__setitem__("h", a[0].detach())
        ),
        model.get_output_embeddings().register_forward_pre_hook(
            lambda m, a: seen.__setitem__("normed", a[0].detach())
        ),
    ]
    try:
        ids = torch.tensor([loaded.tokenizer("The capital of France is")["input_ids"]])
        with torch.no_grad():
            logits = model(input_ids=ids, use_cache=False).logits[0]
    finally:
        for h in hooks:
            h.remove()
    h, normed = seen["h"][0], seen["normed"][0]
    # The epsilon is large enough that dropping or flipping it moves the result far beyond tolerance.
    torch.testing.assert_close(readout.norm(h), normed, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(readout.logits(h), logits, rtol=1e-5, atol=1e-5)
    if arch == "gemma3":  # soft-capped: every logit inside (-cap, cap), and not all of them tiny
        assert logits.abs().max() < 0.7 and logits.abs().max() > 0.1


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_readout_formula_against_torch(kind: str) -> None:
    g = torch.Generator().manual_seed(3)
    d, V = 16, 11
    weight, bias = torch.randn(d, generator=g), torch.randn(d, generator=g)
    unembed, ubias = torch.randn(V, d, generator=g), torch.randn(V, generator=g)
    h = 3 * torch.randn(5, d, generator=g)
    r = FinalReadout(kind, 0.3, weight, bias, unembed, ubias, softcap=2.5)
    if kind == "layernorm":
        normed = torch.nn.functional.layer_norm(h, (d,), weight, bias, eps=0.3)
    else:
        normed = h / torch.sqrt((h * h).mean(-1, keepdim=True) + 0.3) * weight + bias
    torch.testing.assert_close(r.norm(h), normed, rtol=1e-5, atol=1e-5)
    raw = torch.nn.functional.linear(normed, unembed, ubias)
    torch.testing.assert_close(r.logits(h), 2.5 * torch.tanh(raw / 2.5), rtol=1e-5, atol=1e-5)
    plain = FinalReadout(kind, 0.3, weight, None, unembed, None, softcap=None)
    want = torch.nn.functional.linear(normed - bias, unembed)
    torch.testing.assert_close(plain.logits(h), want, rtol=1e-5, atol=1e-5)
