"""The settings of ``actstore study``, the method-comparison study of An Empirical Study of Mechanistic
Interpretability Approaches for Factual Recall (ACL 2025) run on a store: the data set, a run (trace,
patch, intervene, measure), the merge of states traced in parallel, checkpoints and their restore, and
the re-read against chance.  Torch-free, like :mod:`actstore.jobs.settings`, so that the command line
builds its options from them without loading the methods."""

from __future__ import annotations

from dataclasses import dataclass

from actstore.core.errors import InvalidSetting, LensError
from actstore.core.settings import check_settings, setting
from actstore.query.analyses.lens_methods import TUNED_METHODS, check_tuned_method
from actstore.query.methods.defaults import METHODS

MODES = ("knockout", "restore")  # the interventions on located and random sites
CHANCE_METHODS = tuple(m for m in METHODS if m != "tuned_lens")  # the re-read's --methods (--tuned adds it)
STATE_HELP = "The study's state file (JSON): the facts traced and patched and every run id."


def _state() -> str:
    return setting("", STATE_HELP, required=True, metavar="FILE")


def _need(config: object, *names: str) -> None:
    for name in names:
        if not getattr(config, name):
            raise InvalidSetting(name, "a file or folder is needed")


@dataclass(frozen=True)
class StudyDataConfig:
    """``actstore study data``: the methods2k data set (``methods2k.json``) written to ``out``."""

    out: str = setting("", "Folder to write methods2k.json into.", required=True, metavar="DIR")
    lre: str | None = setting(
        None,
        "LRE relation files (the factual folder of Hernandez et al., Linearity of Relation Decoding in "
        "Transformer Language Models, arXiv 2308.09124). Default: the public copy, as --dataset methods2k "
        "reads it ($ACTSTORE_DATA or the data set cache).",
        metavar="PATH",
    )
    known: str | None = setting(
        None,
        "ROME's known_1000.json (Meng et al., Locating and Editing Factual Associations in GPT, arXiv "
        "2202.05262). Default: the public copy, as for --lre.",
        metavar="FILE",
    )
    frequency: str | None = setting(
        None,
        "A JSON table subject -> Zipf frequency to tag the subjects with, instead of wordfreq's "
        "(which needs the methods extra).",
        metavar="FILE",
    )
    size: int | None = setting(None, "Facts to sample (default: the data set's 2,000).", low=0)
    seed: int = setting(0, "Seed of the stratified sample.")

    def __post_init__(self) -> None:
        check_settings(self)
        _need(self, "out")


@dataclass(frozen=True)
class StudyRunConfig:
    """``actstore study run``: the steps of a study, each recorded in the state file ``state`` so that
    the same command resumes it (see :func:`actstore.jobs.study.run_study`)."""

    state: str = _state()
    trace_minutes: float = setting(
        30.0,
        "Trace until the state's trace calls add up to this many minutes (the state's total, not this "
        "call's; 0: trace nothing more).",
        low=0,
    )
    max_facts: int | None = setting(
        None, "At most this many traced facts in the state (default: all).", low=0
    )
    chunk: int = setting(8, "Facts per trace run.", low=1)
    start: int = setting(
        0,
        "Trace the stratified order from its N-th fact: another process traces the facts before it "
        "(with --trace-only; see 'actstore study merge').",
        low=0,
    )
    trace_only: bool = setting(False, "Stop after tracing (no patching, interventions or metrics).")
    samples: int = setting(2, "Noise samples per fact, of tracing and of the restore interventions.", low=1)
    window: int = setting(10, "Layers restored together by causal tracing (ROME's window).", low=1)
    seed: int = setting(0, "Seed of the stratified order's shuffles within each stratum.")
    patch: bool = setting(True, "Do not patch (no patch method).")
    all_facts: bool = setting(False, "Also the facts the model gets wrong (tests).")
    methods: tuple[str, ...] = setting(METHODS, "Methods to compare (comma-separated).", choices=METHODS)
    modes: tuple[str, ...] = setting(
        MODES,
        "Interventions on each method's located sites and on random layers: knock-out and/or restore "
        "(comma-separated).",
        choices=MODES,
    )
    random_draws: int = setting(
        4, "Random layers per fact and component (the baseline of effectiveness).", low=1
    )
    resamples: int = setting(2000, "Bootstrap resamples of every interval.", low=1)
    out: str | None = setting(
        None,
        "Write the summary here: the state, the readings, the metrics of each mode and the cross-size "
        "row, as JSON (gzip-compressed when the name ends in .gz).",
        metavar="FILE",
    )
    device: str = setting("cpu", "torch device of the model (cuda on a GPU).")
    tuned: str = setting(
        "adam",
        "The tuned lens (Belrose et al., Eliciting Latent Predictions from Transformers with the Tuned "
        "Lens, arXiv 2303.08112), fit on the facts not traced: trained on the KL with adam or sgd, or "
        "the closed-form ridge fit (ours).",
        choices=TUNED_METHODS,
    )
    tuned_steps: int = setting(250, "Tuned-lens training steps (adam, sgd).", low=1)
    tuned_batch: int = setting(64, "Training facts per step (adam, sgd).", low=1)
    tuned_lr: float | None = setting(None, "Learning rate (default: 1e-3 adam, 0.1 sgd).", above=0)
    tuned_seed: int = setting(0, "Seed of the tuned lens's batches.")
    progress: bool = setting(False, "Progress bars of the trace and patch runs on stderr.", cli=False)

    def __post_init__(self) -> None:
        check_settings(self)
        _need(self, "state")


