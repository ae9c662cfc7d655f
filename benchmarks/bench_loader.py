"""The training feed side by side: ``Selection.loader`` (shuffled and sequential) against reading the
store's raw chunks, a Hugging Face ``datasets`` Arrow cache read as SAELens reads its cached
activations, and a ``torch.save`` megabatch layout like Activault's; warm (page cache) and cold
(``posix_fadvise(DONTNEED)`` on every file of the layout before the round), in interleaved rounds.

    python benchmarks/bench_loader.py STORE [STORE ...] --kind resid --layer 1 --rounds 3 --json out.json

Every method delivers the same rows (the whole store, one layer of one kind) as torch tensors
``[batch, F]`` of ``--dtype`` (float32 by default; float16 is the storage dtype, no conversion) and
is timed over one full epoch:

- ``raw_seq_segment``: the store's chunks of that layer decoded with the store's own direct reader
  (``actstore.core.chunks.LocalChunks``), one read per segment in store order; no conversion, no
  batching (the floor any reader of the store pays).  ``raw_seq_chunk``: the same one chunk at a time.
- ``loader_seq``: ``Selection.loader(shuffle=False)``; ``loader_shuffled``: ``shuffle=True`` (a
  permutation of the chunks and an in-memory shuffle of ``--buffer-rows``-row windows);
  ``--workers`` reader threads (each count measured; the ratios take the best).
- ``hf_saelens``: ``Selection.to_hf_dataset`` (SAELens's column layout, rows in store order as
  SAELens's ``CacheActivationsRunner`` leaves its local cache: it saves the shards unshuffled and
  shuffles only the copy it pushes to the hub), read as SAELens's ``ActivationsStore`` reads a
  cache: ``Dataset.load_from_disk``, ``set_format("torch")``, contiguous slices of
  ``--buffer-rows`` rows, reshaped to ``[rows, d_in]`` and permuted in memory (``torch.randperm``),
  then cut into batches.  Its order mixes rows within one buffer only (no chunk permutation).
  ``hf_shuffled_index``: the same cache with ``Dataset.shuffle(seed)`` at read time (an indices
  mapping: a global shuffle, read row by row through the mapping).  The write-time global
  shuffle (``shuffle(seed).flatten_indices()``, what a hub copy holds) is timed as an export.
- ``activault``: ``torch.save`` files of ``--file-rows`` rows (float16, store order); an epoch loads
  the files in a shuffled order, holds enough of them for ``--buffer-rows`` rows, permutes those rows
  and cuts batches.

rows/s is rows delivered per second of wall time (and, less sensitive to a loaded machine, per second
of this process's CPU time, all threads); MB/s counts the rows' bytes as stored (float16, the
store's dtype).  The export times (``to_hf_dataset``, the flattened copy, the megabatch files) are
measured once per store.  Timings are medians over the rounds; methods run in a shuffled order each
round.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.common import emit

DTYPES = {"float32": torch.float32, "float16": torch.float16}


def drop_cache(root: Path) -> None:
    """Ask the kernel to drop the cached pages of every file under ``root`` (no root needed; pages
    that are mapped or dirty stay)."""
    for p in root.rglob("*") if root.is_dir() else [root]:
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def batches(x: torch.Tensor, bs: int) -> Iterator[torch.Tensor]:
    for i in range(0, x.shape[0], bs):
        yield x[i : i + bs]


def raw_reader(store: Any, kind: str, layer: int, per: str) -> Callable[[], int]:
    from actstore.core.arrays import axis1_plan
    from actstore.core.chunks import local_chunks

    name = {"resid": "resid", "mlp": "mlp", "z": "z"}[kind]

    def run() -> int:
        n = 0
        for seg in sorted(store.commits):
            arr = store.array(seg, name)
            lc = local_chunks(arr)
            assert lc is not None, "raw reads need a local store with the default codecs"
            blocks, _ = axis1_plan(arr.shape, arr.chunks, [layer])
            n_chunks = -(-int(arr.shape[0]) // int(arr.chunks[0]))
            if per == "segment":
                n += lc.read(0, n_chunks, blocks).shape[0]
            else:
                for c in range(n_chunks):
                    n += lc.read(c, c + 1, blocks).shape[0]
        return n

    return run


def loader_reader(
    sel: Any, kind: str, layer: int, args: argparse.Namespace, shuffle: bool, workers: int
) -> Callable[[], int]:
    feed = sel.loader(
        kind,
        layers=[layer],
        batch_size=args.batch_size,
        buffer_rows=args.buffer_rows,
        workers=workers,
        shuffle=shuffle,
        flatten=True,
        unit_rows=args.unit_rows,
        dtype=args.dtype,
    )

    def run() -> int:
        return sum(x.shape[0] for x in feed)  # each pass is the next epoch: a new order

    return run


def hf_reader(path: Path, column: str, args: argparse.Namespace, shuffle: bool) -> Callable[[], int]:
    import datasets

    epoch = [0]

    def run() -> int:
        ds = datasets.Dataset.load_from_disk(str(path))
        if shuffle:
            ds = ds.shuffle(seed=epoch[0])
        epoch[0] += 1
        ds.set_format("torch", columns=[column])
        n, B = 0, args.buffer_rows
        for i in range(0, len(ds), B):
            acts = ds[i : i + B][column]  # [rows, 1, d_in]
            acts = acts.reshape(-1, acts.shape[-1])
            acts = acts[torch.randperm(acts.shape[0])]
            n += sum(b.shape[0] for b in batches(acts.to(DTYPES[args.dtype]), args.batch_size))
        return n

    return run


def write_megabatches(sel: Any, kind: str, layer: int, folder: Path, file_rows: int) -> float:
    t0 = time.perf_counter()
    folder.mkdir(parents=True, exist_ok=True)
    pending: list[np.ndarray] = []
    held, k = 0, 0
    for _, x in sel.iter_features(kind, layers=[layer], batch_rows=4096):
        pending.append(x.reshape(x.shape[0], -1).astype(np.float16))
        held += x.shape[0]
        while held >= file_rows:
            cat = np.concatenate(pending)
            torch.save({"states": torch.from_numpy(cat[:file_rows].copy())}, folder / f"mb{k:06d}.pt")
            k += 1
            pending, held = [cat[file_rows:]], cat.shape[0] - file_rows
    if held:
        torch.save({"states": torch.from_numpy(np.concatenate(pending))}, folder / f"mb{k:06d}.pt")
    return time.perf_counter() - t0


def activault_reader(folder: Path, args: argparse.Namespace) -> Callable[[], int]:
    files = sorted(folder.glob("mb*.pt"))
    epoch = [0]

    def run() -> int:
        order = list(files)
        random.Random(epoch[0]).shuffle(order)
        epoch[0] += 1
        n, held, buf = 0, 0, []
        for i, f in enumerate(order):
            x = torch.load(f, weights_only=True)["states"]
            buf.append(x)
            held += x.shape[0]
            if held >= args.buffer_rows or i == len(order) - 1:
                acts = torch.cat(buf)
                acts = acts[torch.randperm(acts.shape[0])].to(DTYPES[args.dtype])
                n += sum(b.shape[0] for b in batches(acts, args.batch_size))
                buf, held = [], 0
        return n

    return run


def bench_store(path: Path, args: argparse.Namespace) -> dict[str, Any]:
    import actstore
    from actstore.query.select.hf_export import hook_name_of

    store = actstore.open(path)
    sel = store.select()
    n = len(sel)
    F = int(np.prod(sel.limit(1).features(args.kind, layers=[args.layer]).shape[1:]))
    row_bytes = F * np.dtype(store.manifest.storage_dtype.replace("bfloat16", "float16")).itemsize
    work = Path(args.work) / path.name
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    exports: dict[str, float] = {}
    only = set(args.only.split(",")) if args.only else None  # --only: the other layouts are not written
    if only is None or only & {"hf_saelens", "hf_shuffled_index"}:
        t0 = time.perf_counter()
        sel.to_hf_dataset(work / "hf", args.kind, layers=[args.layer], dtype="float16")
        exports["to_hf_dataset_s"] = time.perf_counter() - t0
        import datasets

        datasets.disable_progress_bars()
        t0 = time.perf_counter()
        datasets.Dataset.load_from_disk(str(work / "hf")).shuffle(seed=0).flatten_indices().save_to_disk(
            str(work / "hf_flat")
        )
        exports["hf_shuffle_flatten_s"] = time.perf_counter() - t0
        shutil.rmtree(work / "hf_flat")
    if only is None or "activault" in only:
        exports["megabatch_write_s"] = write_megabatches(
            sel, args.kind, args.layer, work / "mb", args.file_rows
        )
    column = hook_name_of(args.kind, args.layer, store.geometry.n_layers)
    seg_root = path / "segments"
    methods: dict[str, tuple[Callable[[], int], list[Path]]] = {
        "raw_seq_segment": (raw_reader(store, args.kind, args.layer, "segment"), [seg_root]),
        "raw_seq_chunk": (raw_reader(store, args.kind, args.layer, "chunk"), [seg_root]),
        **{
            f"loader_{'shuffled' if sh else 'seq'}_w{w}": (
                loader_reader(sel, args.kind, args.layer, args, sh, w),
                [seg_root],
            )
            for w in (int(x) for x in args.workers.split(","))
            for sh in (False, True)
        },
        "hf_saelens": (hf_reader(work / "hf", column, args, False), [work / "hf"]),
        "hf_shuffled_index": (hf_reader(work / "hf", column, args, True), [work / "hf"]),
        "activault": (activault_reader(work / "mb", args), [work / "mb"]),
    }
    if args.only:
        methods = {k: v for k, v in methods.items() if k in args.only.split(",")}
    times: dict[str, dict[str, list[float]]] = {m: {"warm": [], "cold": []} for m in methods}
    cpu: dict[str, dict[str, list[float]]] = {m: {"warm": [], "cold": []} for m in methods}
    for fn, _ in methods.values():  # one untimed pass each: imports, page cache, opened arrays
        assert fn() == n
    rng = random.Random(0)
    for _ in range(args.rounds):
        order = list(methods)
        rng.shuffle(order)
        for m in order:
            fn, roots = methods[m]
            for mode in ("cold", "warm"):  # warm right after cold: the pages the cold pass read
                if mode == "cold":
                    for r in roots:
                        drop_cache(r)
                t0, c0 = time.perf_counter(), time.process_time()
                got = fn()
                times[m][mode].append(time.perf_counter() - t0)
                cpu[m][mode].append(time.process_time() - c0)
                assert got == n, (m, got, n)
    out: dict[str, Any] = {
        "store": str(path),
        "rows": n,
        "kind": args.kind,
        "layer": args.layer,
        "row_bytes_stored": row_bytes,
        "chunk_rows": store.manifest.chunk_rows,
        "segment_size": store.manifest.segment_size,
        "exports_s": {k: round(v, 3) for k, v in exports.items()},
        "methods": {},
    }
    for m, t in times.items():
        out["methods"][m] = {
            mode: {
                "median_s": round(statistics.median(v), 4),
                "rows_per_s": round(n / statistics.median(v)),
                "mb_per_s": round(n * row_bytes / statistics.median(v) / 1e6, 2),
                "all_s": [round(x, 4) for x in v],
                "cpu_median_s": round(statistics.median(cpu[m][mode]), 4),
                "rows_per_cpu_s": round(n / max(statistics.median(cpu[m][mode]), 1e-9)),
            }
            for mode, v in t.items()
        }
    meth = out["methods"]
    shuffled = [m for m in meth if m.startswith("loader_shuffled")]
    raws = [m for m in meth if m.startswith("raw_seq")]
    if shuffled and raws:
        for mode in ("warm", "cold"):
            for unit in ("rows_per_s", "rows_per_cpu_s"):
                tag = "" if unit == "rows_per_s" else "_cpu"
                best_raw = max(meth[r][mode][unit] for r in raws)
                sh = max(meth[m][mode][unit] for m in shuffled)  # the best worker count
                out[f"shuffled_over_raw_{mode}{tag}"] = round(sh / best_raw, 3)
                for other in ("hf_saelens", "hf_shuffled_index", "activault"):
                    if other in meth:
                        out[f"shuffled_over_{other}_{mode}{tag}"] = round(sh / meth[other][mode][unit], 3)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return out


def breakdown(path: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Where one shuffled epoch's CPU goes (``--breakdown``): the raw read, the loader's reads into its
    windows alone (no batches), a window's gather (and conversion) alone on rows already in memory,
    and whole epochs float32 / float16, shuffled / sequential, 0 workers; medians of ``--rounds``."""
    import threading

    import actstore

    store = actstore.open(path)
    sel = store.select()
    n = len(sel)

    def loader(**kw: Any) -> Any:
        return sel.loader(
            args.kind,
            layers=[args.layer],
            batch_size=args.batch_size,
            buffer_rows=args.buffer_rows,
            workers=0,
            flatten=True,
            unit_rows=args.unit_rows,
            **kw,
        )

    feed = loader()

    def windows() -> int:
        got = 0
        for w in feed._windows(0, 0, threading.Event()):
            got += w.rows.shape[0]
            w.release()
        return got

    F = int(np.prod(feed._row_shape))
    rows = np.empty((min(args.buffer_rows, n), F), dtype=np.float16)  # allocated as the loader's windows are
    rows.fill(1.0)
    win = torch.from_numpy(rows)
    perm = torch.randperm(win.shape[0])

    def gather(dtype: torch.dtype) -> int:
        got = 0
        while got < n:
            for q in range(0, win.shape[0], args.batch_size):
                x = win.index_select(0, perm[q : q + args.batch_size]).to(dtype)
                got += x.shape[0]
        return n

    def epoch(**kw: Any) -> Callable[[], int]:
        f = loader(**kw)
        return lambda: sum(x.shape[0] for x in f)

    parts: dict[str, Callable[[], int]] = {
        "raw_seq_segment": raw_reader(store, args.kind, args.layer, "segment"),
        "loader_reads_into_windows": windows,
        "gather_float16_in_memory": lambda: gather(torch.float16),
        "gather_and_convert_float32_in_memory": lambda: gather(torch.float32),
        "loader_shuffled_float32": epoch(),
        "loader_shuffled_float16": epoch(dtype="float16"),
        "loader_seq_float32": epoch(shuffle=False),
        "loader_seq_float16": epoch(shuffle=False, dtype="float16"),
    }
    out: dict[str, Any] = {"store": str(path), "rows": n, "load_before": os.getloadavg()}
    for name, fn in parts.items():
        fn()  # untimed: imports, page cache, buffers
        wall, cpu = [], []
        for _ in range(args.rounds):
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        out[name] = {"wall_s": round(statistics.median(wall), 4), "cpu_s": round(statistics.median(cpu), 4)}
    out["load_after"] = os.getloadavg()
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("stores", type=Path, nargs="+")
    p.add_argument("--kind", default="resid", choices=["resid", "mlp", "z"])
    p.add_argument("--layer", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=4096)
    p.add_argument("--buffer-rows", type=int, default=1 << 15)
    p.add_argument("--workers", default="0,1", help="the loader's worker counts to measure")
    p.add_argument("--unit-rows", type=int, default=None, help="the loader's unit (default: its own)")
    p.add_argument("--file-rows", type=int, default=4096, help="rows per torch.save megabatch file")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--dtype",
        default="float32",
        choices=sorted(DTYPES),
        help="what every method delivers (float16: as stored)",
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--work", default="/tmp/bench-loader-work", help="where the other layouts are written")
    p.add_argument("--only", default="", help="comma-separated methods")
    p.add_argument("--keep", action="store_true", help="keep the exported layouts")
    p.add_argument("--json", default=None)
    p.add_argument(
        "--breakdown", action="store_true", help="where a shuffled epoch's CPU goes, warm, instead"
    )
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.breakdown:
        emit(
            {
                "settings": vars(args) | {"stores": [str(s) for s in args.stores]},
                "breakdown": [breakdown(s, args) for s in args.stores],
            },
            args.json,
        )
        return
    results = [bench_store(s, args) for s in args.stores]
    emit(
        {
            "settings": {k: v for k, v in vars(args).items() if k not in ("stores", "json")},
            "load": os.getloadavg(),
            "stores": results,
        },
        args.json,
    )


if __name__ == "__main__":
    main()
