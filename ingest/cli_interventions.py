"""Commands that run the model with interventions (``ablate``; tracing and patching build on
the same runner, :mod:`ingest.interventions`)."""

from __future__ import annotations

import json
import time
from typing import Any

import click

from actstore.cli import friendly, where_option
from query.maps import IMPLEMENTS_THRESHOLD, MIN_PAIRS

MODEL_DTYPES = ("float32", "float16", "bfloat16")


def _pct(x: float | None) -> str:
    return "   n/a" if x is None else f"{x:+6.1f}%"


@click.command()
@click.option("--model", "model_name", required=True, help="The store's model: alias, folder or hub name.")
@click.option("--store", "store_path", required=True, help="Store holding the relation's prompts (and means).")
@click.option("--relation", required=True, help="Relation id whose MAPS heads are removed.")
@click.option("--control", "controls", multiple=True,
              help="Control relation (repeatable); default: chosen as in the paper among the store's relations.")
@click.option("--no-controls", is_flag=True, help="Skip control relations.")
@click.option("--max-controls", type=int, default=3, show_default=True, help="Automatic controls: at most this many.")
@click.option("--max-head-overlap", type=float, default=0.15, show_default=True,
              help="Automatic controls: share of RELATION's heads among a control's own top heads, below this.")
@click.option("--max-accuracy-gap", type=float, default=0.2, show_default=True,
              help="Automatic controls: base accuracy within this of RELATION's.")
@click.option("--pairs", "pair_paths", multiple=True,
              help="MAPS pair files or directories for the static scores of RELATION and of the candidate controls "
              "(default, and for relations without a file: the store's own prompts).")
@click.option("--scores-store", default=None,
              help="Read stored static scores (an `actstore maps` run with the same settings) from this store of "
              "the same model instead of STORE's.")
@click.option("--no-stored-scores", is_flag=True, help="Always compute the static scores from the weights.")
@click.option("--k", type=int, default=None,
              help="Top-k for every relation (default: the authors' k per relation, 1 for copying relations, 10 otherwise).")
@click.option("--min-pairs", type=int, default=MIN_PAIRS, show_default=True,
              help="Relations with fewer usable pairs take no part (the authors' minimum).")
@click.option("--multi-token", type=click.Choice(["skip", "first"]), default="skip", show_default=True,
              help="Pair files: single-token pairs only (the authors' filter), or a word's first token (ours).")
@click.option("--threshold", type=float, default=IMPLEMENTS_THRESHOLD, show_default=True)
@click.option("--top-m", type=int, default=None, help="Remove the m best non-zero heads instead of those >= threshold.")
@click.option("--heads", "heads_text", default=None, help="Remove these heads instead (LAYER.HEAD list).")
@click.option("--random-draws", type=int, default=5, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--mode", type=click.Choice(["zero", "mean"]), default="zero", show_default=True,
              help="zero: z_h = 0; mean: z_h = its mean over the store's rows.")
@click.option("--all-positions", is_flag=True, help="Ablate at every position, not only the last prompt token.")
@where_option("SQL predicate over examples restricting the prompts.")
@click.option("--batch-size", type=int, default=32, show_default=True)
@click.option("--device", default="cpu", show_default=True)
@click.option("--model-dtype", type=click.Choice(MODEL_DTYPES), default="float32", show_default=True)
@click.option("--no-final-norm", is_flag=True, help="Static scores through the raw unembedding.")
@click.option("--first-mlp/--no-first-mlp", "first_mlp", default=None,
              help="Static scores through the first MLP's output (the paper's code; default on, except Llama-3.1-70B).")
