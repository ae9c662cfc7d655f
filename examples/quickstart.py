"""actstore in five steps: ingest once, then SQL, features, streaming and a report, without the model.

    python examples/quickstart.py                 # tiny random Llama, built-in demo corpus, temp dir
    python examples/quickstart.py --model smollm2-135m --keep /tmp/quickstart

Runs in a few seconds with the tiny model (the tests run it).  Each step prints what it got.
docs/api.md describes the Python API used here.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import actstore


def main(argv: list[str] | None = None) -> dict[str, object]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model", default="tiny-llama", help="tiny-llama (random weights, no download) or smollm2-135m"
    )
    ap.add_argument("--limit-per-relation", type=int, default=4)
    ap.add_argument("--keep", default=None, help="Write the store and report here instead of a temp dir.")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        return run(args.model, args.limit_per_relation, args.keep or tmp)


def run(model: str, limit: int, folder: str) -> dict[str, object]:
    import torch

    path = os.path.join(folder, "store")

    # 1. Ingest: the model runs once; per-head factors land in Zarr arrays, metadata in Parquet.
    s = actstore.ingest_corpus(
        path, model=model, dataset="demo", limit_per_relation=limit, storage_dtype="float32", batch_size=8
    )
    print(s)  # <actstore.Store ...: model=..., L=.. H=.. d_model=.., N rows in S/S segments, dtype=...>

    # 2. SQL over the store's tables (DuckDB, read-only): Arrow by default, pandas on request; values
    #    reach the statement as parameters, never pasted into it.
    per_relation = s.sql(
        "SELECT relation_id, count(*) AS n FROM examples GROUP BY 1 ORDER BY 1", format="pandas"
    )
    print(per_relation.to_string(index=False))
    n_capital = s.sql("SELECT count(*) AS n FROM examples WHERE relation_id = ?", ["country_capital"])
    print("country_capital prompts:", n_capital.column("n")[0].as_py())

    # 3. Features of a selection: per-head contributions Delta_att,h at the target token.  A selection
    #    is a plan (filter, relations, limit, sample, split compose); it is read when features are asked for.
    sel = s.select().relations(["country_capital"])
    print(sel)  # <Selection of N target rows ...: all rows | relations(country_capital)>
    x = sel.features("attn_head", layers=[0, 1])  # numpy [n, 2, H, d_model]
    xt = sel.features("attn_head", layers=[0, 1], output="torch")  # the same as a torch tensor
    print("attn_head", tuple(x.shape), type(xt).__name__)

    # ... and per source token: Delta_att,h(t, j), rebuilt from stored A, V and W_O (exact), labelled:
    # dims (row, layer, head, source, d_model), coordinates example_id, relation_id, layer, head, mask.
    tok = sel.to_xarray("attn_head_token", layers=[1])
    print("attn_head_token", dict(tok.sizes), "example_ids", tok.example_id.values.tolist())
    err = float(abs(tok.where(tok.mask, 0).sum("source").values - x[:, 1:2]).max())
    print(f"sum over source tokens equals attn_head: max |difference| = {err:.2e}")

    # 4. Streaming: batches of rows, whole chunks per read, bounded memory; and a torch dataset for
    #    training on a random split of the relations' rows (stratified: every relation in both parts).
    rows, norm = 0, 0.0
    for ids, batch in s.select().iter_features("z", batch_rows=16):  # batch: [<=16, L, H, d_head]
        rows += len(ids)
        norm = max(norm, float(abs(batch).max()))
    print(f"streamed z for {rows} rows (max |z| = {norm:.3g})")
    train, test = s.select().split((0.75, 0.25), seed=0, stratify=True)
    ds = actstore.FeatureDataset(train, "attn_head", layers=[1], flatten=True, shuffle=True)
    xb, yb = next(iter(torch.utils.data.DataLoader(ds, batch_size=8)))
    print(
        f"train/test rows {len(train)}/{len(test)}; a training batch {tuple(xb.shape)} with labels "
        f"{[ds.classes[i] for i in yb.tolist()][:3]}..."
    )

    # 5. A self-contained HTML report of the store (and of every analysis result it holds).
    from actstore.query.report.builder import write_report

    report = write_report(s, os.path.join(folder, "report.html"))
    print(f"report: {report}")
    return {
        "rows": rows,
        "shape": tuple(x.shape),
        "token_sum_error": err,
        "relations": len(per_relation),
        "report_bytes": os.path.getsize(report),
    }


if __name__ == "__main__":
    main()
