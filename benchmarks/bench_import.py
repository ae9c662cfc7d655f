"""Import rate of vLLM ``extract_hidden_states`` files (``actstore import``) against reading them alone,
at several sizes, warm and cold, beside the disk's write floor.

Writes the largest of ``--requests`` files in the layout vLLM's ExampleHiddenStatesConnector writes
(``token_ids`` int64 ``[seq]``, ``hidden_states [seq, layers, d]`` float32; docs/interop.md), for
``--model``'s width; each size takes the first N files. For each size, in each repeat (interleaved, so
that the machine's load falls on each alike), times:

- **read**: every file read alone (``safetensors.numpy.load_file`` and a pass over its values);
- **import**: ``actstore.write_corpus`` of the files (checks, the store's commit protocol, compression,
  digests and tables; the model loaded once before, its load not timed; the weights cache of this run,
  which knows the model after the first import: the first import's time is given on its own);
- **floor**: the same stored bytes (the hidden states cast to the storage dtype by torch) written plainly,
  one file a segment of the import's size, each fsynced: what this disk takes for a durable write;
- **cache floor**: the same without the fsync (the bytes left to the page cache): the like-for-like floor,
  since the import fsyncs its commit markers and tables but not its chunk files (docs/format.md, Commit
  protocol);

each **warm** (the files in the page cache: they were just read) and **cold** (each file fsynced and
evicted with ``posix_fadvise(POSIX_FADV_DONTNEED)`` first; the bytes still resident are counted with
``fincore`` and reported). Reports positions/s and the ratios import / read, floor / read and import /
floor, and the load average at the start and end::

    python benchmarks/bench_import.py --model smollm2-135m --requests 64,512,2048 --seq 128 --layer-ids 0,10,20,30
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.common import evict, vllm_parser, write_vllm_files  # noqa: E402


def resident(files: list[Path]) -> int | None:
    """Bytes of ``files`` in the page cache (``fincore``; None where it is missing)."""
    if shutil.which("fincore") is None:
        return None
    total = 0
    for k in range(0, len(files), 256):
        out = subprocess.run(
            ["fincore", "--bytes", "--noheadings", "--raw", "-o", "RES", *map(str, files[k : k + 256])],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        total += sum(int(x) for x in out.split())
    return total


def main() -> None:
    ap = vllm_parser(
        __doc__, "smollm2-135m", ("--requests", "64,512,2048", "sizes, comma-separated"), "0,10,20,30"
    )
    ap.add_argument("--dtype", default="float16", choices=("float16", "float32"), help="storage dtype")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-cold", action="store_true", help="warm figures only")
    ap.add_argument(
        "--predict", action="store_true", help="predictions from the last residual (the head's logits)"
    )
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    root = Path(tempfile.mkdtemp(prefix="bench-import-"))
    os.environ["ACTSTORE_WEIGHTS_DIR"] = str(root / "weights-cache")  # this run's cache, empty at first
    from safetensors.numpy import load_file

    from actstore.ingest.models.registry import load_model
    from actstore.jobs import import_acts

    loaded = load_model(a.model)
    import_acts.load_model = lambda name, **kw: loaded  # loaded once: the import, not the load, is timed
    d = loaded.model.config.hidden_size
    layer_ids = [int(x) for x in a.layer_ids.split(",")]
    sizes = sorted(int(x) for x in a.requests.split(","))
    every = write_vllm_files(root / "hs", sizes[-1], a.seq, len(layer_ids), d, loaded.model.config.vocab_size)
    seg = import_acts.segment_rows(len(layer_ids), d, a.dtype)
    load_start = os.getloadavg()

    def read_alone(files: list[Path]) -> float:
        t0 = time.perf_counter()
        total = 0.0
        for f in files:
            data = load_file(str(f))
            total += float(data["hidden_states"].sum(dtype=np.float64)) + int(data["token_ids"].sum())
        return time.perf_counter() - t0

    def write(files: list[Path]) -> float:
        out = root / "store"
        shutil.rmtree(out, ignore_errors=True)  # the previous store, removed outside the timing
        t0 = time.perf_counter()
        import_acts.write_corpus(
            out, files, layer_ids=layer_ids, model=a.model, storage_dtype=a.dtype, predict=a.predict
        )
        return time.perf_counter() - t0

    def write_floor(files: list[Path], durable: bool = True) -> float:
        out = root / "floor"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        t0 = time.perf_counter()
        buf = np.empty((seg, len(layer_ids), d), dtype=a.dtype)
        at, n = 0, 0

        def flush(rows: int) -> None:
            nonlocal n
            with open(out / f"{n}.bin", "wb") as f:
                f.write(buf[:rows].data)
                if durable:
                    f.flush()
                    os.fsync(f.fileno())
            n += 1

        for f in files:
            hs = load_file(str(f))["hidden_states"]
            i = 0
            while i < hs.shape[0]:
                m = min(hs.shape[0] - i, seg - at)
                # cast by torch, as the import casts (numpy converts to float16 a value at a time)
                torch.from_numpy(buf[at : at + m]).copy_(torch.from_numpy(hs[i : i + m]))
                at, i = at + m, i + m
                if at == seg:
                    flush(at)
                    at = 0
        if at:
            flush(at)
        return time.perf_counter() - t0

    first_s = write(every[: sizes[0]])  # the first import: the weights extracted and hashed (fresh cache)
    results = []
    for n in sizes:
        files = every[:n]
        positions = n * a.seq
        times: dict[str, list[float]] = {}
        left: list[float] = []

        for _ in range(a.repeats):
            for cold in (False,) if a.no_cold else (False, True):
                tag = "cold" if cold else "warm"
                for name, fn in (
                    ("read", read_alone),
                    ("import", write),
                    ("floor", write_floor),
                    ("cache_floor", lambda files: write_floor(files, durable=False)),
                ):
                    if cold:
                        evict(files)
                        kept = resident(files)
                        if kept is not None:
                            left.append(kept / sum(f.stat().st_size for f in files))
                    else:
                        read_alone(files)  # warm: in the page cache
                    times.setdefault(f"{name}_{tag}", []).append(fn(files))
        med = {k: statistics.median(v) for k, v in times.items()}
        row: dict[str, object] = {"requests": n, "positions": positions}
        for tag in ("warm",) if a.no_cold else ("warm", "cold"):
            r, w, fl, cf = (med[f"{k}_{tag}"] for k in ("read", "import", "floor", "cache_floor"))
            row[tag] = {
                "read_positions_per_s": round(positions / r),
                "import_positions_per_s": round(positions / w),
                "floor_positions_per_s": round(positions / fl),
                "import_to_read": r / w,
                "floor_to_read": r / fl,
                "import_to_floor": fl / w,
                "cache_floor_positions_per_s": round(positions / cf),
                "cache_floor_to_read": r / cf,
                "import_to_cache_floor": cf / w,
            }
        row["seconds"] = times
        row["resident_after_evict"] = max(left) if left else None
        results.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "seconds"}), flush=True)
    result = {
        "first_import_s": first_s,
        "first_import_positions": sizes[0] * a.seq,
        "sizes": results,
        "load_start": load_start,
        "load_end": os.getloadavg(),
        "config": vars(a),
    }
    print(json.dumps(result, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    shutil.rmtree(root)


if __name__ == "__main__":
    main()