@click.option("--allow-other-model", is_flag=True, help="Run even if the model's weights differ from the store's.")
@click.option("--no-write", is_flag=True, help="Do not write the result table into the store.")
@click.option("--quiet", is_flag=True)
@click.option("--json", "as_json", is_flag=True)
@friendly
def ablate(model_name: str, store_path: str, relation: str, controls: tuple[str, ...], no_controls: bool,
           max_controls: int, max_head_overlap: float, max_accuracy_gap: float, pair_paths: tuple[str, ...],
           scores_store: str | None, no_stored_scores: bool, k: int | None, min_pairs: int, multi_token: str, threshold: float, top_m: int | None, heads_text: str | None,
           random_draws: int, seed: int, mode: str, all_positions: bool, where: str | None, batch_size: int,
           device: str, model_dtype: str, no_final_norm: bool, first_mlp: bool | None, allow_other_model: bool,
           no_write: bool, quiet: bool, as_json: bool) -> None:
    """Accuracy on RELATION's prompts with no ablation, with its MAPS heads removed, with as many
    random heads removed, and on control relations."""
    import torch

    import actstore
    from actstore.writer import write_result_table
    from ingest.interventions import InterventionRunner
    from ingest.maps_ablation import AblationConfig, relation_prompts, run_ablation
    from ingest.models import load_model
    from query.cli_maps import new_run_id, with_run_id, write_run
    from query.maps import load_pair_files, parse_heads, tokenize_pairs

    def log(m: str) -> None:
        if not quiet:
            click.echo(m, err=True)

    if (k is not None and k < 1) or min_pairs < 0 or not 0 <= threshold <= 1 or (top_m is not None and top_m < 1) or batch_size < 1:
        raise click.BadParameter("--k, --top-m and --batch-size must be positive and --threshold in [0, 1]")
    if max_controls < 0 or not 0 <= max_head_overlap <= 1 or max_accuracy_gap < 0:
        raise click.BadParameter("--max-controls and --max-accuracy-gap must not be negative, --max-head-overlap in [0, 1]")
    started = time.time()
    s = actstore.open(store_path)
    g = s.geometry
    heads = parse_heads(heads_text, g.n_layers, g.n_heads) if heads_text else None
    have = relation_prompts(s, where)  # checks the relation before the (slow) model load
    for r in (relation, *controls):
        if r not in have:
            raise ValueError(f"relation {r!r} has no prompts with an object in {s.url} (it holds: {', '.join(have) or 'none'})")
    other = None
    if scores_store is not None:
        other = actstore.open(scores_store)
        mine, theirs = (str(x.manifest.model.get("weight_hash") or "") for x in (s, other))
        if not mine or mine != theirs or other.geometry != g:
            raise ValueError(f"--scores-store {other.url} holds another model's weights than {s.url}")
    rels = []
    if pair_paths:
        rels = load_pair_files(list(pair_paths), [relation])  # RELATION must have a pair file
        if not controls and not no_controls:  # the candidate controls' pair files, where there are some
            rels += [rp for rp in load_pair_files(list(pair_paths)) if rp.relation in have and rp.relation != relation]
    loaded = load_model(model_name, device=device, dtype=getattr(torch, model_dtype))
    want = str(s.manifest.model.get("weight_hash") or "")
    if want and want != loaded.weight_hash and not allow_other_model:
        raise ValueError(f"model {model_name!r} has other weights than the store's ({s.manifest.model.get('name')}); "
                         "use the store's model or --allow-other-model")
    # single-token pairs (the authors' filter); a relation below --min-pairs is excluded by run_ablation
    pairs = {rp.relation: tokenize_pairs(rp, loaded.tokenizer, vocab_size=g.vocab_size, allow_empty=True,
                                         multi_token=multi_token) for rp in rels}  # type: ignore[arg-type]
    cfg = AblationConfig(
        relation=relation, controls=() if no_controls else (tuple(controls) if controls else None), k=k,
        threshold=threshold, top_m=top_m, heads=tuple(heads) if heads else None, random_draws=random_draws,
        seed=seed, mode=mode, all_positions=all_positions, where=where, batch_size=batch_size,
        final_norm=not no_final_norm, first_mlp=first_mlp, min_pairs=min_pairs, multi_token=multi_token,
        max_controls=max_controls,
        max_head_overlap=max_head_overlap, max_accuracy_gap=max_accuracy_gap, reuse_stored=not no_stored_scores)
    runner = InterventionRunner(loaded.model)
    res = run_ablation(runner, s, cfg, pairs=pairs, scores_store=other, log=log)
    run_id = new_run_id("ablate")
    written = []
    if not no_write:
        written.append(write_result_table(s, "maps_ablation", run_id, with_run_id(res.table(), run_id)))
        config: dict[str, Any] = {k_: v for k_, v in cfg.__dict__.items()}
        config.update(first_mlp=res.summary["first_mlp"], k_per_relation={relation: res.summary["k"]})
        write_run(s, run_id, "ablate", started, {**config, "model": model_name, "pairs": list(pair_paths),
                                                  "scores_store": scores_store, "static_scores": res.summary["static_scores"],
                                                  "control_choice": res.summary["control_choice"]})
    if as_json:
        click.echo(json.dumps({"store": s.url, "run_id": run_id, "relations": [res.summary], "rows": res.rows,
                               "tables": written}))
        return
    m = res.summary
    click.echo(f"{relation}: {m['n_prompts']} prompts, {m['n_heads']} heads removed ({m['head_selection']}, k={m['k']}"
               f"{', first MLP' if m['first_mlp'] else ''}, "
               f"{mode} ablation at {m['positions']} position(s)); run {run_id}")
    click.echo(f"  heads: {m['heads'] or '(none)'}")
    click.echo(f"  base accuracy            {m['base']:.3f}   (ingest recorded {m['store_base']:.3f})")
    click.echo(f"  relation heads removed   {m['ablated']:.3f}   {_pct(m['drop_pct'])} drop")
    if m["random_mean"] is not None:
        click.echo(f"  random heads removed     {m['random_mean']:.3f} +- {m['random_std']:.3f} "
                   f"({m['random_draws']} draws)  {_pct(m['random_drop_pct'])} drop")
    for c in m["controls"]:
        click.echo(f"  control {c['relation']:<24} base {c['base']:.3f} -> {c['ablated']:.3f}  {_pct(c['drop_pct'])} drop")
    if m["control_choice"]:
        click.echo(f"  controls: {m['control_selection']}")
        for c in m["control_choice"]:
            click.echo(f"    {'chosen ' if c['chosen'] else 'skipped'} {c['relation']:<40} {c['reason']}")
    sources: dict[str, list[str]] = {}
    for rel, src in m["static_scores"].items():
        sources.setdefault(src, []).append(rel)
    for src, names in sources.items():
        click.echo(f"  static scores {src}: {', '.join(names)}")
    for f in written:
        click.echo(f"wrote {f}")


