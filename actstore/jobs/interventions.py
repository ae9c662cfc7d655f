"""Runs that load the store's model and intervene on it: causal tracing, activation patching and
MAPS head ablation, each from one settings object to its result tables and ``runs`` row.

    out = run_trace(store, TraceRequest(model=None, limit=3))     # model None: the store's own
    out.results, out.run_id, out.tables

The model is the one named, else the store's own when that is one of actstore's aliases (a name
read from a store is never loaded from a folder or the hub on its own); its weights must match the
store's unless ``allow_other_model``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from actstore.core.invalid import InvalidSetting
from actstore.core.progress import progress_bar
from actstore.core.runs import new_run_id, with_run_id, write_run
from actstore.core.store import Store

Log = Callable[[str], None]
MODEL_DTYPES = ("float32", "float16", "bfloat16")


# ----------------------------------------------------------------------------------- the model


def model_for_store(store: Store, model: str | None) -> str:
    """``model`` when given, else the store's own model when it is one of actstore's aliases."""
    from actstore.ingest.models import known_alias

    if model:
        return model
    stored = str(store.manifest.model.get("name") or "").strip()
    if not stored:
        raise InvalidSetting("model", f"{store.url} names no model; name the model to load")
    alias = known_alias(stored)
    if alias is None:
        raise InvalidSetting(
            "model",
            f"the store's model {stored!r} is not one of actstore's aliases, and a name "
            "read from a store is never loaded from disk or the hub on its own; name the "
            "model to load",
        )
    return alias


def load_store_model(
    store: Store,
    model: str | None,
    *,
    device: str = "cpu",
    model_dtype: str = "float32",
    allow_other_model: bool = False,
    quiet: bool = False,
) -> Any:
    """The store's model (see :func:`model_for_store`), loaded; refused when its weights differ from
    the store's unless ``allow_other_model``."""
    import torch

    from actstore.ingest.models import load_model

    if model_dtype not in MODEL_DTYPES:
        raise InvalidSetting("model_dtype", f"{model_dtype!r} is not one of {', '.join(MODEL_DTYPES)}")
    name = model_for_store(store, model)
    if quiet:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    loaded = load_model(name, device=device, dtype=getattr(torch, model_dtype))
    want = str(store.manifest.model.get("weight_hash") or "")
    if want and want != loaded.weight_hash and not allow_other_model:
        raise InvalidSetting(
            "model",
            f"{name!r} has other weights than the store's "
            f"({store.manifest.model.get('name')}); use the store's model, or allow "
            "another model explicitly",
        )
    return loaded


def first_mlp_for_store(store: Store, model: str | None) -> Any:
    """The first-MLP source transform of the store's model (loaded on the CPU, float32), for MAPS
    static scores through the first MLP."""
    from actstore.ingest.first_mlp import first_mlp_transform

    loaded = load_store_model(store, model)
    return first_mlp_transform(loaded.model)


def _save(
    store: Store, run_id: str, kind: str, started: float, config: dict[str, Any], tables: dict[str, Any]
) -> list[str]:
    """Write the run's result ``tables`` (name -> Arrow table, each tagged with ``run_id``) and then its
    ``runs`` row; return the tables' paths in the store."""
    from actstore.core.writer import write_result_table

    paths = [write_result_table(store, name, run_id, with_run_id(t, run_id)) for name, t in tables.items()]
    write_run(store, run_id, kind, started, config)
    return paths


def _bar(total: int, desc: str, quiet: bool) -> Any:
    return progress_bar(total=total, unit="fact", desc=desc, enabled=not quiet)


# ----------------------------------------------------------------------------------- tracing


@dataclass(frozen=True)
class TraceRequest:
    model: str | None = None  # None: the store's own (an actstore alias)
    where: str | None = None  # SQL predicate over the examples table choosing the facts
    limit: int | None = None
    all_facts: bool = False  # also facts the model gets wrong
    noise_std: float | None = None  # absolute noise std (overrides trace.noise_scale)
    trace: Any = None  # actstore.ingest.interventions.tracing.TraceConfig (None: its defaults)
    device: str = "cpu"
    model_dtype: str = "float32"
    allow_other_model: bool = False
    save: bool = True
    figures: str | None = None  # folder for ROME-style heatmaps
    max_figures: int = 8
    quiet: bool = False


