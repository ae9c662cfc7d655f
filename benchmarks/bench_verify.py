"""``actstore verify`` against reading every file of the store once, for the two hashes a commit marker
may list a segment's objects with: SHA-256 (format 3 and before) and XXH3-128 (format 4).

Builds stores of ``--positions`` (10^4 / 10^5 / 10^6 by default) by importing vLLM-layout files
(``benchmarks.common.write_vllm_files``) with ``--model`` (the tiny Llama by default), each size twice:
once as this code writes it (XXH3-128) and once with the writer held at SHA-256 and the manifest's
version set to 3, which is what the code before format 4 wrote (the same bytes under ``segments/``).
Then, rounds interleaved, times ``actstore verify`` in a fresh process (Python's start and imports
included) and ``verify_store`` in this one (the store opened, the checks alone), on each store, and the
read of every file of the store once, on threads (``bench_scale.read_all``: what verify must at least
do), and that read together with the model's shared weights (``--weights shared``: outside the
store's root, and checked by verify too).  Reports medians, verify / read as a rate ratio (read
seconds / verify seconds), the CPU seconds of each command, and xxh3 / sha256::

    python benchmarks/bench_verify.py --positions 10000,100000,1000000 --rounds 3
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.bench_scale import read_all  # noqa: E402
from benchmarks.common import emit, vllm_parser, write_vllm_files  # noqa: E402


def as_format_3(store: Path) -> None:
    """Set the manifest's version to 3 (the markers already list SHA-256, as format 3's do)."""
    from actstore.core.manifest import CHECKSUM_KEY, seal

    path = store / "manifest.json"
    d = json.loads(path.read_text())
    d.pop(CHECKSUM_KEY)
    d["format_version"] = 3
    path.write_text(json.dumps(seal(d), sort_keys=True))


def verify_once(store: Path) -> tuple[float, float]:
    """Wall and CPU seconds of ``actstore verify STORE`` in a fresh process (which must pass)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    r = subprocess.run(
        [sys.executable, "-m", "actstore.cli", "verify", str(store)], capture_output=True, text=True, cwd=REPO
    )
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode != 0:
        raise SystemExit(f"verify failed on {store}: {r.stdout[-500:]} {r.stderr[-500:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    ap = vllm_parser(
        __doc__, "tiny-llama", ("--positions", "10000,100000,1000000", "sizes, comma-separated"), "0,2"
    )
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-verify-"))
    os.environ["ACTSTORE_WEIGHTS_DIR"] = str(root / "weights-cache")
    import actstore
    import actstore.core.writer as writer
    from actstore.core.verify import verify_store
    from actstore.ingest.models.registry import load_model
    from actstore.jobs import import_acts

    loaded = load_model(a.model)
    import_acts.load_model = lambda name, **kw: loaded
    layer_ids = [int(x) for x in a.layer_ids.split(",")]
    sizes = sorted(int(x) for x in a.positions.split(","))
    n_files = [-(-n // a.seq) for n in sizes]
    every = write_vllm_files(
        root / "hs",
        n_files[-1],
        a.seq,
        len(layer_ids),
        loaded.model.config.hidden_size,
        loaded.model.config.vocab_size,
    )
    stores: dict[tuple[int, str], Path] = {}
    try:
        for n, k in zip(sizes, n_files, strict=True):
            for algorithm in ("sha256", "xxh3"):
                out = root / f"s{n}-{algorithm}"
                writer.OBJECT_HASH_FROM = 4 if algorithm == "xxh3" else 1 << 30  # (the code before: SHA-256)
                import_acts.write_corpus(out, every[:k], layer_ids=layer_ids, model=a.model, predict=False)
                if algorithm == "sha256":
                    as_format_3(out)
                stores[(n, algorithm)] = out
        writer.OBJECT_HASH_FROM = 4
        shutil.rmtree(root / "hs")
        load_start = os.getloadavg()
        runs: dict[str, list[float]] = {}
        for _ in range(a.rounds):
            for (n, algorithm), store in stores.items():
                runs.setdefault(f"{n} read", []).append(read_all(store))
                runs.setdefault(f"{n} weights read", []).append(read_all(root / "weights-cache"))
                wall, cpu = verify_once(store)
                runs.setdefault(f"{n} {algorithm} verify", []).append(wall)
                runs.setdefault(f"{n} {algorithm} verify cpu", []).append(cpu)
                t0 = time.perf_counter()
                assert verify_store(actstore.open(store)).ok
                runs.setdefault(f"{n} {algorithm} checks", []).append(time.perf_counter() - t0)
        med = {k: statistics.median(v) for k, v in runs.items()}
        result: dict[str, Any] = {"model": a.model, "rounds": a.rounds, "load_start": load_start}
        for n in sizes:
            files = [p for p in stores[(n, "xxh3")].rglob("*") if p.is_file()]
            row: dict[str, Any] = {
                "store_bytes": sum(p.stat().st_size for p in files),
                "files": len(files),
                "read_s": round(med[f"{n} read"], 4),
                "weights_read_s": round(med[f"{n} weights read"], 4),
            }
            for algorithm in ("sha256", "xxh3"):
                v = med[f"{n} {algorithm} verify"]
                row[f"verify_{algorithm}_s"] = round(v, 3)
                row[f"verify_{algorithm}_cpu_s"] = round(med[f"{n} {algorithm} verify cpu"], 3)
                row[f"verify_{algorithm}_of_read_rate"] = round(med[f"{n} read"] / v, 3)
                c = med[f"{n} {algorithm} checks"]
                row[f"checks_{algorithm}_s"] = round(c, 4)
                row[f"checks_{algorithm}_of_read_rate"] = round(med[f"{n} read"] / c, 3)
                both = med[f"{n} read"] + med[f"{n} weights read"]
                row[f"checks_{algorithm}_of_read_with_weights_rate"] = round(both / c, 3)
            row["xxh3_over_sha256_time"] = round(row["verify_xxh3_s"] / row["verify_sha256_s"], 3)
            row["checks_xxh3_over_sha256_time"] = round(row["checks_xxh3_s"] / row["checks_sha256_s"], 3)
            result[str(n)] = row
        result["load_end"] = os.getloadavg()
        emit(result, a.json)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