__all__ = ["ablate"]

_NOT_BUILT = ("trace", "patch")  # registered in actstore.cli, built on the same runner by issue 5


def __getattr__(name: str) -> Any:
    # Until ``trace``/``patch`` exist here, behave like an unbuilt command module: the CLI's lazy
    # loader treats this error as "not built" and click answers "No such command".
    if name in _NOT_BUILT:
        raise ModuleNotFoundError(f"{__name__}.{name} is not built yet", name=__name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ----------------------------------------------------------------------------------- issue 5: trace, patch


def _checked_model(model_name: str, s: Any, device: str, model_dtype: str, allow_other_model: bool, quiet: bool) -> Any:
    """The store's model, loaded; refused when its weights differ from the store's (unless allowed)."""
    import torch

    from ingest.models import load_model

    if quiet:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    loaded = load_model(model_name, device=device, dtype=getattr(torch, model_dtype))
    want = str(s.manifest.model.get("weight_hash") or "")
    if want and want != loaded.weight_hash and not allow_other_model:
        raise ValueError(f"model {model_name!r} has other weights than the store's ({s.manifest.model.get('name')}); "
                         "use the store's model or --allow-other-model")
    return loaded


def _bar(total: int, desc: str, quiet: bool) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="fact", desc=desc, disable=quiet, dynamic_ncols=True, file=None)