@dataclass(frozen=True)
class StudyMergeConfig:
    """``actstore study merge``: the tracing of the states ``add`` folded into ``state``."""

    state: str = setting("", "The state to extend.", required=True, metavar="FILE")
    add: tuple[str, ...] = setting(
        (),
        "A state whose tracing is added ('actstore study run --start N --trace-only' on the same store); "
        "repeatable.",
        multiple=True,
        required=True,
        metavar="FILE",
    )

    def __post_init__(self) -> None:
        check_settings(self)
        _need(self, "state", "add")


@dataclass(frozen=True)
class StudyCheckpointConfig:
    """``actstore study checkpoint``: the study's runs, without the data set's text, into ``out``."""

    state: str = _state()
    out: str = setting("", "The checkpoint folder (written again in place).", required=True, metavar="DIR")

    def __post_init__(self) -> None:
        check_settings(self)
        _need(self, "state", "out")


@dataclass(frozen=True)
class StudyRestoreConfig:
    """``actstore study restore``: a checkpoint's runs into a store of the same facts; a new state."""

    checkpoint: str = setting("", "The checkpoint folder.", required=True, metavar="DIR", flag="--from")
    state: str = setting("", "The state file to write (must not exist).", required=True, metavar="FILE")

    def __post_init__(self) -> None:
        check_settings(self)
        _need(self, "checkpoint", "state")


@dataclass(frozen=True)
class StudyChanceConfig:
    """``actstore study chance``: a finished study re-read from its stored runs (no model): agreement
    against chance, effects relative to p_clean, key-layer variants, ROME's filter."""

    state: str = _state()
    out: str | None = setting(
        None, "Write every figure here as JSON (gzip-compressed when the name ends in .gz).", metavar="FILE"
    )
    methods: tuple[str, ...] = setting(
        CHANCE_METHODS, "Methods to read: trace and any of these (comma-separated).", choices=CHANCE_METHODS
    )
    tuned: str | None = setting(
        None,
        "Also the tuned lens: adam, sgd or ridge (fit on the facts as the study fit it), or "
        "corpus:STORE[#RUN] (the translators an 'actstore corpus-lens' run stored; its @top10 and @half "
        "keys too).",
        metavar="adam|sgd|ridge|corpus:STORE",
    )
    also_trace: str | None = setting(
        None,
        "Another study state on the same store whose trace runs have another window: read as the "
        "variant trace@wN on this study's traced facts (window 1 against 10, say).",
        metavar="FILE",
    )
    threshold: float = setting(
        0.0,
        "ROME's filter (Meng et al., arXiv 2202.05262): keep the facts whose total effect is above this.",
    )
    permutations: int = setting(1000, "Shuffles of the permutation null behind each chance level.", low=1)
    resamples: int = setting(2000, "Bootstrap resamples of every interval.", low=1)

    def __post_init__(self) -> None:
        if self.tuned is not None:
            try:
                check_tuned_method(self.tuned)
            except LensError as e:
                raise InvalidSetting("tuned", str(e)) from None
        check_settings(self)
        _need(self, "state")
        if "trace" not in self.methods:
            raise InvalidSetting("methods", f"trace and any of {', '.join(CHANCE_METHODS[1:])}")
