"""The MAPS prompt files of one model under the authors' pair policy.

Like ``python benchmarks/maps_prompts.py dynamic`` (the paper's four neutral contexts, a seeded sample of
``--per-relation`` pairs per relation) or ``... ablation`` (``--kind ablation``: the paper's few-shot
prompt per relation, pairs whose source is one of its examples left out), but the pairs are first
filtered as the authors' code does
(``preprocess_dataset`` in github.com/amitelhelo/MAPS ``src/maps.py``): only pairs whose source and
target are each one token of MODEL's tokenizer (with a leading space), and only relations with at least
``--min-pairs`` such pairs (their ``min_filtered_dataset_size`` = 30).  Prints the usable count of every
relation, excluded ones included.

    python benchmarks/maps_single_token_prompts.py smollm2-135m --out /tmp/maps-work/dynamic-smol.jsonl
    python benchmarks/maps_single_token_prompts.py smollm2-135m --kind ablation --per-relation 60 --out ABL.jsonl
    actstore ingest --model smollm2-135m --dataset jsonl:/tmp/maps-work/dynamic-smol.jsonl --out STORE
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from actstore.ingest.models.registry import load_model
from actstore.query.maps.defaults import MIN_PAIRS
from actstore.query.maps.pairs import load_pair_files, single_token_pairs
from benchmarks.maps_prompts import (
    MAPS_ROOT,
    ablation_templates,
    dynamic_templates,
    prompt_rows,
    write_rows,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "model", help="model alias or folder whose tokenizer decides which pairs are single-token"
    )
    ap.add_argument("--pairs", default=str(MAPS_ROOT / "datasets"), help="the authors' datasets/ folder")
    ap.add_argument("--kind", choices=["dynamic", "ablation"], default="dynamic")
    ap.add_argument("--per-relation", type=int, default=40, help="pairs sampled per relation (all if fewer)")
    ap.add_argument("--min-pairs", type=int, default=MIN_PAIRS)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    tok = load_model(a.model).tokenizer
    every = dynamic_templates(Path(a.pairs)) if a.kind == "dynamic" else ablation_templates()
    rels = load_pair_files([a.pairs], sorted(every))
    with tempfile.TemporaryDirectory() as tmp:
        kept = []
        for rel in rels:
            pairs = [(s.strip(), t.strip()) for s, t in rel.pairs if s.strip() and t.strip()]
            ok = single_token_pairs(pairs, tok)
            good = [list(p) for p, keep in zip(pairs, ok.tolist()) if keep]
            status = "kept" if len(good) >= a.min_pairs else "excluded"
            print(f"{rel.relation:<40} {len(good):>4} of {len(rel.pairs):>4} pairs single-token  {status}")
            if status == "kept":
                d = Path(tmp) / rel.relation
                d.mkdir()
                (d / f"{rel.relation}.json").write_text(
                    json.dumps(good, ensure_ascii=False), encoding="utf-8"
                )
                kept.append(rel.relation)
        templates = {r: t for r, t in every.items() if r in kept}
        rows = prompt_rows(
            templates, a.per_relation, seed=a.seed, pairs_dir=Path(tmp), exclude_examples=a.kind == "ablation"
        )
    write_rows(rows, a.out, len(kept))


if __name__ == "__main__":
    main()
