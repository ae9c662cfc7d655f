"""Codec study on a real store's arrays: compression ratio and encode/decode speed.

For the ``z``, ``attn`` and ``v`` arrays (and ``resid``, ``mlp``) of a real store, as stored
(float16 unless the store says otherwise) and cut into the store's own chunks, each codec
encodes and decodes every chunk; ratio = raw bytes / encoded bytes, speeds are raw MB/s on
one thread.  The current choice (``actstore/core/arrays.py``) is Blosc(LZ4, byte shuffle); it was
Blosc(zstd, clevel 3, byte shuffle) until this study (results in benchmarks/README.md).

Codecs: none (raw), zstd levels 1/3/9 (no shuffle), lz4 (no shuffle), Blosc with byte shuffle
(zstd levels 1/3/5/9, lz4, lz4hc), Blosc with bit shuffle (zstd 3), and the same arrays
widened to float32 under Blosc(zstd 3, byte shuffle), i.e. what float16 storage saves.

    python benchmarks/bench_codecs.py [--quick] [--store PATH] [--json OUT]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.common import emit  # noqa: E402


def codecs() -> dict[str, Any]:
    from numcodecs import LZ4, Blosc, Zstd

    out: dict[str, Any] = {"none": None}
    for lvl in (1, 3, 9):
        out[f"zstd{lvl}"] = Zstd(level=lvl)
    out["lz4"] = LZ4()
    for lvl in (1, 3, 5, 9):
        out[f"blosc-zstd{lvl}-shuffle"] = Blosc(cname="zstd", clevel=lvl, shuffle=Blosc.SHUFFLE)
    out["blosc-lz4-shuffle"] = Blosc(cname="lz4", clevel=5, shuffle=Blosc.SHUFFLE)
    out["blosc-lz4hc-shuffle"] = Blosc(cname="lz4hc", clevel=5, shuffle=Blosc.SHUFFLE)
    out["blosc-zstd3-bitshuffle"] = Blosc(cname="zstd", clevel=3, shuffle=Blosc.BITSHUFFLE)
    return out


CURRENT = "blosc-lz4-shuffle"


def chunks_of(a: np.ndarray, rows: int) -> list[np.ndarray]:
    return [np.ascontiguousarray(a[i : i + rows]) for i in range(0, a.shape[0], rows)]


def measure(codec: Any, chunks: list[np.ndarray], repeats: int) -> dict[str, float | None]:
    raw = sum(c.nbytes for c in chunks)
    if codec is None:
        return {"ratio": 1.0, "encode_MBps": None, "decode_MBps": None}
    enc_t, dec_t = [], []
    encoded: list[bytes] = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        encoded = [codec.encode(c) for c in chunks]
        enc_t.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for e, c in zip(encoded, chunks):
            codec.decode(e, out=np.empty_like(c))
        dec_t.append(time.perf_counter() - t0)
    size = sum(len(e) for e in encoded)
    mb = raw / 1e6
    return {
        "ratio": raw / size,
        "encode_MBps": mb / statistics.median(enc_t),
        "decode_MBps": mb / statistics.median(dec_t),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--quick", action="store_true", help="one segment, 2 repeats (a 64-prompt store if none given)"
    )
    ap.add_argument("--store", default=None)
    ap.add_argument(
        "--prompts", type=int, default=None, help="prompts to ingest without --store (256; 64 quick)"
    )
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--json", dest="json_out", default=None)
    args = ap.parse_args()
    repeats = args.repeats or (2 if args.quick else 5)

    from numcodecs import Blosc, blosc

    import actstore

    blosc.set_nthreads(1)
    tmp = tempfile.mkdtemp(prefix="actstore-codecs-")
    path = args.store
    if path is None:
        from benchmarks.bench_query import make_store

        path = os.path.join(tmp, "store")
        make_store(path, args.prompts or (64 if args.quick else 256))
    store = actstore.open(path)
    m = store.manifest
    segs = sorted(store.commits)[: 1 if args.quick else None]
    result: dict[str, Any] = {
        "store": path,
        "storage_dtype": m.storage_dtype,
        "segments": len(segs),
        "threads": 1,
        "repeats": repeats,
        "arrays": {},
    }
    all_codecs = codecs()
    totals: dict[str, dict[str, float]] = {
        k: {"raw": 0.0, "enc": 0.0, "enc_s": 0.0, "dec_s": 0.0} for k in all_codecs
    }
    for name in ("z", "attn", "v", "resid", "mlp"):
        data = np.concatenate([np.asarray(store.array(s, name)[...]) for s in segs])
        rows = m.chunk_flat if name in ("attn", "v") else m.chunk_rows
        chunks = chunks_of(data, rows)
        per: dict[str, Any] = {
            "shape": list(data.shape),
            "dtype": str(data.dtype),
            "MB": data.nbytes / 1e6,
            "chunk_rows": rows,
        }
        for cname, codec in all_codecs.items():
            r = measure(codec, chunks, repeats)
            per[cname] = r
            tot = totals[cname]
            tot["raw"] += data.nbytes
            tot["enc"] += data.nbytes / float(r["ratio"] or 1.0)
            if r["encode_MBps"] and r["decode_MBps"]:
                tot["enc_s"] += data.nbytes / 1e6 / r["encode_MBps"]
                tot["dec_s"] += data.nbytes / 1e6 / r["decode_MBps"]
        if data.dtype == np.float16:
            wide = chunks_of(data.astype(np.float32), rows)
            per["float32-blosc-zstd3-shuffle"] = measure(
                Blosc(cname="zstd", clevel=3, shuffle=Blosc.SHUFFLE), wide, repeats
            )
        result["arrays"][name] = per
    result["all_arrays"] = {
        k: {
            "ratio": t["raw"] / t["enc"],
            "encode_MBps": t["raw"] / 1e6 / t["enc_s"] if t["enc_s"] else None,
            "decode_MBps": t["raw"] / 1e6 / t["dec_s"] if t["dec_s"] else None,
        }
        for k, t in totals.items()
    }
    result["current"] = CURRENT
    shutil.rmtree(tmp, ignore_errors=True)
    emit(result, args.json_out)
    print("\nall arrays together (raw MB/s on one thread):")
    print(f"{'codec':28s} {'ratio':>6s} {'encode':>8s} {'decode':>8s}")
    for k, v in result["all_arrays"].items():
        mark = "  <- current" if k == CURRENT else ""
        enc, dec = (f"{x:8.0f}" if x else f"{'-':>8s}" for x in (v["encode_MBps"], v["decode_MBps"]))
        print(f"{k:28s} {v['ratio']:6.3f} {enc} {dec}{mark}")


if __name__ == "__main__":
    main()
