"""A small store for the explorer's tests (tests/cli/test_serve*.py) and its benchmark: three
relations of six invented prompts, the first holding ``<script>``, ingested with tiny Llama; one
episodic probe run over ``attn_head`` with TokenScores for every prediction; and MAPS, tracing,
patching and method-comparison tables in the schema their writers use (invented values)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

HOSTILE_TEXT = "<script>document.title='pwned'</script> Paris is located in"
CITIES = {
    "P1": ["Paris", "Lyon", "Nice", "Lille", "Brest", "Tours"],
    "P2": ["Rome", "Milan", "Turin", "Genoa", "Pisa", "Bari"],
    "P3": ["Berlin", "Bonn", "Kiel", "Ulm", "Jena", "Trier"],
}
COUNTRY = {"P1": "France", "P2": "Italy", "P3": "Germany"}


def write_prompts(path: Path) -> Path:
    lines: list[dict[str, Any]] = []
    for rel, subjects in CITIES.items():
        for s in subjects:
            lines.append(
                {
                    "text": f"{s} is located in",
                    "subject": s,
                    "object": COUNTRY[rel],
                    "relation_id": rel,
                    "relation_name": f"city in {COUNTRY[rel]}",
                }
            )
    lines[0]["text"] = HOSTILE_TEXT
    path.write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
    return path


def build_serve_store(out: Path) -> Path:
    """Ingest, probe and add the result tables; returns the store's path."""
    import torch
    from helpers import build_store

    import actstore
    from actstore.jobs.probe import record_probe
    from actstore.query.analyses.probe import ProbeConfig, run_probe

    out.mkdir(parents=True, exist_ok=True)
    data = write_prompts(out / "prompts.jsonl")
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        path = build_store(out / "store", "llama", dataset=f"jsonl:{data}", limit=None, segment_size=64)
        store = actstore.open(path)
        cfg = ProbeConfig(
            kind="attn_head",
            n_way=3,
            k_shot=2,
            queries=2,
            episodes=6,
            seeds=(0,),
            epochs=20,
            top_k=200,
            token_scores="all",
        )
        record_probe(store, run_probe(store, cfg))
    finally:
        torch.set_num_threads(old)
    synthetic_tables(store)
    return path


def synthetic_tables(store: Any) -> None:
    from helpers import agreement_row

    from actstore.core.writer import write_result_table

    g = store.geometry
    L, H = g.n_layers, g.n_heads
    rng = np.random.default_rng(0)
    rels = list(CITIES)
    maps = [
        {
            "run_id": "maps-test",
            "relation": r,
            "layer": layer,
            "head": h,
            "k": 10,
            "score": float(rng.random()),
            "suppression": float(rng.random()),
        }
        for r in rels
        for layer in range(L)
        for h in range(H)
    ]
    write_result_table(store, "maps_scores", "maps-test", pa.Table.from_pylist(maps))
    salient = [
        {
            "run_id": "maps-test",
            "layer": layer,
            "head": h,
            "token": f"<tok{i}>",
            "sigma": float(rng.random()),
            "mapped_tokens": "a, b",
        }
        for layer in range(L)
        for h in range(H)
        for i in range(3)
    ]
    write_result_table(store, "maps_salient", "maps-test", pa.Table.from_pylist(salient))
    facts = store.sql("SELECT example_id, n_tokens FROM examples ORDER BY 1 LIMIT 3 OFFSET 1").to_pylist()
    trace = [
        {
            "run_id": "trace-test",
            "example_id": f["example_id"],
            "component": c,
            "layer": layer,
            "position": p,
            "token": "t",
            "role": "subject_first" if p == 0 else "after_subject",
            "prob": float(rng.random()),
            "indirect_effect": float(rng.random()),
        }
        for f in facts
        for c in ("resid", "mlp", "attn")
        for layer in range(L)
        for p in range(f["n_tokens"])
    ]
    write_result_table(store, "trace_effects", "trace-test", pa.Table.from_pylist(trace))
    patch = [
        {
            "run_id": "patch-test",
            "example_id": facts[0]["example_id"],
            "counterfactual_id": facts[1]["example_id"],
            "component": c,
            "layer": layer,
            "head": h,
            "position": "last",
            "recovery": float(rng.random()),
        }
        for c, heads in (("resid", [-1]), ("head", list(range(H))))
        for layer in range(L)
        for h in heads
    ]
    write_result_table(store, "patch_effects", "patch-test", pa.Table.from_pylist(patch))
    write_result_table(
        store,
        "method_agreement",
        "agree-test",
        pa.Table.from_pylist(
            [agreement_row(key_layer_chance=0.4, key_layer_excess=0.27, key_layer_kappa=0.45)]
        ),
    )
    readings = [
        {
            "run_id": "agree-test",
            "example_id": f["example_id"],
            "method": m,
            "key_layer": int(rng.integers(0, L)),
            "verdict": "localised",
            "profile": [float(x) for x in rng.random(L)],
        }
        for f in facts
        for m in ("trace", "patch")
    ]
    write_result_table(store, "method_readings", "agree-test", pa.Table.from_pylist(readings))


def tree_hash(root: Path) -> str:
    """SHA-256 over every file's relative path, size, modification time and bytes under ``root``."""
    h = hashlib.sha256()
    for dirpath, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(files):
            p = Path(dirpath) / name
            st = p.stat()
            h.update(f"{p.relative_to(root)}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
            h.update(p.read_bytes())
    return h.hexdigest()


CORPUS_WORDS = "the river runs past an old stone bridge in a quiet town at night".split()


def build_corpus_serve_store(
    out: Path, docs: int = 12, words: int = 12, topk: bool = True, sources: str | None = "4"
) -> Path:
    """A tiny Llama corpus store (``--positions all``, every kind, float32, ``--sources 4`` unless
    ``sources`` says otherwise (None: none)) of ``docs`` random sentences of ``words`` words (one with
    a tab and a double space, so that whitespace tokens exist), with a precomputed ``topk`` run of MLP
    layer 1 (k 20) unless ``topk`` is False; and ``probe.npy``, three residual directions, beside it.
    Returns the store's path."""
    import torch

    import actstore
    from actstore.jobs.settings import TopkConfig
    from actstore.jobs.topk import run_topk

    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    lines = [" ".join(rng.choice(CORPUS_WORDS, words)) for _ in range(docs)]
    lines[1] = lines[1].replace(" ", "  ", 1).replace(" ", "\t", 1)
    (out / "corpus.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        store = actstore.ingest_corpus(
            out / "corpus",
            model="tiny-llama",
            dataset=f"text:{out / 'corpus.txt'}",
            positions="all",
            storage_dtype="float32",
            batch_size=4,
            segment_size=64,
            **({"sources": sources} if sources else {}),
        )
    finally:
        torch.set_num_threads(old)
    if topk:
        run_topk(store, TopkConfig(kind="mlp", layer=1, k=20))
    d = np.random.default_rng(1).standard_normal((3, store.geometry.d_model)).astype(np.float32)
    np.save(out / "probe.npy", d)
    return out / "corpus"
