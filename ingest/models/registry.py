"""Model names: actstore's aliases, and ``load_model``, which resolves a name and loads it.

``load_model(name)`` resolves, in this order:

1. an alias of a GGUF model shipped in a PyPI package (``smollm2-135m``, ``gemma3-270m``);
   the GGUF file is converted once into a cached safetensors folder
   (:mod:`actstore.ingest.models.gguf`), which every later load reads;
2. a path to a local ``.gguf`` file (converted and cached the same way);
3. an existing local folder holding a transformers checkpoint;
4. ``tiny-<arch>`` (``tiny-llama``, ``tiny-qwen2``, ``tiny-qwen3``, ``tiny-gemma3``, ``tiny-gpt2``,
   ``tiny-gpt_neox``): a random-weight tiny model built from a config (:mod:`actstore.ingest.models.tiny`);
5. anything else that looks like a hub repository name (``owner/name``): the local hub cache
   first, then a download, both through ``huggingface_hub``; with ``HF_HUB_OFFLINE=1`` or
   ``ACTSTORE_OFFLINE=1``, or where the hub's host does not answer at once (:func:`hub_offline`), only
   the local cache is read, and a model missing from it is one error line naming the aliases, with no
   retries.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch
from huggingface_hub import constants, try_to_load_from_cache
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from actstore.core.errors import UnknownModelName
from actstore.core.model_names import hub_offline

from .base import LoadedModel, ModelError, prepare, short_reason, weight_hash
from .cache import model_cache_dir
from .gguf import GGUF_ALIASES, converted_alias, converted_gguf
from .tiny import TINY_ARCHS, tiny_arch, tiny_model

__all__ = ["check_model_name", "known_alias", "load_model"]

logger = logging.getLogger(__name__)


def known_alias(name: str) -> str | None:
    """The canonical form of ``name`` when it is one of actstore's own aliases (a packaged GGUF model or
    ``tiny-<arch>``), else None.

    Names that come from a store (its manifest's ``model.name``) are data, not instructions: a
    command that would load the store's model on its own loads it only when this returns an alias,
    and otherwise asks for an explicit flag, so that a store cannot make it read an arbitrary
    folder or fetch an arbitrary hub repository.
    """
    key = name.strip().lower()
    if key in GGUF_ALIASES:
        return key
    if key.startswith("tiny-"):
        arch = tiny_arch(key[5:])
        if arch is not None:
            return f"tiny-{arch}"
    return None


def load_model(
    name: str, *, device: str = "cpu", dtype: torch.dtype = torch.float32, cache_dir: Path | None = None
) -> LoadedModel:
    """Resolve ``name`` (see the module docstring) and load it in eval mode on ``device``/``dtype``.

    ``cache_dir`` is the converted-model cache (default :func:`actstore.ingest.models.cache.model_cache_dir`).
    Raises ModelError (one line) when the name resolves to nothing loadable.
    """
    cache = Path(cache_dir).expanduser() if cache_dir is not None else model_cache_dir()
    key = name.strip()
    if key.lower() in GGUF_ALIASES:
        folder, source = converted_alias(GGUF_ALIASES[key.lower()], cache)
        model, tokenizer = _load_folder(folder, device, dtype)
        return _finish(model, tokenizer, name, source, device, dtype)
    path = Path(key).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        folder = converted_gguf(path.resolve(), _slug(path.stem), cache)
        model, tokenizer = _load_folder(folder, device, dtype)
        return _finish(model, tokenizer, name, str(path.resolve()), device, dtype)
    if path.is_dir():
        model, tokenizer = _load_folder(path, device, dtype)
        return _finish(model, tokenizer, name, str(path.resolve()), device, dtype)
    if key.lower().startswith("tiny-"):
        arch = tiny_arch(key[5:])
        if arch is not None:
            loaded = tiny_model(arch)
            return _finish(loaded.model, loaded.tokenizer, name, loaded.source, device, dtype)
    return _load_hub(name, key, device, dtype)


# --------------------------------------------------------------------------------------------
# Loading helpers
# --------------------------------------------------------------------------------------------


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-.") or "model"


def _prepare_tokenizer(tokenizer: PreTrainedTokenizerBase, source: str) -> PreTrainedTokenizerBase:
    if not getattr(tokenizer, "is_fast", False):
        raise ModelError(
            f"the tokenizer of {source} is not a fast (tokenizers) tokenizer, so it has no offsets mapping"
        )
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is not None:
            tokenizer.pad_token = tokenizer.eos_token
        elif tokenizer.unk_token is not None:
            tokenizer.pad_token = tokenizer.unk_token
        else:
            raise ModelError(f"the tokenizer of {source} has no pad, eos or unk token to pad with")
    return tokenizer


def _finish(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    name: str,
    source: str,
    device: str,
    dtype: torch.dtype,
) -> LoadedModel:
    model = prepare(model, device, dtype)
    tokenizer = _prepare_tokenizer(tokenizer, source)
    return LoadedModel(
        model=model, tokenizer=tokenizer, name=name, source=source, weight_hash=weight_hash(model)
    )


def _load_folder(
    folder: Path, device: str, dtype: torch.dtype
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    try:
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, attn_implementation="sdpa")
    except Exception as exc:  # transformers raises OSError, ValueError, KeyError, ... for a bad folder
        raise ModelError(f"cannot load a causal language model from {folder}: {short_reason(exc)}") from exc
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    except Exception as exc:
        raise ModelError(f"cannot load the tokenizer from {folder}: {short_reason(exc)}") from exc
    return model, tokenizer


# --------------------------------------------------------------------------------------------
# The Hugging Face hub
# --------------------------------------------------------------------------------------------

_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


def _causes(exc: BaseException) -> list[BaseException]:
    """``exc`` and the exceptions it was raised from (transformers wraps the hub's errors in OSError)."""
    chain: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in chain:
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain


def _hub_failure(key: str, exc: BaseException) -> str:
    """Why ``key`` could not be fetched from the hub, and what to do, from huggingface_hub's errors."""

    endpoint = constants.ENDPOINT
    for cause in _causes(exc):
        if isinstance(cause, GatedRepoError):
            return (
                f"{key!r} on {endpoint} is gated: accept its terms on the hub and log in "
                "(hf auth login or HF_TOKEN)"
            )
        if isinstance(cause, RepositoryNotFoundError):
            return (
                f"no repository {key!r} on {endpoint} (or it is private: log in with hf auth login "
                "or set HF_TOKEN)"
            )
        if isinstance(cause, RevisionNotFoundError):
            return f"{key!r} on {endpoint} has no such revision"
        if isinstance(cause, LocalEntryNotFoundError):
            return (
                f"{key!r} is not in the local hub cache ({constants.HF_HUB_CACHE}) and {endpoint} cannot be "
                "reached: connect to the network (or set HF_ENDPOINT to a mirror), or set HF_HUB_OFFLINE=1 "
                "to use only cached models"
            )
        if isinstance(cause, EntryNotFoundError):
            return f"{key!r} on {endpoint} holds no transformers checkpoint ({short_reason(cause, 120)})"
    return f"cannot load {key!r} from {endpoint}: {short_reason(exc)}"


def _unknown(name: str, reason: str, cls: type[ModelError] = ModelError) -> ModelError:
    return cls(
        f"unknown model {name!r}: not an alias ({', '.join(GGUF_ALIASES)}, "
        f"{', '.join('tiny-' + a for a in TINY_ARCHS)}), not a local folder, "
        f"and not loadable from the hub: {reason}"
    )


def _check_hub_name(name: str, key: str) -> None:
    """Refuse at once (no network) what cannot be a hub repository name."""
    if key.lower().endswith(".gguf"):
        raise _unknown(name, f"no GGUF file {str(Path(key).expanduser())!r}", UnknownModelName)
    if key.startswith(("/", "./", "../", "~", ".\\")) or key.count("/") > 1 or "\\" in key:
        raise _unknown(name, f"no folder {str(Path(key).expanduser())!r}", UnknownModelName)
    if not _REPO_ID.match(key) or "--" in key or ".." in key:
        raise _unknown(name, "not a valid hub repository name", UnknownModelName)
    if "/" not in key:  # not owner/name: refused at once, before any network access
        raise _unknown(
            name,
            "a hub name is owner/name (e.g. HuggingFaceTB/SmolLM2-135M-Instruct); for a local "
            "transformers folder pass its path (e.g. ./my-model)",
            UnknownModelName,
        )


def _not_cached(name: str, key: str, offline: str) -> ModelError:
    return _unknown(
        name,
        f"{key!r} is not in the local hub cache ({constants.HF_HUB_CACHE}) and {offline}: "
        f"download it once with network access (e.g. hf download {key}), or pass a local folder"
        + ("" if "is set" in offline else "; HF_HUB_OFFLINE=1 skips this check"),
    )


def check_model_name(name: str) -> None:
    """Refuse, in one line and without loading anything, a name :func:`load_model` could not load
    here: neither an alias, a GGUF file, a folder nor a tiny model, and not a hub name that is in the
    local hub cache or reachable (run before a data set is read, so that a wrong name fails at once)."""
    key = name.strip()
    path = Path(key).expanduser()
    if key.lower() in GGUF_ALIASES or path.is_dir() or (path.is_file() and path.suffix.lower() == ".gguf"):
        return
    if key.lower().startswith("tiny-") and tiny_arch(key[5:]) is not None:
        return
    _check_hub_name(name, key)
    if isinstance(try_to_load_from_cache(key, "config.json"), str):
        return
    offline = hub_offline()
    if offline:
        raise _not_cached(name, key, offline)


def _load_hub(name: str, key: str, device: str, dtype: torch.dtype) -> LoadedModel:
    def unknown(reason: str, cls: type[ModelError] = ModelError) -> ModelError:
        return _unknown(name, reason, cls)

    _check_hub_name(name, key)

    def fetch(local_only: bool) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
        model = AutoModelForCausalLM.from_pretrained(
            key, dtype=dtype, attn_implementation="sdpa", local_files_only=local_only
        )
        tokenizer = AutoTokenizer.from_pretrained(key, local_files_only=local_only)
        return model, tokenizer

    try:
        model, tokenizer = fetch(True)  # the local hub cache first: no network
    except Exception as exc:  # transformers wraps the hub's errors in OSError, ValueError, ...
        offline = hub_offline()
        if offline:
            if not any(isinstance(cause, LocalEntryNotFoundError) for cause in _causes(exc)):
                raise unknown(f"cannot load {key!r} from the local hub cache: {short_reason(exc)}") from exc
            raise _not_cached(name, key, offline) from exc
        logger.info("%s is not in the local hub cache: fetching it from %s", key, constants.ENDPOINT)
        try:
            model, tokenizer = fetch(False)
        except Exception as exc2:
            raise unknown(_hub_failure(key, exc2)) from exc2
    return _finish(model, tokenizer, name, f"hub:{key}", device, dtype)
