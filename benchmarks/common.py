"""Small pieces every benchmark script shares."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

# The public data sets: $ACTSTORE_DATA, or ../shared/data beside the repository (as the tests read them).
DATA = Path(os.environ.get("ACTSTORE_DATA") or Path(__file__).resolve().parents[2] / "shared" / "data")


def emit(result: dict[str, Any], json_out: str | None) -> str:
    """Print ``result`` as indented JSON and, with ``json_out``, write the same text there."""
    text = json.dumps(result, indent=2)
    print(text)
    if json_out:
        Path(json_out).write_text(text)
    return text


def evict(paths: list[str] | list[Path]) -> None:
    """Drop these files' pages from the page cache (each fsynced first: dirty pages are not dropped),
    with ``posix_fadvise(POSIX_FADV_DONTNEED)``, which needs no root."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def write_vllm_files(
    folder: Path, n: int, seq: int, n_layers: int, d: int, vocab: int, seed: int = 0
) -> list[Path]:
    """``n`` files in the layout vLLM's ExampleHiddenStatesConnector writes (``token_ids`` int64 ``[seq]``,
    ``hidden_states [seq, n_layers, d]`` float32 holding bfloat16 values, as a bfloat16 model's are;
    docs/interop.md), sorted by name."""
    import numpy as np
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for k in range(n):
        ids = torch.from_numpy(rng.integers(0, vocab, size=seq))
        hs = torch.from_numpy(rng.standard_normal((seq, n_layers, d), dtype=np.float32))
        save_file(
            {"hidden_states": hs.to(torch.bfloat16).float(), "token_ids": ids},
            str(folder / f"req-{k:05d}.safetensors"),
        )
    return sorted(folder.glob("*.safetensors"))


def vllm_parser(doc: str | None, model: str, sizes: tuple[str, str, str], layer_ids: str) -> Any:
    """The options the vLLM-file benchmarks share: ``--model``, the sizes (``sizes``: the option's name,
    its default and its help), ``--seq``, ``--layer-ids`` and ``--json``."""
    import argparse

    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=model)
    ap.add_argument(sizes[0], default=sizes[1], help=sizes[2])
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--layer-ids", default=layer_ids)
    ap.add_argument("--json", default=None)
    return ap
