"""The user's path against its floor, side by side in one run (issue 33, "the public path at its floor").

On one store (SmolLM2 over FewRel in the issue: 480 rows of 16 relations), with one torch thread,
interleaved rounds (the cases shuffled in each round), medians:

* ``public``: ``s.select().features("attn_head")`` on an open store, the selection made afresh each
  call (its SQL included), as a user writes it;
* ``selection_kept``: ``sel.features("attn_head")`` on a selection whose rows were read before (what
  ``bench_query.py`` times);
* ``floor``: reading ``z`` segment by segment with the store's own reader (float32) plus the
  ``z W_O`` einsum per segment (results kept as a list: no concatenation);
* ``floor_read`` and ``floor_math``: the two parts of the floor alone;
* ``floor_bmm``: the read plus one ``bmm`` over (layer, head) with the result in BLAS's own
  [layer*head, row, d_model] layout (the least arithmetic, in a layout no user gets).

And the selective read (one relation, three layers of ``attn_head``): ``fresh`` (``actstore.open``
then the read, imports done, a new reader each call) against ``open`` (the same store object).

    python benchmarks/public_path.py STORE [--rounds 7] [--json OUT]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.common import emit  # noqa: E402


def cases(path: Path) -> tuple[dict[str, Callable[[], Any]], dict[str, Any]]:
    import torch

    import actstore

    s = actstore.open(path)
    kept = s.select()
    kept.rows  # noqa: B018  (read once: the kept selection's rows)
    blocks = [b for _, b in kept.blocks()]
    WO = torch.from_numpy(s.weight("W_O"))  # [L, H, dh, d]
    rel = s.sql("SELECT relation_id FROM examples ORDER BY example_id LIMIT 1").column(0)[0].as_py()
    L = s.geometry.n_layers
    layers = [L // 3, L // 2, L - 1]

    def read() -> list[torch.Tensor]:
        return [torch.from_numpy(s.read_segment_rows(b.segment, "z", b.seg_rows)) for b in blocks]

    zs = read()

    def math(z: list[torch.Tensor]) -> list[torch.Tensor]:
        return [torch.einsum("nlhk,lhkd->nlhd", x, WO) for x in z]

    g = s.geometry
    WOb = WO.reshape(g.n_layers * g.n_heads, g.d_head, g.d_model)

    def bmm(z: list[torch.Tensor]) -> list[torch.Tensor]:  # [L*H, n, d]: the product, in BLAS's layout
        return [torch.bmm(x.reshape(x.shape[0], -1, g.d_head).transpose(0, 1), WOb) for x in z]

    def fresh() -> np.ndarray:
        return (
            actstore.open(path).select("relation_id = ?", params=[rel]).features("attn_head", layers=layers)
        )

    out = {
        "public": lambda: s.select().features("attn_head"),
        "selection_kept": lambda: kept.features("attn_head"),
        "floor": lambda: math(read()),
        "floor_read": read,
        "floor_math": lambda: math(zs),
        "floor_bmm": lambda: bmm(read()),
        "selective_fresh": fresh,
        "selective_open": lambda: s.select("relation_id = ?", params=[rel]).features(
            "attn_head", layers=layers
        ),
    }
    # every path gives the floor's numbers
    want = torch.cat(math(zs)).numpy()
    np.testing.assert_allclose(out["public"](), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out["selection_kept"](), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(fresh(), out["selective_open"]())
    info = {"rows": len(kept), "segments": len(blocks), "output_mb": round(want.nbytes / 1e6, 1)}
    return out, info


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("store", type=Path)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    fns, info = cases(a.store)
    times: dict[str, list[float]] = {k: [] for k in fns}
    rng = random.Random(0)
    for _ in range(a.rounds):
        order = list(fns)
        rng.shuffle(order)
        for name in order:
            fns[name]()  # untimed call first: the same allocator and cache state for every case
            t0 = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - t0)
    med = {k: round(statistics.median(v) * 1000, 1) for k, v in times.items()}
    emit(
        {
            **info,
            "median_ms": med,
            "public_over_floor": round(med["public"] / med["floor"], 2),
            "kept_over_floor": round(med["selection_kept"] / med["floor"], 2),
            "public_over_floor_bmm": round(med["public"] / med["floor_bmm"], 2),
            "fresh_over_open": round(med["selective_fresh"] / med["selective_open"], 2),
        },
        a.json,
    )


if __name__ == "__main__":
    main()
