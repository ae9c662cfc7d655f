"""Prompt files for the MAPS experiments on real models, in the ``jsonl`` dataset format (a data-set
builder for the experiments in docs/analyses.md, not part of the library).

Two sets, both read from the MAPS authors' files in place (``$ACTSTORE_DATA/maps``, default ``../shared/data/maps``):

* ``dynamic``: every relation's pairs (a seeded sample of ``--per-relation`` pairs) in the
  paper's four neutral contexts (``reference_results/.../multiple_prompts/templates.json``:
  "No <X> means no", "The story of <X> contains", "This is a document about <X>", "When I
  think about <X> I think about"), one prompt per (pair, template), the template recorded in
  ``meta.template`` so ``maps-dynamic`` correlates over (head, template) points as the paper does;
* ``ablation``: the paper's few-shot prompt per relation (``experiment2_causal/vanilla/setups.json``,
  12 relations), e.g. " lovely-> lovelier; edgy-> edgier; <X>->"; pairs whose source is one
  of the prompt's own examples are left out.

The subject span is given explicitly (the slot ``<X>``), so a few-shot example that happens to
contain the subject never takes its place.  ``target`` is the last token.

    python benchmarks/maps_prompts.py dynamic --per-relation 40 --out /tmp/maps-work/dynamic.jsonl
    python benchmarks/maps_prompts.py ablation --per-relation 60 --out /tmp/maps-work/ablation.jsonl
    actstore ingest --model smollm2-135m --dataset jsonl:/tmp/maps-work/dynamic.jsonl --out STORE
"""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from actstore.core.errors import MapsError
from actstore.query.maps.pairs import load_pair_files

MAPS_ROOT = (
    Path(os.environ.get("ACTSTORE_DATA") or Path(__file__).resolve().parents[2] / "shared" / "data") / "maps"
)
LLAMA_RESULTS = MAPS_ROOT / "reference_results" / "results" / "meta-llama" / "Meta-Llama-3.1-8B"
NEUTRAL_TEMPLATES = LLAMA_RESULTS / "experiment1_correlative" / "multiple_prompts" / "templates.json"
ABLATION_SETUPS = LLAMA_RESULTS / "experiment2_causal" / "vanilla" / "setups.json"
SLOT = "<X>"


def _fill(template: str, subject: str) -> tuple[str, list[int]]:
    if template.count(SLOT) != 1:
        raise MapsError(f"template {template!r} must hold {SLOT} exactly once")
    start = template.index(SLOT)
    return template.replace(SLOT, subject), [start, start + len(subject)]


def _few_shot_sources(template: str) -> set[str]:
    """The example sources of a few-shot prompt (" lovely-> lovelier; edgy-> edgier; <X>->")."""
    return {m.strip() for m in re.findall(r"(?:^|;)\s*([^;>]+?)\s*->", template) if SLOT not in m}


def prompt_rows(
    templates: dict[str, list[str]],
    per_relation: int | None,
    *,
    seed: int = 0,
    pairs_dir: Path = MAPS_ROOT / "datasets",
    exclude_examples: bool = False,
) -> list[dict[str, Any]]:
    """One row per (sampled pair, template) for each relation in ``templates`` (pair-major)."""
    rels = load_pair_files([pairs_dir], sorted(templates))
    rows: list[dict[str, Any]] = []
    for rel in rels:
        pairs = [(s.strip(), t.strip()) for s, t in rel.pairs if s.strip() and t.strip()]
        if exclude_examples:
            taken = set().union(*(_few_shot_sources(t) for t in templates[rel.relation]))
            pairs = [p for p in pairs if p[0] not in taken]
        rng = np.random.default_rng(seed)
        if per_relation is not None and per_relation < len(pairs):
            pick = sorted(rng.choice(len(pairs), size=per_relation, replace=False).tolist())
            pairs = [pairs[i] for i in pick]
        for i, (subject, obj) in enumerate(pairs):
            for template in templates[rel.relation]:
                text, span = _fill(template, subject)
                rows.append(
                    {
                        "text": text,
                        "subject": subject,
                        "subject_span": span,
                        "object": obj,
                        "relation_id": rel.relation,
                        "relation_name": rel.relation.replace("_", " "),
                        "source": "maps",
                        "target": "last",
                        "template": template,
                        "pair_index": i,
                    }
                )
    return rows


def dynamic_templates(pairs_dir: Path = MAPS_ROOT / "datasets") -> dict[str, list[str]]:
    neutral = json.loads(NEUTRAL_TEMPLATES.read_text(encoding="utf-8"))
    return {r.relation: list(neutral) for r in load_pair_files([pairs_dir])}


def ablation_templates() -> dict[str, list[str]]:
    return {
        x["relation_name"]: [x["template"]] for x in json.loads(ABLATION_SETUPS.read_text(encoding="utf-8"))
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("kind", choices=["dynamic", "ablation"])
    ap.add_argument("--per-relation", type=int, default=40, help="pairs sampled per relation (all if larger)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--relations", default=None, help="comma-separated relation names to keep")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    templates = dynamic_templates() if args.kind == "dynamic" else ablation_templates()
    if args.relations:
        keep = [r.strip() for r in args.relations.split(",") if r.strip()]
        unknown = sorted(set(keep) - set(templates))
        if unknown:
            raise SystemExit(f"error: unknown relation(s) {', '.join(unknown)}")
        templates = {r: templates[r] for r in keep}
    rows = prompt_rows(templates, args.per_relation, seed=args.seed, exclude_examples=args.kind == "ablation")
    write_rows(rows, args.out, len(templates))


def write_rows(rows: list[dict[str, Any]], path: str | Path, n_relations: int) -> None:
    """Write the prompt rows as JSON lines to ``path`` (folders made as needed) and say so."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    print(f"wrote {len(rows)} prompts for {n_relations} relations to {out}")


if __name__ == "__main__":
    main()