@dataclass
class TraceOutcome:
    run_id: str
    results: list[Any]
    noise_std: float
    config: dict[str, Any]
    seconds: float
    tables: list[str] = field(default_factory=list)
    figures: list[str] = field(default_factory=list)


def run_trace(store: Store, req: TraceRequest) -> TraceOutcome:
    """Causal tracing of the store's facts: noise on the subject, clean states restored per layer
    and position.  Settings are checked before the model loads."""
    from actstore.ingest.interventions import InterventionRunner
    from actstore.ingest.interventions.tracing import (
        CausalTracer,
        TraceConfig,
        TraceError,
        effects_table,
        facts_table,
        stored_facts,
        subject_embedding_std,
    )

    started = time.time()
    cfg = req.trace if req.trace is not None else TraceConfig()
    cfg.validate(store.geometry.n_layers)
    if req.limit is not None and req.limit < 1:
        raise InvalidSetting("limit", f"must be positive, not {req.limit}")
    facts = stored_facts(store, req.where, correct_only=not req.all_facts, limit=req.limit)
    if not facts:
        raise TraceError(
            f"{store.url}: no facts to trace"
            + (f" where {req.where}" if req.where else "")
            + (
                ""
                if req.all_facts
                else " that the model answers correctly (wrong answers are left out unless all facts are asked for)"
            )
        )
    model = model_for_store(store, req.model)
    loaded = load_store_model(
        store,
        model,
        device=req.device,
        model_dtype=req.model_dtype,
        allow_other_model=req.allow_other_model,
        quiet=req.quiet,
    )
    runner = InterventionRunner(loaded.model)
    std = (
        req.noise_std
        if req.noise_std is not None
        else cfg.noise_scale * subject_embedding_std(loaded.model, store, runner.arch)
    )
    tracer = CausalTracer(runner, cfg, std)
    t0 = time.time()
    with _bar(len(facts), "trace", req.quiet) as bar:
        results = tracer.trace(facts, progress=bar.update)
    out = TraceOutcome(new_run_id("trace"), results, std, dict(cfg.__dict__), time.time() - t0)
    if req.save:
        out.tables += _save(
            store,
            out.run_id,
            "trace",
            started,
            {
                **cfg.__dict__,
                "noise_std": std,
                "model": model,
                "where": req.where,
                "limit": req.limit,
                "all_facts": req.all_facts,
            },
            {"trace_effects": effects_table(results), "trace_facts": facts_table(results, cfg)},
        )
    if req.figures:
        from actstore.query.plotting import trace_average_heatmap, trace_heatmap

        folder = Path(req.figures)
        folder.mkdir(parents=True, exist_ok=True)
        out.figures.append(str(trace_average_heatmap(results, folder / "trace_average.png")))
        for r in results[: req.max_figures]:
            out.figures.append(str(trace_heatmap(r, folder / f"trace_{r.fact.example_id}.png")))
    return out


# ----------------------------------------------------------------------------------- patching


@dataclass(frozen=True)
class PatchRequest:
    model: str | None = None
    where: str | None = None  # SQL predicate over the examples table choosing the clean facts
    limit: int | None = None
    all_facts: bool = False
    pairs: tuple[tuple[int, int], ...] = ()  # (clean, counterfactual) example ids instead of choosing them
    patch: Any = None  # actstore.ingest.interventions.patching.PatchConfig (None: its defaults)
    device: str = "cpu"
    model_dtype: str = "float32"
    allow_other_model: bool = False
    save: bool = True
    quiet: bool = False


@dataclass
class PatchOutcome:
    run_id: str
    results: list[Any]
    skipped: list[dict[str, Any]]
    config: dict[str, Any]
    seconds: float
    tables: list[str] = field(default_factory=list)


def parse_pair(text: str) -> tuple[int, int]:
    """``"12:40"`` (or ``"12,40"``) -> (12, 40)."""
    parts = text.replace(",", ":").split(":")
    try:
        if len(parts) != 2:
            raise ValueError
        return int(parts[0]), int(parts[1])
    except ValueError:
        raise InvalidSetting("pairs", f"{text!r} is not CLEAN_ID:COUNTERFACTUAL_ID") from None