@click.command()
@click.option("--model", "model_name", required=True, help="The store's model: alias, folder or hub name.")
@click.option("--store", "store_path", required=True, help="Store holding the facts.")
@where_option("SQL predicate over examples JOIN targets choosing the facts.")
@click.option("--limit", type=int, default=None, help="At most this many facts (in example order).")
@click.option("--all-facts", is_flag=True, help="Also facts the model gets wrong (default: object_rank = 0 only).")
@click.option("--samples", type=int, default=3, show_default=True, help="Noise samples per fact.")
@click.option("--noise", "noise_scale", type=float, default=3.0, show_default=True,
              help="Noise std in multiples of the std of the store's subject-token embeddings.")
@click.option("--noise-std", type=float, default=None, help="Absolute noise std (overrides --noise).")
@click.option("--window", type=int, default=10, show_default=True, help="Layers restored together for MLP and attention.")
@click.option("--components", default="resid,mlp,attn", show_default=True)
@click.option("--all-positions", is_flag=True, help="Also run the positions before the subject (their effect is 0).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--batch-size", type=int, default=64, show_default=True, help="Corrupted copies per forward pass.")
@click.option("--device", default="cpu", show_default=True)
@click.option("--model-dtype", type=click.Choice(MODEL_DTYPES), default="float32", show_default=True)
@click.option("--figures", "fig_dir", default=None, help="Folder for ROME-style heatmaps (PNG).")
@click.option("--max-figures", type=int, default=8, show_default=True, help="Per-fact heatmaps drawn at most.")
@click.option("--allow-other-model", is_flag=True, help="Run even if the model's weights differ from the store's.")
@click.option("--no-write", is_flag=True, help="Do not write the result tables into the store.")
@click.option("--quiet", is_flag=True)
@click.option("--json", "as_json", is_flag=True)
@friendly
def trace(model_name: str, store_path: str, where: str | None, limit: int | None, all_facts: bool, samples: int,
          noise_scale: float, noise_std: float | None, window: int, components: str, all_positions: bool, seed: int,
          batch_size: int, device: str, model_dtype: str, fig_dir: str | None, max_figures: int,
          allow_other_model: bool, no_write: bool, quiet: bool, as_json: bool) -> None:
    """Causal tracing: noise on the subject, restore clean states per layer and position, measure P(object)."""
    import numpy as np

    import actstore
    from actstore.writer import write_result_table
    from ingest.tracing import (
        TraceConfig,
        TraceError,
        effects_table,
        facts_table,
        stored_facts,
        subject_embedding_std,
    )
    from query.cli_maps import new_run_id, with_run_id, write_run

    started = time.time()
    s = actstore.open(store_path)
    cfg = TraceConfig(samples=samples, noise_scale=noise_scale, window=window,
                      components=tuple(c.strip() for c in components.split(",") if c.strip()), seed=seed,
                      batch_size=batch_size, skip_before_subject=not all_positions)
    cfg.validate(s.geometry.n_layers)  # bad settings fail before the model loads
    if limit is not None and limit < 1:
        raise TraceError("--limit must be positive")
    facts = stored_facts(s, where, correct_only=not all_facts, limit=limit)
    if not facts:
        raise TraceError(f"{s.url}: no facts to trace" + (f" where {where}" if where else "") +
                         ("" if all_facts else " that the model answers correctly (try --all-facts)"))
    loaded = _checked_model(model_name, s, device, model_dtype, allow_other_model, quiet)
    from ingest.interventions import InterventionRunner
    from ingest.tracing import CausalTracer

    runner = InterventionRunner(loaded.model)
    std = noise_std if noise_std is not None else noise_scale * subject_embedding_std(loaded.model, s, runner.arch)
    tracer = CausalTracer(runner, cfg, std)
    t0 = time.time()
    with _bar(len(facts), "trace", quiet) as bar:
        results = tracer.trace(facts, progress=bar.update)
    seconds = time.time() - t0
    run_id = new_run_id("trace")
    written, figs = [], []
    if not no_write:
        written.append(write_result_table(s, "trace_effects", run_id, with_run_id(effects_table(results), run_id)))
        written.append(write_result_table(s, "trace_facts", run_id, with_run_id(facts_table(results, cfg), run_id)))
        write_run(s, run_id, "trace", started, {**cfg.__dict__, "noise_std": std, "model": model_name, "where": where,
                                                 "limit": limit, "all_facts": all_facts})
    if fig_dir:
        from pathlib import Path

        from query.cli_methods import trace_average_heatmap, trace_heatmap

        folder = Path(fig_dir)
        folder.mkdir(parents=True, exist_ok=True)
        figs.append(str(trace_average_heatmap(results, folder / "trace_average.png")))
        for r in results[:max_figures]:
            figs.append(str(trace_heatmap(r, folder / f"trace_{r.fact.example_id}.png")))
    rate = 60 * len(results) / seconds if seconds > 0 else None
    if as_json:
        click.echo(json.dumps({"store": s.url, "run_id": run_id, "noise_std": std, "config": cfg.__dict__,
                               "facts": [r.to_json() for r in results], "tables": written, "figures": figs,
                               "trace_seconds": round(seconds, 2), "facts_per_minute": rate}))
        return
    click.echo(f"traced {len(results)} facts in {seconds:.1f}s ({rate or 0:.1f} facts/min), noise std {std:.4g} "
               f"({samples} samples, window {window}); run {run_id}")
    for r in results:
        f = r.fact
        peaks = []
        for c in r.restored:
            ie = r.indirect_effect(c)
            layer, pos = np.unravel_index(int(np.argmax(ie)), ie.shape)
            peaks.append(f"{c} {ie[layer, pos]:+.3f}@L{layer}/{f.tokens[pos].strip() or repr(f.tokens[pos])}")
        click.echo(f"  {f.example_id:>5} {f.subject!r} -> {f.object!r}: p {r.p_clean:.3f} -> {r.p_corrupt:.3f} "
                   f"(TE {r.total_effect:+.3f}); peak IE " + ", ".join(peaks))
    for f_ in (*written, *figs):
        click.echo(f"wrote {f_}")


