"""Import rate of vLLM ``extract_hidden_states`` files (``actstore import``) against reading them alone.

Writes ``--requests`` files in the layout vLLM's ExampleHiddenStatesConnector writes (``token_ids``
int64 ``[seq]``, ``hidden_states [seq, layers, d]``; docs/interop.md), for ``--model``'s width, then
times (median of ``--repeats``) reading every file alone (``safetensors.numpy.load_file`` and a pass
over its values) and ``actstore.write_corpus`` of the folder (checks, the store's commit protocol,
compression and tables, the model load excluded: it is loaded once before).  Reports positions/s of
each and their ratio (target >= 80%), and beside them, in the same run: the import's marginal rate
(the import of all the files against that of the first half: the store's creation, which writes the
model's weights, cancels) and the write floor (the stored bytes, cast to the storage dtype, written
to one file a request: what the disk alone takes)::

    python benchmarks/bench_import.py --model smollm2-135m --requests 64 --seq 128 --layer-ids 0,10,20,30
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--layer-ids", default="0,10,20,30")
    ap.add_argument("--dtype", default="float16", choices=("float16", "float32"), help="storage dtype")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--predict", action="store_true", help="predictions from the last residual (the head's logits)"
    )
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from safetensors.numpy import load_file
    from safetensors.torch import save_file

    from actstore.ingest.models.registry import load_model
    from actstore.jobs import import_acts

    loaded = load_model(a.model)
    import_acts.load_model = lambda name, **kw: (
        loaded
    )  # loaded once: the import, not the model load, is timed
    d = loaded.model.config.hidden_size
    layer_ids = [int(x) for x in a.layer_ids.split(",")]
    root = Path(tempfile.mkdtemp(prefix="bench-import-"))
    folder = root / "hs"
    folder.mkdir()
    rng = np.random.default_rng(0)
    vocab = loaded.model.config.vocab_size
    for k in range(a.requests):
        ids = torch.from_numpy(rng.integers(0, vocab, size=a.seq))
        hs = torch.from_numpy(rng.standard_normal((a.seq, len(layer_ids), d), dtype=np.float32)).to(
            torch.bfloat16
        )
        save_file({"hidden_states": hs.float(), "token_ids": ids}, str(folder / f"req-{k:05d}.safetensors"))
    positions = a.requests * a.seq

    def read_alone() -> float:
        t0 = time.perf_counter()
        total = 0.0
        for f in sorted(folder.glob("*.safetensors")):
            data = load_file(str(f))
            total += float(data["hidden_states"].sum(dtype=np.float64)) + int(data["token_ids"].sum())
        return time.perf_counter() - t0

    def write(files: list[Path] | None = None) -> float:
        out = root / "store"
        shutil.rmtree(out, ignore_errors=True)  # the previous repeat's store, removed outside the timing
        t0 = time.perf_counter()
        import_acts.write_corpus(
            out,
            folder if files is None else files,
            layer_ids=layer_ids,
            model=a.model,
            storage_dtype=a.dtype,
            predict=a.predict,
        )
        return time.perf_counter() - t0

    def write_floor() -> float:
        out = root / "floor"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        t0 = time.perf_counter()
        for k, f in enumerate(sorted(folder.glob("*.safetensors"))):
            load_file(str(f))["hidden_states"].astype(a.dtype).tofile(out / f"{k}.bin")
        return time.perf_counter() - t0

    half = sorted(folder.glob("*.safetensors"))[: a.requests // 2]
    reads, writes, halves, floors = [], [], [], []
    for _ in range(a.repeats):  # interleaved: the machine's load falls on each alike
        reads.append(read_alone())
        writes.append(write())
        halves.append(write(half))
        floors.append(write_floor())
    r, w = statistics.median(reads), statistics.median(writes)
    margin = statistics.median(x - y for x, y in zip(writes, halves))
    fl = statistics.median(floors)
    result = {
        "positions": positions,
        "read_positions_per_s": positions / r,
        "import_positions_per_s": positions / w,
        "ratio": r / w,
        "marginal_import_positions_per_s": (positions - len(half) * a.seq) / margin,
        "marginal_ratio": r / positions * (positions - len(half) * a.seq) / margin,
        "write_floor_positions_per_s": positions / fl,
        "import_to_floor": fl / w,
        "read_s": reads,
        "import_s": writes,
        "half_import_s": halves,
        "floor_s": floors,
        "config": vars(a),
    }
    print(json.dumps(result, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    shutil.rmtree(root)


if __name__ == "__main__":
    main()
