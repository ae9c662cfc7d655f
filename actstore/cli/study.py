"""``actstore study``: the method-comparison study of An Empirical Study of Mechanistic Interpretability
Approaches for Factual Recall (ACL 2025) on an ingested store: its data set, a resumable run traced in
ranges by several processes and merged, checkpoints that outlive a store, the re-read against chance,
and the Markdown tables of their outputs."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from actstore.cli._config import config_from, options_from
from actstore.cli._options import (
    command,
    open_store_arg,
    option_names,
    printable,
    quiet_option,
    split_list,
    store_argument,
    threads_option,
)
from actstore.core.errors import InvalidSetting
from actstore.jobs.study_settings import (
    StudyChanceConfig,
    StudyCheckpointConfig,
    StudyDataConfig,
    StudyMergeConfig,
    StudyRestoreConfig,
    StudyRunConfig,
)

Log = Callable[[str], None]
C = TypeVar("C")


def _settings(cls: type[C], given: dict[str, Any], **values: Any) -> C:
    """The command's settings from its options; a required option left out, or a value the settings
    refuse, is a usage error (exit status 2) naming the option."""
    ctx = click.get_current_context()
    params = {p.name: p for p in ctx.command.params}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.metadata.get("required") and f.name in given and not given[f.name]:
            raise click.MissingParameter(ctx=ctx, param=params[f.name])
    try:
        return config_from(cls, given, **values)
    except InvalidSetting as e:
        flag = option_names(ctx.command.params).get(e.setting) or "--" + e.setting.replace("_", "-")
        raise click.BadParameter(e.detail, ctx=ctx, param_hint=f"'{flag}'") from None


def _log(quiet: bool = False) -> Log | None:
    """Progress lines on stderr, each with the time of day (none with ``--quiet``)."""
    if quiet:
        return None
    return lambda message: click.echo(f"[{time.strftime('%H:%M:%S')}] {printable(message)}", err=True)


@click.group(
    "study",
    epilog="\b\nExample (a study on a SmolLM2 store, resumed by the same command):\n"
    "  actstore study data --out DATA --size 4800\n"
    "  actstore ingest --model smollm2-135m --dataset methods2k:DATA --out S\n"
    "  actstore study run S --state S.study.json --trace-minutes 30 --samples 10 --out S.out.json\n"
    "  actstore study chance S --state S.study.json --out chance.json.gz",
)
def study() -> None:
    """Run the method comparison of An Empirical Study of Mechanistic Interpretability Approaches for
    Factual Recall (ACL 2025) on a store, resumably.

    Causal tracing (Meng et al., Locating and Editing Factual Associations in GPT, arXiv 2202.05262),
    activation patching, probes, attention, the logit lens and the tuned lens (Belrose et al.,
    Eliciting Latent Predictions from Transformers with the Tuned Lens, arXiv 2303.08112) are read
    on the same facts of the methods2k data set; the study measures how well each locates a fact
    (precision, consistency, the effect of knocking its site out or restoring it against random
    layers) and how far the methods agree, against chance.

    A run records each step in its state file: the same command resumes it, other processes trace
    later ranges of the same order beside it ('run --start N --trace-only', then 'merge'), and
    'checkpoint' / 'restore' carry its runs to a store ingested elsewhere from the same data."""


# ------------------------------------------------------------------------------------ data
@command("data", example="actstore study data --out DATA --size 4800")
@options_from(StudyDataConfig, first=("out",))
def data(**given: Any) -> None:
    """Write the methods2k data set (methods2k.json): facts of LRE's factual relations and ROME's
    known_1000 tagged with their subject's frequency band and uniqueness, sampled evenly over the
    strata (relation x frequency band x uniqueness), as the ACL 2025 study samples them."""
    from actstore.jobs.study_state import build_study_data

    path = build_study_data(_settings(StudyDataConfig, given))
    click.echo(f"wrote {printable(path)}")


# ------------------------------------------------------------------------------------ run
@command(
    "run",
    example="actstore study run S --state S.study.json --trace-minutes 30 --samples 10 --out S.out.json\n"
    "actstore study run S --state S.tail.json --start 440 --trace-only   # beside it, in another process",
)
@store_argument
@threads_option
@options_from(StudyRunConfig, first=("state",))
@quiet_option
def run(store: str, quiet: bool, **given: Any) -> None:
    """Trace, patch, intervene and measure, each run recorded in the state (run it again to resume).

    \b
    1. the facts the model answers, ordered round-robin over the strata (a seeded shuffle within
       each), so that every prefix of the order is stratified;
    2. causal tracing of that order, --chunk facts a trace run, until the state's trace calls add up
       to --trace-minutes (or it holds --max-facts facts): MLP and attention, --window layers;
    3. activation patching of the traced facts not patched yet (one patch run per call);
    4. every method's reading (the tuned lens fit on the facts not traced), the sites each locates,
       knock-out and restore interventions on them and on random layers (site_effects);
    5. the metrics per method, overall and per stratum, the pairs with bootstrap intervals and the
       cross-size row: one 'methods' run per mode (method_metrics, method_pair_metrics,
       method_cross_size), and the summary written to --out."""
    from actstore.core.progress import progress_wanted
    from actstore.jobs.study import run_study

    cfg = _settings(StudyRunConfig, given, progress=progress_wanted(quiet))
    out = run_study(open_store_arg(store), cfg, log=_log(quiet))
    st = out.state
    click.echo(
        f"{printable(cfg.state)}: {len(st['traced'])} traced facts in {len(st['trace_runs'])} trace runs, "
        f"{len(st.get('patched', []))} patched"
    )
    for mode, rid in out.metrics_runs.items():
        click.echo(f"metrics ({mode}): run {rid}")
    if out.summary:
        click.echo(f"wrote {printable(out.summary)}")


# ------------------------------------------------------------------------------------ merge
@command("merge", example="actstore study merge S --state S.study.json --add S.mid.json --add S.tail.json")
@store_argument
@options_from(StudyMergeConfig, first=("state",))
def merge(store: str, **given: Any) -> None:
    """Fold the tracing of other states ('run --start N --trace-only' on the same store) into --state:
    their trace runs and facts appended, their trace seconds added.  Refused, with nothing written,
    when a fact is traced twice or a run is missing, is no trace run, or traced with other settings."""
    from actstore.jobs.study import merge_states

    cfg = _settings(StudyMergeConfig, given)
    st = merge_states(open_store_arg(store), cfg)
    click.echo(
        f"{printable(cfg.state)}: {len(st['traced'])} traced facts in {len(st['trace_runs'])} trace runs"
    )


# ------------------------------------------------------------------------------------ checkpoint
@command("checkpoint", example="actstore study checkpoint S --state S.study.json --out CK")
@store_argument
@options_from(StudyCheckpointConfig, first=("state",))
def checkpoint(store: str, **given: Any) -> None:
    """Write the study's trace, patch and site-effect runs to a folder: numbers and run records only
    (the data set's text is left out, and read back from the store it is restored into), with each
    fact's fingerprint and the model's weight hash."""
    from actstore.jobs.study_checkpoint import checkpoint_study

    cfg = _settings(StudyCheckpointConfig, given)
    counts = checkpoint_study(open_store_arg(store), cfg)
    click.echo(f"wrote {printable(cfg.out)}: " + ", ".join(f"{n} {k} rows" for k, n in counts.items()))


# ------------------------------------------------------------------------------------ restore
@command("restore", example="actstore study restore S2 --from CK --state S2.study.json")
@store_argument
@options_from(StudyRestoreConfig)
def restore(store: str, **given: Any) -> None:
    """Write a checkpoint's runs into STORE, a store ingested from the same data with the same model
    (refused otherwise, the store left as it was), and a new state that 'run' resumes from."""
    from actstore.jobs.study_checkpoint import restore_study

    cfg = _settings(StudyRestoreConfig, given)
    st = restore_study(open_store_arg(store), cfg)
    click.echo(
        f"restored {len(st['traced'])} traced facts ({len(st['trace_runs'])} trace runs, "
        f"{len(st.get('patch_runs', []))} patch runs) into {printable(store)}; state {printable(cfg.state)}"
    )


# ------------------------------------------------------------------------------------ chance
@command("chance", example="actstore study chance S --state S.study.json --tuned adam --out chance.json.gz")
@store_argument
@threads_option
@options_from(StudyChanceConfig, first=("state",))
@quiet_option
def chance(store: str, quiet: bool, **given: Any) -> None:
    """Re-read a study from its stored runs (nothing is traced, patched or intervened again) and print
    its Markdown tables: every pair's key-layer and verdict agreement against chance (a permutation
    null within strata, Cohen's kappa, the excess over chance), the effect correlations raw, relative
    to p_clean, log-odds and partial, the key-layer variants, and all of it again on the facts ROME's
    filter keeps (Meng et al., arXiv 2202.05262)."""
    from actstore.cli._study_tables import reread_tables
    from actstore.jobs.study_chance import run_chance

    cfg = _settings(StudyChanceConfig, given)
    log = _log(quiet)
    result = run_chance(open_store_arg(store), cfg, log=log)
    if cfg.out and log is not None:
        log(f"wrote {cfg.out}")
    click.echo(reread_tables(result))


# ------------------------------------------------------------------------------------ tables
@command("tables", example="actstore study tables S.out.json")
@click.argument("summary", metavar="FILE")
@click.option(
    "--groupings",
    default="freq_band,uniqueness,source_set",
    show_default=True,
    metavar="LIST",
    help="The strata of the per-group tables (a study's summary).",
)
def tables(summary: str, groupings: str) -> None:
    """Print the Markdown tables of a 'run --out' summary (per method, by stratum, the pairs, the
    cross-size row) or of a 'chance --out' re-read, plain JSON or gzip-compressed (.gz)."""
    from actstore.cli._study_tables import is_reread, reread_tables, study_tables
    from actstore.jobs.study_state import read_summary

    d = read_summary(Path(summary))
    click.echo(reread_tables(d) if is_reread(d) else study_tables(d, split_list(groupings) or ()))


# ------------------------------------------------------------------------------------ summary
def _labelled(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> list[tuple[str, str]]:
    out = []
    for item in value:
        label, sep, path = item.partition("=")
        if not sep or not label or not path:
            raise click.BadParameter(f"LABEL=FILE, not {item!r}")
        out.append((label, path))
    return out


@command(
    "summary",
    example="actstore study summary 'SmolLM2, window 10=chance.json.gz' 'SmolLM2, window 1=chance-w1.json.gz'",
)
@click.argument("outputs", nargs=-1, required=True, metavar="LABEL=FILE...", callback=_labelled)
@click.option(
    "--subset",
    type=click.Choice(["all", "rome"]),
    default="all",
    show_default=True,
    help="All traced facts, or those ROME's filter keeps.",
)
def summary(outputs: list[tuple[str, str]], subset: str) -> None:
    """Print one Markdown table across several 'chance --out' re-reads, a column each named by its
    LABEL: the paper's pairs, the verdicts and the key-layer variants as observed / chance / excess
    [95%] / kappa (facts), then the effect correlations; a figure a re-read lacks is '-'."""
    from actstore.cli._study_tables import summary_table
    from actstore.jobs.study_state import read_summary

    click.echo(summary_table([(label, read_summary(Path(path))) for label, path in outputs], subset))


for _cmd in (data, run, merge, checkpoint, restore, chance, tables, summary):
    study.add_command(_cmd)

COMMANDS = [study]
__all__ = ["COMMANDS", "study"]