def _parse_pairs(texts: tuple[str, ...]) -> list[tuple[int, int]]:
    out = []
    for t in texts:
        parts = t.replace(",", ":").split(":")
        try:
            if len(parts) != 2:
                raise ValueError
            out.append((int(parts[0]), int(parts[1])))
        except ValueError:
            raise click.BadParameter(f"{t!r} is not CLEAN_ID:COUNTERFACTUAL_ID", param_hint="--pair") from None
    return out


@click.command()
@click.option("--model", "model_name", required=True, help="The store's model: alias, folder or hub name.")
@click.option("--store", "store_path", required=True, help="Store holding the facts.")
@where_option("SQL predicate over examples JOIN targets choosing the clean facts.")
@click.option("--limit", type=int, default=None, help="At most this many clean facts.")
@click.option("--all-facts", is_flag=True, help="Also clean facts the model gets wrong.")
@click.option("--pair", "pair_texts", multiple=True,
              help="CLEAN_ID:COUNTERFACTUAL_ID (repeatable) instead of choosing counterfactuals.")
@click.option("--components", default="resid,attn,mlp", show_default=True)
@click.option("--positions", default="subject_last,last", show_default=True)
@click.option("--no-heads", is_flag=True, help="Skip the per-head patches.")
@click.option("--head-positions", default="last", show_default=True)
@click.option("--batch-size", type=int, default=64, show_default=True)
@click.option("--device", default="cpu", show_default=True)
@click.option("--model-dtype", type=click.Choice(MODEL_DTYPES), default="float32", show_default=True)
@click.option("--allow-other-model", is_flag=True, help="Run even if the model's weights differ from the store's.")
@click.option("--no-write", is_flag=True, help="Do not write the result tables into the store.")
@click.option("--quiet", is_flag=True)
@click.option("--json", "as_json", is_flag=True)
@friendly
def patch(model_name: str, store_path: str, where: str | None, limit: int | None, all_facts: bool,
          pair_texts: tuple[str, ...], components: str, positions: str, no_heads: bool, head_positions: str,
          batch_size: int, device: str, model_dtype: str, allow_other_model: bool, no_write: bool, quiet: bool,
          as_json: bool) -> None:
    """Activation patching: clean activations into a counterfactual prompt of the same relation;
    logit-difference recovery per layer (attention, MLP, residual) and per head."""
    import numpy as np

    import actstore
    from actstore.writer import write_result_table
    from ingest.patching import (
        ActivationPatcher,
        PatchConfig,
        PatchError,
        PatchPair,
        choose_counterfactuals,
        effects_table,
        pairs_table,
    )
    from ingest.tracing import stored_facts
    from query.cli_maps import new_run_id, with_run_id, write_run

    def split(t: str) -> tuple[str, ...]:
        return tuple(x.strip() for x in t.split(",") if x.strip())

    started = time.time()
    s = actstore.open(store_path)
    cfg = PatchConfig(components=split(components), positions=split(positions), heads=not no_heads,
                      head_positions=split(head_positions), batch_size=batch_size)
    cfg.validate()
    skipped: list[dict[str, Any]] = []
    if pair_texts:
        wanted = _parse_pairs(pair_texts)
        ids = sorted({i for p in wanted for i in p})
        got = {f.example_id: f for f in stored_facts(s, correct_only=False, example_ids=ids, check=False)}
        missing = [i for i in ids if i not in got]
        if missing:
            raise PatchError(f"{s.url}: no fact {missing[0]} with an object token")
        pairs = [PatchPair(got[c], got[x]) for c, x in wanted]
    else:
        if limit is not None and limit < 1:
            raise PatchError("--limit must be positive")
        facts = stored_facts(s, where, correct_only=not all_facts, limit=limit)
        candidates = [f for f in stored_facts(s, correct_only=True, check=False) if f.subject_span[0] >= 0]
        pairs, skipped = choose_counterfactuals(facts, candidates)
    for p in pairs:
        p.check()  # a counterfactual of another relation, a subject not in its prompt: one line, before the model
    if not pairs:
        raise PatchError(f"{s.url}: no fact with a counterfactual to patch" + (f" ({skipped[0]['reason']})" if skipped else ""))
    loaded = _checked_model(model_name, s, device, model_dtype, allow_other_model, quiet)
    from ingest.interventions import InterventionRunner

    patcher = ActivationPatcher(InterventionRunner(loaded.model), cfg)
    t0 = time.time()
    with _bar(len(pairs), "patch", quiet) as bar:
        results = patcher.patch(pairs, progress=bar.update)
    seconds = time.time() - t0
    run_id = new_run_id("patch")
    written = []
    if not no_write:
        written.append(write_result_table(s, "patch_effects", run_id, with_run_id(effects_table(results), run_id)))
        written.append(write_result_table(s, "patch_pairs", run_id, with_run_id(pairs_table(results), run_id)))
        write_run(s, run_id, "patch", started, {**cfg.__dict__, "model": model_name, "where": where, "limit": limit,
                                                 "pairs": list(pair_texts), "skipped": skipped})
    if as_json:
        click.echo(json.dumps({"store": s.url, "run_id": run_id, "config": cfg.__dict__,
                               "pairs": [r.to_json() for r in results], "skipped": skipped, "tables": written,
                               "patch_seconds": round(seconds, 2)}))
        return
    click.echo(f"patched {len(results)} pairs in {seconds:.1f}s ({len(skipped)} facts without a counterfactual); "
               f"run {run_id}")
    for r in results:
        c, x = r.pair.clean, r.pair.counterfactual
        best = []
        for (comp, pos), v in r.recovery.items():
            if comp != "resid" and np.isfinite(v).any():
                layer = int(np.nanargmax(v))
                best.append(f"{comp}@{pos} {v[layer]:+.2f}@L{layer}")
        click.echo(f"  {c.example_id:>5} {c.subject!r}->{c.object!r} into {x.subject!r}->{x.object!r}: "
                   f"LD {r.ld_clean:+.2f} / {r.ld_cf:+.2f}; best " + ", ".join(best))
    for f_ in written:
        click.echo(f"wrote {f_}")


__all__ += ["trace", "patch"]