def run_patch(store: Store, req: PatchRequest) -> PatchOutcome:
    """Activation patching: clean activations into a counterfactual prompt of the same relation."""
    from actstore.ingest.interventions import InterventionRunner
    from actstore.ingest.interventions.patching import (
        ActivationPatcher,
        PatchConfig,
        PatchError,
        PatchPair,
        choose_counterfactuals,
        effects_table,
        pairs_table,
    )
    from actstore.ingest.interventions.tracing import stored_facts

    started = time.time()
    cfg = req.patch if req.patch is not None else PatchConfig()
    cfg.validate()
    skipped: list[dict[str, Any]] = []
    if req.pairs:
        ids = sorted({i for p in req.pairs for i in p})
        got = {f.example_id: f for f in stored_facts(store, correct_only=False, example_ids=ids, check=False)}
        missing = [i for i in ids if i not in got]
        if missing:
            raise PatchError(f"{store.url}: no fact {missing[0]} with an object token")
        pairs = [PatchPair(got[c], got[x]) for c, x in req.pairs]
    else:
        if req.limit is not None and req.limit < 1:
            raise InvalidSetting("limit", f"must be positive, not {req.limit}")
        facts = stored_facts(store, req.where, correct_only=not req.all_facts, limit=req.limit)
        # counterfactuals are facts the model answers, or any fact with --all-facts
        candidates = [
            f
            for f in stored_facts(store, correct_only=not req.all_facts, check=False)
            if f.subject_span[0] >= 0
        ]
        pairs, skipped = choose_counterfactuals(facts, candidates)
    for p in pairs:
        p.check()  # a counterfactual of another relation, a subject not in its prompt: one line, before the model
    if not pairs:
        raise PatchError(
            f"{store.url}: no fact with a counterfactual to patch"
            + (f" ({skipped[0]['reason']})" if skipped else "")
        )
    model = model_for_store(store, req.model)
    loaded = load_store_model(
        store,
        model,
        device=req.device,
        model_dtype=req.model_dtype,
        allow_other_model=req.allow_other_model,
        quiet=req.quiet,
    )
    patcher = ActivationPatcher(InterventionRunner(loaded.model), cfg)
    t0 = time.time()
    with _bar(len(pairs), "patch", req.quiet) as bar:
        results = patcher.patch(pairs, progress=bar.update)
    out = PatchOutcome(new_run_id("patch"), results, skipped, dict(cfg.__dict__), time.time() - t0)
    if req.save:
        out.tables += _save(
            store,
            out.run_id,
            "patch",
            started,
            {
                **cfg.__dict__,
                "model": model,
                "where": req.where,
                "limit": req.limit,
                "pairs": [f"{c}:{x}" for c, x in req.pairs],
                "skipped": skipped,
            },
            {"patch_effects": effects_table(results), "patch_pairs": pairs_table(results)},
        )
    return out


# ----------------------------------------------------------------------------------- MAPS ablation


@dataclass(frozen=True)
class AblateRequest:
    """One ablation run: ``ablation`` (actstore.ingest.interventions.ablation.AblationConfig) says what is removed and
    measured; the rest where the model, the pairs and the stored scores come from."""

    ablation: Any
    model: str | None = None
    pairs: tuple[str, ...] = ()  # MAPS pair files or folders for the static scores
    scores_store: str | None = None  # read stored static scores from this store of the same model
    device: str = "cpu"
    model_dtype: str = "float32"
    allow_other_model: bool = False
    save: bool = True


@dataclass
class AblateOutcome:
    run_id: str
    summary: dict[str, Any]
    rows: list[dict[str, Any]]
    tables: list[str] = field(default_factory=list)


def check_ablation(cfg: Any) -> None:
    """Settings of an AblationConfig that are wrong before anything runs."""
    if cfg.k is not None and cfg.k < 1:
        raise InvalidSetting("k", f"must be at least 1, not {cfg.k}")
    if cfg.min_pairs < 0:
        raise InvalidSetting("min_pairs", f"must not be negative, not {cfg.min_pairs}")
    if not 0 <= cfg.threshold <= 1:
        raise InvalidSetting("threshold", f"must be in [0, 1], not {cfg.threshold}")
    if cfg.top_m is not None and cfg.top_m < 1:
        raise InvalidSetting("top_m", f"must be at least 1, not {cfg.top_m}")
    if cfg.batch_size < 1:
        raise InvalidSetting("batch_size", f"must be at least 1, not {cfg.batch_size}")
    if cfg.max_controls < 0:
        raise InvalidSetting("max_controls", f"must not be negative, not {cfg.max_controls}")
    if not 0 <= cfg.max_head_overlap <= 1:
        raise InvalidSetting("max_head_overlap", f"must be in [0, 1], not {cfg.max_head_overlap}")
    if cfg.max_accuracy_gap < 0:
        raise InvalidSetting("max_accuracy_gap", f"must not be negative, not {cfg.max_accuracy_gap}")


