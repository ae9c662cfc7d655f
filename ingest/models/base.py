"""What every part of model loading shares: the error, the loaded-model record, the weight hash,
and moving a model to its device and dtype."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from actstore.core.errors import ModelError

__all__ = ["LoadedModel", "ModelError", "weight_hash"]


def one_line(message: str) -> str:
    """``message`` with every run of whitespace (newlines included) turned into one space."""
    return " ".join(str(message).split())


def short_reason(exc: BaseException, limit: int = 200) -> str:
    """The exception's message on one line, cut to ``limit`` characters (its type when empty)."""
    text = one_line(str(exc)) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass
class LoadedModel:
    """A causal language model ready for capture, with its tokenizer and identity."""

    model: PreTrainedModel
    """In eval mode, gradients off, on the requested device and dtype."""
    tokenizer: PreTrainedTokenizerBase
    """A fast tokenizer (``return_offsets_mapping`` works) with a pad token."""
    name: str
    """What the user asked for: ``"smollm2-135m"``, a path, ``"tiny-llama"``, a hub name."""
    source: str
    """Where it was loaded from: a folder, a GGUF file, or ``"config:tiny-<arch>"``."""
    weight_hash: str
    """sha256 (hex) of the weights as loaded, see :func:`weight_hash`."""

    @property
    def architecture(self) -> str:
        """``config.model_type`` (``"llama"``, ``"gemma3_text"``, ``"gpt2"``, ...)."""
        return str(self.model.config.model_type)


def weight_hash(model: PreTrainedModel) -> str:
    """sha256 (hex) of the state dict: for each tensor in sorted key order, its name, dtype,
    shape and raw bytes (contiguous, on the CPU).  A tensor tied to one already hashed (same
    storage, dtype, shape and strides, e.g. tied input/output embeddings) counts once, under the
    first name in sorted order."""
    digest = hashlib.sha256()
    seen: set[tuple[int, str, tuple[int, ...], tuple[int, ...]]] = set()
    state = model.state_dict()
    for key in sorted(state):
        tensor = state[key]
        if tensor.numel() > 0:
            ident = (tensor.data_ptr(), str(tensor.dtype), tuple(tensor.shape), tuple(tensor.stride()))
            if ident in seen:
                continue
            seen.add(ident)
        digest.update(f"{key}\0{str(tensor.dtype).removeprefix('torch.')}\0{tuple(tensor.shape)}\0".encode())
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        if flat.numel() > 0:
            digest.update(memoryview(flat.view(torch.uint8).numpy()))
    return digest.hexdigest()


def prepare(model: PreTrainedModel, device: str, dtype: torch.dtype) -> PreTrainedModel:
    """``model`` moved (in place) to ``dtype`` and ``device``, in eval mode, gradients off."""
    movable: Any = model  # transformers' decorated ``to`` confuses mypy; it moves in place
    if model.dtype != dtype:
        movable.to(dtype=dtype)
    try:
        movable.to(device)
    except (RuntimeError, AssertionError, ValueError) as exc:
        raise ModelError(f"cannot move the model to device {device!r}: {short_reason(exc)}") from exc
    model.eval()
    model.requires_grad_(False)
    return model
