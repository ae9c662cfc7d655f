"""``actstore import --procs N`` against ``actstore import``, whole commands (each a fresh process: Python,
torch and transformers imported, the model loaded, every rank's too), on vLLM-layout files of several
sizes, in turn (single, ranks, single, ranks, ...), files warm; medians, and the ratio ranks / single.

Writes the largest of ``--requests`` files in the layout vLLM's ExampleHiddenStatesConnector writes
(``benchmarks/common.write_vllm_files``) for ``--model``'s width; each size imports the first N files
(a folder of links). ``--no-predict`` on both sides unless ``--predict``::

    python benchmarks/bench_import_procs.py --model tiny-llama --requests 79,782,7813 --layer-ids 0,2
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

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.common import vllm_parser, write_vllm_files  # noqa: E402


def main() -> None:
    ap = vllm_parser(
        __doc__, "tiny-llama", ("--requests", "79,782,7813", "sizes in files, comma-separated"), "0,2"
    )
    ap.add_argument("--dtype", default="float16", choices=("float16", "float32"), help="storage dtype")
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--predict", action="store_true", help="predictions from the last residual")
    a = ap.parse_args()

    from actstore.ingest.models.registry import load_model

    loaded = load_model(a.model)
    d, vocab = loaded.model.config.hidden_size, loaded.model.config.vocab_size
    del loaded
    layer_ids = [int(x) for x in a.layer_ids.split(",")]
    sizes = sorted(int(x) for x in a.requests.split(","))
    t = Path(tempfile.mkdtemp(prefix="bench-import-procs-"))
    result: dict[str, object] = {"load_start": os.getloadavg()[0], "sizes": []}
    try:
        files = write_vllm_files(t / "hs", sizes[-1], a.seq, len(layer_ids), d, vocab)
        for n in sizes:
            folder = t / f"hs{n}"
            folder.mkdir()
            for f in files[:n]:
                (folder / f.name).symlink_to(f)
            base = [
                *[sys.executable, "-m", "actstore.cli", "import", str(folder), "--layer-ids", a.layer_ids],
                *["--model", a.model, "--dtype", a.dtype, "--out", str(t / "store"), "--overwrite"],
                "--predict" if a.predict else "--no-predict",
            ]
            times: dict[str, list[float]] = {"single": [], "ranks": []}
            for r in range(a.repeats + 1):  # the first round unrecorded (the weights cache, the page cache)
                for arm in ("single", "ranks") if r % 2 == 0 else ("ranks", "single"):
                    cmd = base + (["--procs", str(a.procs)] if arm == "ranks" else [])
                    t0 = time.perf_counter()
                    subprocess.run(cmd, check=True, capture_output=True, cwd=REPO)
                    if r:
                        times[arm].append(time.perf_counter() - t0)
            positions = n * a.seq
            med = {k: statistics.median(v) for k, v in times.items()}
            row = {
                "files": n,
                "positions": positions,
                "single_s": round(med["single"], 3),
                "ranks_s": round(med["ranks"], 3),
                "ranks_over_single": round(med["ranks"] / med["single"], 3),
                "single_positions_per_s": round(positions / med["single"]),
                "ranks_positions_per_s": round(positions / med["ranks"]),
            }
            print(json.dumps(row), flush=True)
            result["sizes"].append(row)  # type: ignore[attr-defined]
            shutil.rmtree(folder)
        result["load_end"] = os.getloadavg()[0]
        print(json.dumps(result, indent=1))
        if a.json:
            Path(a.json).write_text(json.dumps(result, indent=1))
    finally:
        shutil.rmtree(t, ignore_errors=True)


if __name__ == "__main__":
    main()
