"""Peak memory of ``actstore import`` (``write_corpus``) of vLLM extract_hidden_states files, by size.

Writes N request files of ``--seq`` tokens x 4 layer ids at the model's width (float32, the layout of
vLLM's ExampleHiddenStatesConnector), loads the model once, then imports them into a float16 store
(no predictions) and prints the peak RSS (``ru_maxrss``) above the RSS after the model load, the
files' size and the import rate.  Each size runs in its own process (``ru_maxrss`` only grows).

    python benchmarks/bench_import_memory.py --requests 512,2048

Flat in the number of files: the files are read on demand (ingest/external.py, FileRows).
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def one(n: int, model: str, seq: int) -> str:
    import numpy as np
    import torch
    from safetensors.torch import save_file

    from actstore.ingest.models.registry import load_model
    from actstore.jobs import import_acts

    root = Path(tempfile.mkdtemp(prefix="bench-import-memory-"))
    os.environ["ACTSTORE_WEIGHTS_DIR"] = str(root / "weights-cache")
    try:
        loaded = load_model(model)
        import_acts.load_model = lambda name, **kw: loaded  # type: ignore[assignment]
        d = loaded.model.config.hidden_size
        layer_ids = [0, 10, 20, 30]
        rng = np.random.default_rng(0)
        (root / "hs").mkdir()
        for k in range(n):
            hs = torch.from_numpy(rng.standard_normal((seq, len(layer_ids), d), dtype=np.float32))
            ids = torch.from_numpy(rng.integers(0, 1000, size=seq))
            save_file({"hidden_states": hs, "token_ids": ids}, str(root / "hs" / f"r{k:05d}.safetensors"))
        files = sorted((root / "hs").glob("*.safetensors"))
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        t0 = time.perf_counter()
        import_acts.write_corpus(
            root / "s", files, layer_ids=layer_ids, model=model, storage_dtype="float16", predict=False
        )
        dt = time.perf_counter() - t0
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        mb = sum(f.stat().st_size for f in files) / 2**20
        return (
            f"{n} requests x {seq} tokens: files {mb:,.0f} MB; peak RSS +{peak - base:,.0f} MB above the "
            f"loaded model; import {dt:.1f} s ({n * seq / dt:,.0f} positions/s); load {os.getloadavg()[0]:.1f}"
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--requests", default="512,2048", help="sizes, comma-separated")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one is not None:
        print(one(a.one, a.model, a.seq), flush=True)
        return
    for n in (int(x) for x in a.requests.split(",")):
        cmd = [sys.executable, __file__, "--one", str(n), "--model", a.model, "--seq", str(a.seq)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        print(out.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