def run_ablate(store: Store, req: AblateRequest, log: Log | None = None) -> AblateOutcome:
    """Accuracy on the relation's prompts with no ablation, with its MAPS heads removed, with as many
    random heads removed, and on control relations; the ``maps_ablation`` table and a ``runs`` row."""
    from actstore.core.store import open_store
    from actstore.ingest.interventions import InterventionRunner
    from actstore.ingest.interventions.ablation import relation_prompts, run_ablation
    from actstore.query.maps.pairs import load_pair_files, tokenize_pairs

    say = log or (lambda m: None)
    cfg = req.ablation
    check_ablation(cfg)
    started = time.time()
    g = store.geometry
    have = relation_prompts(store, cfg.where)  # checks the relation before the (slow) model load
    for r in (cfg.relation, *(cfg.controls or ())):
        if r not in have:
            raise InvalidSetting(
                "relation",
                f"{r!r} has no prompts with an object in {store.url} (it holds: {', '.join(have) or 'none'})",
            )
    other = None
    if req.scores_store is not None:
        other = open_store(req.scores_store)
        mine, theirs = (str(x.manifest.model.get("weight_hash") or "") for x in (store, other))
        if not mine or mine != theirs or other.geometry != g:
            raise InvalidSetting(
                "scores_store", f"{other.url} holds another model's weights than {store.url}"
            )
    rels = []
    if req.pairs:
        rels = load_pair_files(list(req.pairs), [cfg.relation])  # the relation must have a pair file
        if cfg.controls is None:  # the candidate controls' pair files, where there are some
            rels += [
                rp
                for rp in load_pair_files(list(req.pairs))
                if rp.relation in have and rp.relation != cfg.relation
            ]
    model = model_for_store(store, req.model)
    loaded = load_store_model(
        store, model, device=req.device, model_dtype=req.model_dtype, allow_other_model=req.allow_other_model
    )
    # single-token pairs (the authors' filter); a relation below min_pairs is excluded by run_ablation
    pairs = {
        rp.relation: tokenize_pairs(
            rp, loaded.tokenizer, vocab_size=g.vocab_size, allow_empty=True, multi_token=cfg.multi_token
        )
        for rp in rels
    }
    res = run_ablation(InterventionRunner(loaded.model), store, cfg, pairs=pairs, scores_store=other, log=say)
    out = AblateOutcome(new_run_id("ablate"), res.summary, res.rows)
    if req.save:
        config: dict[str, Any] = asdict(cfg)
        config.update(first_mlp=res.summary["first_mlp"], k_per_relation={cfg.relation: res.summary["k"]})
        out.tables += _save(
            store,
            out.run_id,
            "ablate",
            started,
            {
                **config,
                "model": model,
                "pairs": list(req.pairs),
                "scores_store": req.scores_store,
                "static_scores": res.summary["static_scores"],
                "control_choice": res.summary["control_choice"],
            },
            {"maps_ablation": res.table()},
        )
    return out


def parse_heads_text(text: str | None, store: Store) -> tuple[tuple[int, int], ...] | None:
    """``"12.3,7.*"`` -> the (layer, head) pairs of the store's model; None for None."""
    if not text:
        return None
    from actstore.query.maps.projection import parse_heads

    g = store.geometry
    heads = parse_heads(text, g.n_layers, g.n_heads)
    return tuple(heads) if heads else None


__all__: Sequence[str] = [
    "AblateRequest",
    "PatchRequest",
    "TraceRequest",
    "first_mlp_for_store",
    "load_store_model",
    "model_for_store",
    "parse_pair",
    "run_ablate",
    "run_patch",
    "run_trace",
]
