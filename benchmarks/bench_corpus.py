"""Corpus-mode ingest (``actstore ingest --positions all``) of FewRel sentences as plain text.

Writes the first ``--documents`` sentences of FewRel's ``val_wiki.json`` (each instance's tokens
joined by spaces, relations in file order) to a text file, one document a line, runs ``actstore
ingest --positions all`` on it in a child process and reports wall time, positions, positions/s,
bytes on disk (segments, tables, the whole store) and the child's peak RSS::

    python benchmarks/bench_corpus.py --documents 3300 --kinds resid,mlp --layers 6,12,18,24 \\
        --out /tmp/corpus-bench --json OUT.json

The store is removed afterwards unless ``--keep``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

DATA = Path(os.environ.get("ACTSTORE_DATA") or Path(__file__).resolve().parents[2] / "shared" / "data")


def fewrel_text(path: Path, n: int) -> list[str]:
    data = json.loads(path.read_text())
    docs: list[str] = []
    for instances in data.values():
        for inst in instances:
            docs.append(" ".join(t for t in inst["tokens"] if t.strip()))
            if len(docs) == n:
                return docs
    return docs


def tree_bytes(root: Path) -> int:
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--documents", type=int, default=3300)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--kinds", default="resid,mlp")
    ap.add_argument("--layers", default="6,12,18,24")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--segment-size", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="/tmp/corpus-bench")
    ap.add_argument("--json", default=None)
    ap.add_argument("--keep", action="store_true")
    a = ap.parse_args()
    out = Path(a.out)
    text = out.with_name(out.name + "-docs.txt")
    docs = fewrel_text(DATA / "fewrel" / "val_wiki.json", a.documents)
    text.write_text("\n".join(docs) + "\n", encoding="utf-8")
    cmd = [
        sys.executable, "-m", "actstore.cli", "ingest", "--model", a.model, "--dataset", f"text:{text}",
        "--positions", "all", "--kinds", a.kinds, "--layers", a.layers, "--batch-size", str(a.batch_size),
        "--segment-size", str(a.segment_size), "--threads", str(a.threads), "--out", str(out),
        "--overwrite", "--quiet", "--json",
    ]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode:
        sys.exit(f"ingest failed: {proc.stderr.strip()}")
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    positions = int(summary["examples"])
    result = {
        "documents": len(docs),
        "positions": positions,
        "wall_s": round(wall, 1),
        "ingest_s": summary["seconds"],
        "positions_per_s_wall": round(positions / wall, 1),
        "positions_per_s_ingest": round(positions / summary["seconds"], 1),
        "segments_bytes": tree_bytes(out / "segments"),
        "tables_bytes": tree_bytes(out / "tables"),
        "store_bytes": tree_bytes(out),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, 1),
        "command": " ".join(cmd),
    }
    result["segment_bytes_per_position"] = round(result["segments_bytes"] / positions, 1)
    print(json.dumps(result, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    if not a.keep:
        shutil.rmtree(out, ignore_errors=True)
    text.unlink()


if __name__ == "__main__":
    main()
