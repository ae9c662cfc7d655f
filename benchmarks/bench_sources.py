"""Corpus stores with per-source factors (``--positions all --sources K``) and ``actstore dfa``, side by side.

For each size (tokens of a synthetic text corpus, one document a line), on a tiny random model
(``--model tiny-llama``, the default) or any model ``actstore ingest`` loads (``--model smollm2-135m``):

- capture: the fused capture with ``K`` sources (every position a target, host copy included) / a
  plain forward of the same windows in the same batches (the model's own ``forward``, no hooks),
  alternating batch by batch after one untimed batch each; and the whole ingest with ``--sources K``
  / without sources;
- bytes per token of the sources (``attn`` + ``v`` on disk and uncompressed) against ``resid`` at the
  same layers (and the uncompressed ratio SmolLM2-135M's geometry gives at this K, float16);
- DFA at one position: median wall time of ``dfa_rows(store, [row], u)`` over random rows;
- a new direction's top-k over every token (``dfa_top``) / reading those rows' ``attn``, ``z``, ``v``
  and ``mlp`` once (``read_rows``, in the same blocks: ``block_rows``), and that read's rate (rows/s,
  MB/s of float32); each arm cold (the store's files evicted from the page cache first, the ratio
  reported as ``dfa_top_vs_read_once``) then warm, the arms' order alternating over ``--top-rounds``.

Both sides of each ratio run in the same process, interleaved where they can be (batch by batch
for the capture), on ``--threads`` threads.

    python benchmarks/bench_sources.py --tokens 10000,100000 --k 16 --json OUT.json
    python benchmarks/bench_sources.py --model smollm2-135m --tokens 10000 --no-plain-ingest
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import actstore  # noqa: E402
from actstore.ingest.models.registry import load_model  # noqa: E402
from actstore.query.analyses.dfa import block_rows, dfa_rows, dfa_top  # noqa: E402
from actstore.query.select.corpus_sources import read_rows  # noqa: E402
from benchmarks.common import evict  # noqa: E402

WORDS = "the of and a to in is was for on as with by he at from his an were are which this be".split()


def corpus(path: Path, tokens: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    lines, n = [], 0
    while n < tokens:
        k = int(rng.integers(20, 200))
        lines.append(" ".join(rng.choice(WORDS, k)))
        n += k
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def tree_bytes(root: Path, name: str) -> int:
    return sum(f.stat().st_size for f in root.glob(f"segments/*/{name}/**/*") if f.is_file())


def capture_forward(model: torch.nn.Module, store: actstore.Store, k: int, batch: int) -> tuple[float, float]:
    """The same windows (the positions table's, every position a target) through the fused capture
    with ``k`` sources (host copy included) and through the model alone, batch by batch alternately,
    after one untimed batch through each: (capture seconds, plain forward seconds)."""
    from actstore.ingest.capture.architectures import architecture_for
    from actstore.ingest.capture.fused import BatchIndex, FusedCapture
    from actstore.ingest.capture.host import to_host

    pos = store.sql("SELECT document, window_index, token_id FROM positions ORDER BY row", format="pandas")
    wins = [g["token_id"].to_numpy().copy() for _, g in pos.groupby(["document", "window_index"], sort=False)]
    arch = architecture_for(model)
    L = arch.geometry(model).n_layers
    t_cap = t_plain = 0.0
    empty = torch.zeros(0, dtype=torch.long)
    with FusedCapture(model, arch, "float16") as cap:
        # the first batch once more before the timed ones, through both, not counted: each side's
        # one-time costs (first calls, caches) would otherwise weigh on a small store's few batches
        for n_batch, i in enumerate([0, *range(0, len(wins), batch)]):
            part = wins[i : i + batch]
            T = max(w.size for w in part)
            ids = torch.zeros((len(part), T), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for b, w in enumerate(part):
                ids[b, : w.size] = torch.from_numpy(w)
                mask[b, : w.size] = 1
            tb, tp = torch.nonzero(mask, as_tuple=True)
            rank = torch.where(mask.bool(), torch.cumsum(mask, 1) - 1, -1)
            index = BatchIndex(
                tb, tp, empty, empty, tb, tp, sources=k, src_rank=rank, source_layers=tuple(range(L))
            )
            t0 = time.perf_counter()
            out = cap.run(ids, mask, index, (torch.cumsum(mask, 1) - 1).clamp(min=0))
            to_host(out, ("z", "attn", "v", "resid", "mlp"))
            t_cap += (time.perf_counter() - t0) * (n_batch > 0)
            cap.remove()
            t0 = time.perf_counter()
            with torch.inference_mode():
                model(input_ids=ids, attention_mask=mask, use_cache=False)
            t_plain += (time.perf_counter() - t0) * (n_batch > 0)
            cap.install()
    return t_cap, t_plain


def top_arm(s: Any, every: np.ndarray, u: np.ndarray) -> None:
    """A direction's top-k over every row, as ``actstore dfa`` streams it."""
    dfa_top(s, every, u, k=20, batch_rows=4096)


def read_arm(s: Any, every: np.ndarray, step: int, layers: list[int], k: int) -> None:
    """The rows' ``attn``, ``z``, ``v`` and ``mlp`` read once, in the blocks ``dfa_top`` reads."""
    for i in range(0, every.size, step):
        b = every[i : i + step]
        read_rows(s, "attn", b, layers, per=2 * k)
        read_rows(s, "z", b, layers)
        read_rows(s, "v", b, layers)
        read_rows(s, "mlp", b, layers)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="10000,100000")
    ap.add_argument("--k", type=int, default=16)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--segment-size", type=int, default=4096)
    ap.add_argument("--model", default="tiny-llama", help="tiny-ARCH or any name actstore ingest loads")
    ap.add_argument(
        "--no-plain-ingest", action="store_true", help="skip the ingest without sources (its ratio)"
    )
    ap.add_argument("--top-rounds", type=int, default=2, help="rounds of the top-k / read pair (cold, warm)")
    ap.add_argument(
        "--no-capture-timing",
        action="store_true",
        help="skip the capture / forward timing (the store is built)",
    )
    ap.add_argument("--keep", action="store_true", help="keep the stores (default: removed after each size)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="/tmp/bench-sources")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    name = a.model if a.model.startswith("tiny-") or "/" in a.model or "-" in a.model else f"tiny-{a.model}"
    model = load_model(name).model
    results = []
    for n in [int(x) for x in a.tokens.split(",")]:
        text = out / f"docs-{n}.txt"
        corpus(text, n)
        common = dict(
            model=name,
            dataset=f"text:{text}",
            positions="all",
            batch_size=a.batch_size,
            segment_size=a.segment_size,
            context_length=a.context,
            threads=a.threads,
        )
        times = {}
        stores = {}
        runs: list[tuple[str, dict[str, str]]] = [("plain_ingest", {})] if not a.no_plain_ingest else []
        for label, extra in runs + [("sources", {"sources": str(a.k)})]:
            path = out / f"s-{n}-{label}"
            shutil.rmtree(path, ignore_errors=True)
            t0 = time.perf_counter()
            stores[label] = actstore.ingest_corpus(path, **(common | extra))
            times[label] = time.perf_counter() - t0
        s = stores["sources"]
        if not a.no_capture_timing:
            times["capture"], times["forward"] = capture_forward(model, s, a.k, a.batch_size)
        rows = s.manifest.n_examples
        g = s.geometry
        L = len(s.manifest.ingest["kept"]["z"])
        raw_src = rows * L * (g.n_heads * 2 * a.k + g.n_kv_heads * g.d_head) * 2
        raw_resid = rows * L * g.d_model * 2
        disk = {x: tree_bytes(Path(s.url), x) for x in ("attn", "v", "resid")}
        smol = (9 * 2 * a.k + 3 * 64) / 576  # SmolLM2-135M: H=9, H_kv=3, d_head=64, d_model=576
        u = np.random.default_rng(0).standard_normal(g.d_model).astype(np.float32)
        rng = np.random.default_rng(1)
        dfa_rows(s, [0], u)  # warm (weights cached)
        dfa_top(s, np.arange(min(rows, 64)), u, k=20)  # warm (the result table's first conversion)
        one: list[float] = []
        again: list[float] = []  # first read of a row (its segment's arrays opened then), and a second one
        for r in rng.integers(0, rows, 30):
            for acc in (one, again):
                t0 = time.perf_counter()
                dfa_rows(s, [int(r)], u)
                acc.append(time.perf_counter() - t0)
        every = np.arange(rows)
        layers = s.manifest.ingest["kept"]["z"]
        step = block_rows(s, 4096)  # the blocks dfa_top reads

        # each arm cold (the store's files evicted from the page cache first) and then warm (again at
        # once), the arms' order alternating between rounds: a store larger than the page cache
        # leaves whichever arm runs second partly warm, and would favour it
        files = [f for f in Path(s.url).rglob("*") if f.is_file()]
        arms = {
            "top": partial(top_arm, s, every, u),
            "read": partial(read_arm, s, every, step, layers, a.k),
        }
        timed: dict[str, list[float]] = {f"{arm}_{state}": [] for arm in arms for state in ("cold", "warm")}
        for rnd in range(a.top_rounds):
            for arm in list(arms)[:: 1 if rnd % 2 == 0 else -1]:
                evict(files)
                for state in ("cold", "warm"):
                    t0 = time.perf_counter()
                    arms[arm]()
                    timed[f"{arm}_{state}"].append(time.perf_counter() - t0)
        med = {key: float(np.median(v)) for key, v in timed.items()}
        t_top, t_read = med["top_cold"], med["read_cold"]
        read_floats = (
            rows
            * len(layers)
            * (2 * a.k * g.n_heads + g.n_heads * g.d_head + g.n_kv_heads * g.d_head + g.d_mlp)
        )
        res = {
            "tokens": rows,
            "k": a.k,
            "ingest_sources_s": times["sources"],
            "ingest_plain_s": times.get("plain_ingest"),
            "forward_s": times.get("forward"),
            "capture_s": times.get("capture"),
            "capture_vs_forward": times["capture"] / times["forward"] if "forward" in times else None,
            "ingest_vs_forward": times["sources"] / times["forward"] if "forward" in times else None,
            "capture_vs_ingest_without": times["sources"] / times["plain_ingest"]
            if "plain_ingest" in times
            else None,
            "model": name,
            "bytes_per_token_sources_raw": raw_src / rows,
            "bytes_per_token_resid_raw": raw_resid / rows,
            "sources_vs_resid_raw": raw_src / raw_resid,
            "sources_vs_resid_disk": (disk["attn"] + disk["v"]) / max(1, disk["resid"]),
            "smollm2_sources_vs_resid_raw": smol,
            "dfa_one_position_ms_median": 1e3 * float(np.median(one)),
            "dfa_one_position_again_ms_median": 1e3 * float(np.median(again)),
            "dfa_top_s": t_top,
            "read_once_s": t_read,
            "dfa_top_vs_read_once": t_top / t_read,
            "dfa_top_warm_s": med["top_warm"],
            "read_once_warm_s": med["read_warm"],
            "dfa_top_vs_read_once_warm": med["top_warm"] / med["read_warm"],
            "top_read_seconds": timed,
            "read_rows_per_s": rows / t_read,
            "read_mb_per_s_float32": 4 * read_floats / t_read / 1e6,
        }
        print(json.dumps(res), flush=True)
        results.append(res)
        if not a.keep:
            for st in stores.values():
                shutil.rmtree(st.url, ignore_errors=True)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
