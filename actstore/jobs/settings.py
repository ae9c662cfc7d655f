"""The settings of every job, one config per command, torch-free so that ``actstore --help`` loads no
analysis: the command line makes the command's options from its config (:mod:`actstore.cli._config`)
and calls the job with it, ``run_x(store, config)``.  Each is validated when it is made.

A job that runs a lower floor's computation holds that floor's settings in a :func:`nested` field
and adds its own: ``TraceRequest`` (:class:`~actstore.interventions.settings.TraceConfig`),
``PatchRequest`` (:class:`~actstore.interventions.settings.PatchConfig`), ``AblateRequest``
(:class:`~actstore.query.maps.settings.AblationConfig`) and ``ProbeRequest``
(:class:`~actstore.query.analyses.probe_config.ProbeConfig`); the ingest's is
:class:`actstore.ingest.settings.IngestRequest`.  What several jobs share is written once, in a base
class here (:class:`StoreModelRun`: the store's model, its device and dtype; :class:`FactsRun`: the
facts traced or patched; :class:`ProbeRunReader`: the probe run read) or in
:mod:`actstore.core.settings` (device, model dtype, threads, ``save``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from actstore.core.errors import InvalidSetting, LensError, MethodsError
from actstore.core.settings import (
    check_settings,
    device_setting,
    model_dtype_setting,
    nested,
    save_setting,
    setting,
)
from actstore.ingest.settings import DEFAULT_MODEL
from actstore.interventions.settings import PatchConfig, TraceConfig
from actstore.query.analyses.lens_methods import TUNED_METHODS, check_tuned_method
from actstore.query.analyses.probe_config import ProbeConfig
from actstore.query.maps.settings import (
    AblationConfig,
    k_setting,
    min_pairs_setting,
    multi_token_setting,
    threshold_setting,
)
from actstore.query.methods.defaults import COMPARISON_BATCH, COMPARISON_STEPS, METHODS, PLATEAU

STORE_MODEL_HELP = "Model: alias, local folder or hub name (default: the store's model when it is one of actstore's aliases)."
TOPK_KINDS = ("mlp", "attn_head", "direction")
DEMO_EPISODES = 100  # probe episodes per seed of the demo (a few minutes on two CPU cores)

DIRECTIONS = ("out", "both")
CONCENTRATIONS = ("predicted-abs", "gold-signed")
OUTPUT_RANGES = ("dataset", "sample")
TUNED_HELP = (
    "Tuned-lens translators: trained on the KL to the model's output with Adam or Nesterov SGD (Belrose "
    "et al., the tuned-lens package's settings), or the closed-form ridge fit (ours)."
)
AGREE_TUNED_HELP = (
    TUNED_HELP[:-1] + "; or corpus:STORE[#RUN] to read the facts through the translators an 'actstore "
    "corpus-lens' run on STORE (a corpus store of the same model) stored: the tuned lens as published."
)


@dataclass(frozen=True)
class MapsRunConfig:
    """One ``actstore maps`` run: static scores of every head for the relations of ``pairs``."""

    pairs: tuple[str, ...] = setting(
        (),
        "MAPS pair file ([[source, target], ...]) or a directory of them; repeatable.",
        multiple=True,
        required=True,
    )
    relations: tuple[str, ...] | None = setting(None, "Comma-separated relation names (file stems) to keep.")
    k: int | None = k_setting()
    threshold: float = threshold_setting()
    multi_token: str = multi_token_setting(
        "skip: score single-token pairs only (the authors' filter); first: a multi-token word stands "
        "as its first token (ours)."
    )
    min_pairs: int = min_pairs_setting(
        "Relations with fewer usable pairs are reported as excluded and scored nowhere (the authors' "
        "min_filtered_dataset_size)."
    )
    final_norm: bool = setting(
        True,
        "Read heads through the raw unembedding (the paper's code) instead of the final norm's weight times it.",
    )
    tokenizer: str | None = setting(None, "Tokenizer folder or name (default: the store's model).")
    first_mlp: bool | None = setting(
        None, "Read through the first MLP (None: the authors' default).", cli=False
    )
    salient_heads: str = setting(
        "all", "Heads for salient operations: all, none, or LAYER.HEAD list (12.3,7.*)."
    )
    salient_tokens: int = setting(10, "Salient tokens per head (by sigma).", low=1)
    mappings: int = setting(5, "Top mapped tokens per salient token.", low=1)
    save: bool = save_setting()
    figures: str | None = setting(None, "Folder for one layer x head heatmap per relation.", cli=False)

    def __post_init__(self) -> None:
        check_settings(self)
        if not self.pairs:
            raise InvalidSetting("pairs", "give at least one pair file or folder")


@dataclass(frozen=True)
class MapsDynamicConfig:
    """One ``actstore maps-dynamic`` run: what the heads wrote on the stored prompts."""

    where: str | None = setting(None, "SQL predicate over the examples table.", cli=False)
    relations: tuple[str, ...] | None = setting(None, "Comma-separated relation ids.")
    k: int | None = k_setting()
    threshold: float = threshold_setting()
    multi_token: str = multi_token_setting(
        "skip: only prompts whose subject and object are one token each (the authors' filter); "
        "first: every prompt, a multi-token word standing as its first token (ours)."
    )
    min_pairs: int = min_pairs_setting(
        "Relations with fewer usable pairs are reported as excluded and left out."
    )
    pairs: tuple[str, ...] = setting(
        (),
        "MAPS pair files or directories: count each relation's usable pairs in its file (the authors' "
        "criterion) rather than among the store's prompts (a sample of it undercounts).",
        multiple=True,
    )
    tokenizer: str | None = setting(None, "Tokenizer folder or name (default: the store's model).")
    source_token: str = setting(
        "first",
        "Which subject token is the static source and the no-context attention target.",
        choices=("first", "last"),
    )
    final_norm: bool = setting(True, "Raw unembedding instead of final norm weight times it.")
    first_mlp: bool | None = setting(None, "Through the first MLP (None: the authors' default).", cli=False)
    compare_first_mlp: bool = setting(
        False,
        "Static scores both from the embeddings and through the first MLP (loads the model), sharing "
        "one dynamic pass: a correlation row per relation and variant.",
    )
    save: bool = save_setting()
    figures: str | None = setting(None, "Folder for the static and dynamic heatmaps.", cli=False)
    prompts_per_task: int | None = setting(
        None, "Prompts per Dask task (whole chunks of 256; default: one task per worker).", low=1
    )

    def __post_init__(self) -> None:
        check_settings(self)


@dataclass(frozen=True)
class ProbeRunReader:
    """A run of its own over the stored probe run ``probe_run`` (correlate, shortcuts)."""

    probe_run: str = setting("", "Probe run id (see the runs table).", cli=False)
    save: bool = save_setting()

    def __post_init__(self) -> None:
        check_settings(self)
        if not self.probe_run:
            raise InvalidSetting("probe_run", "name the probe run to read")


@dataclass(frozen=True)
class CorrelateConfig(ProbeRunReader):
    """One ``correlate`` run over the probe run ``probe_run`` (``kb``: triple files of the knowledge graph)."""

    kb: tuple[str, ...] = setting((), "Knowledge-graph triple files.", cli=False)
    direction: str = setting(
        "out", "An entity's properties: those it has as head, or in either position.", choices=DIRECTIONS
    )
    concentration: str = setting(
        "predicted-abs",
        "HeadScore concentration over the predictions assigned to each relation, summing |score| (no labels "
        "needed, as Tracing Relational Knowledge Recall in Large Language Models, arXiv 2604.19934, presents "
        "it), or the earlier gold-label signed version (ours).",
        choices=CONCENTRATIONS,
    )
    dataset_file: str | None = setting(
        None,
        "The FewRel JSON the store was ingested from: output range over every instance of each relation "
        "in it, object-first ones included (ours; default when given).",
    )
    output_range: str | None = setting(
        None,
        "Output range over the data set file or over the run's stored sample (default: dataset when "
        "--dataset-file is given, else sample).",
        choices=OUTPUT_RANGES,
    )
    dask_address: str | None = setting(None, "Dask scheduler address.", cli=False)
    workers: int | None = setting(None, "Local Dask worker processes.", cli=False)
    figures: str | None = setting(None, "Folder for one scatter PNG per predictor.", cli=False)


@dataclass(frozen=True)
class ShortcutsConfig(ProbeRunReader):
    """One ``shortcuts`` run over the probe run ``probe_run``."""

    n_cues: int = setting(20, "Lexical cues per relation.", low=1, flag="--cues")
    figures: str | None = setting(None, "Folder for shortcuts_RUN.png.", cli=False)


@dataclass(frozen=True)
class LensRunConfig:
    """One ``actstore lens`` run: the logit lens on every selected fact, and a tuned lens trained on a
    share of them and evaluated on the rest."""

    where: str | None = setting(None, "SQL predicate over the examples table choosing the facts.", cli=False)
    correct_only: bool = setting(False, "Only facts the model answers correctly (object_rank = 0).")
    train_fraction: float = setting(
        0.5,
        "Share of the facts that train the tuned lens; the rest are held out and evaluated.",
        above=0,
        high=1,
    )
    tuned: str | None = setting("adam", TUNED_HELP, choices=TUNED_METHODS)
    steps: int = setting(250, "Training steps (adam, sgd).", low=1, flag="--tuned-steps")
    batch: int = setting(
        2**18,
        "Training facts per step (adam, sgd); at least the number of training facts = full batch.",
        low=1,
        flag="--tuned-batch",
    )
    seed: int = setting(0, "Seed of the train/held-out split and training.")
    save: bool = save_setting()
    figures: str | None = setting(None, "Folder for the lens curves.", cli=False)

    def __post_init__(self) -> None:
        check_settings(self)


@dataclass(frozen=True)
class CorpusLensConfig:
    """One ``actstore corpus-lens`` run: the tuned lens trained on a corpus store's positions of some
    documents and read, with the logit lens, on the positions of the others."""

    held_out: float = setting(0.2, "Share of the documents held out (never trained on).", above=0, high=0.9)
    max_train_rows: int = setting(
        16384, "Training positions at most (drawn from the training documents).", low=1
    )
    max_eval_rows: int = setting(4096, "Held-out positions at most.", low=1)
    optimizer: str = setting(
        "adam", "Translator training: adam or sgd (as the tuned-lens package).", choices=("adam", "sgd")
    )
    steps: int = setting(250, "Training steps.", low=1)
    batch: int = setting(256, "Positions per training step.", low=1)
    seed: int = setting(0, "Seed of the document split, the row draws and the training.")
    save: bool = save_setting()

    def __post_init__(self) -> None:
        check_settings(self)


@dataclass(frozen=True)
class AgreeConfig:
    """One ``actstore agree`` run.  ``runs``: trace and/or patch run ids to read, each found in its
    own table (``trace_run``/``patch_run`` name them explicitly); the newest run of a table when no
    run of it is named.  ``steps``, ``batch``, ``seed``: the tuned lens's training (adam, sgd), the
    rest as ``actstore.query.methods.readings.COMPARISON_TRAIN``."""

    methods: tuple[str, ...] = setting(METHODS, "Methods to compare (comma-separated).", choices=METHODS)
    runs: tuple[str, ...] = setting(
        (),
        "A trace or patch run to read (repeatable; default: the newest of each).",
        multiple=True,
        flag="--run",
    )
    trace_run: str | None = setting(None, "Trace run id to read.", cli=False)
    patch_run: str | None = setting(None, "Patch run id to read.", cli=False)
    tolerance: int | None = setting(None, "Key layers agree within this many layers (default L/10).", low=0)
    plateau: float = setting(
        PLATEAU,
        "Key layer = middle of the run of layers within this fraction of the peak (1 = argmax).",
        above=0,
        high=1,
    )
    probe_min_count: int = setting(5, "Objects with fewer facts in the store are not probe classes.", low=1)
    probe_folds: int = setting(3, "Cross-validation folds of the probes.", low=2)
    tuned: str = setting("adam", AGREE_TUNED_HELP, metavar="adam|sgd|ridge|corpus:STORE")
    steps: int = setting(COMPARISON_STEPS, "Training steps (adam, sgd).", flag="--tuned-steps", low=1)
    batch: int = setting(
        COMPARISON_BATCH,
        "Training facts per step (adam, sgd), drawn from the facts not compared; at least their number = "
        "full batch (about a minute per step on SmolLM2 on one CPU thread).",
        flag="--tuned-batch",
        low=1,
    )
    seed: int = setting(0, "Seed of the tuned lens's training.")
    permutations: int = setting(
        1000, "Shuffles of the permutation null behind each agreement's chance level.", low=1
    )
    null_grouping: str = setting(
        "stratum",
        "Facts are shuffled within their methods2k stratum (else their relation), their relation, or all "
        "together (none).",
        choices=("stratum", "relation", "none"),
    )
    save: bool = save_setting()
    figures: str | None = setting(None, "Folder for the profile curves.", cli=False)

    def __post_init__(self) -> None:
        try:  # the tuned lens's own error, under the setting's name (--tuned on the command line)
            check_tuned_method(self.tuned)
        except LensError as e:
            raise InvalidSetting("tuned", str(e)) from None
        check_settings(self)
        if len(self.methods) < 2:
            raise MethodsError("compare at least two methods")


# ----------------------------------------------------------------- the jobs that run the store's model
@dataclass(frozen=True)
class StoreModelRun:
    """What a job that runs the store's model adds (trace, patch, ablate): which model, on which device
    and in which dtype (:func:`actstore.jobs.model.load_request_model`), whether its tables are
    written, and whether it shows progress."""

    model: str | None = setting(None, STORE_MODEL_HELP)  # None: the store's own (an actstore alias)
    device: str = device_setting()
    model_dtype: str = model_dtype_setting()
    allow_other_model: bool = setting(False, "Run even if the model's weights differ from the store's.")
    save: bool = save_setting()
    quiet: bool = setting(False, "No progress bars.", cli=False)

    def __post_init__(self) -> None:
        check_settings(self)


@dataclass(frozen=True)
class FactsRun(StoreModelRun):
    """The store's facts a trace or patch run reads: those ``where`` selects, in example order, the
    model's correct answers only unless ``all_facts``."""

    where: str | None = setting(None, "SQL predicate over the examples table choosing the facts.", cli=False)
    limit: int | None = setting(None, "At most this many facts (in example order).", low=1)
    all_facts: bool = setting(
        False,
        "Also facts the model gets wrong (default: object_rank = 0 only); patch takes them as "
        "counterfactuals too.",
    )

    def facts_config(self, model: str) -> dict[str, Any]:
        """What a run's ``runs`` config says beside its intervention settings: the model, the facts."""
        return {"model": model, "where": self.where, "limit": self.limit}


@dataclass(frozen=True)
class TraceRequest(FactsRun):
    """One ``actstore trace`` run: causal tracing (``trace``) of the selected facts."""

    trace: TraceConfig = nested(TraceConfig)
    noise_std: float | None = setting(None, "Absolute noise std (overrides --noise).", low=0)
    figures: str | None = setting(None, "Folder for ROME-style heatmaps (PNG).", cli=False)
    max_figures: int = setting(8, "Per-fact heatmaps drawn at most.", low=0)


@dataclass(frozen=True)
class PatchRequest(FactsRun):
    """One ``actstore patch`` run: activation patching (``patch``) from each selected fact into a
    counterfactual, or of the given ``pairs``."""

    patch: PatchConfig = nested(PatchConfig)
    pairs: tuple[tuple[int, int], ...] = setting(
        (), "(clean, counterfactual) example ids, instead of choosing counterfactuals.", cli=False
    )


@dataclass(frozen=True)
class AblateRequest(StoreModelRun):
    """One ``actstore ablate`` run: ``ablation`` says what is removed and measured; the rest where the
    model, the pairs and the stored static scores come from."""

    ablation: AblationConfig = nested(AblationConfig)
    pairs: tuple[str, ...] = setting(
        (),
        "MAPS pair files or directories for the static scores of RELATION and of the candidate controls "
        "(default, and for relations without a file: the store's own prompts).",
        multiple=True,
    )
    scores_store: str | None = setting(
        None,
        "Read stored static scores (an `actstore maps` run with the same settings) from this store of "
        "the same model instead of STORE's.",
    )


# ----------------------------------------------------------------- probes, top-k contexts, the demo
@dataclass(frozen=True)
class ProbeRequest:
    """One ``actstore probe`` run: the probe (``probe``, recorded with the run) and the job's own."""

    probe: ProbeConfig = nested(ProbeConfig)
    save: bool = save_setting()
    progress: bool = setting(False, "Progress bars on stderr.", cli=False)


@dataclass(frozen=True)
class TopkConfig:
    """One ``actstore topk`` run: the top ``k`` rows of every unit of one layer, from one streaming
    pass over the rows ``where`` selects."""

    kind: str = setting(
        "mlp",
        "Units: every MLP neuron (its activation), every head's output norm, or each row of --direction.",
        choices=TOPK_KINDS,
    )
    layer: int | None = setting(None, "The layer (for --on resid: the residual index).", required=True)
    k: int = setting(20, "Contexts kept per unit (1..10000).", low=1, high=10000)
    where: str | None = setting(None, "SQL predicate over the examples table choosing the rows.", cli=False)
    on: str = setting("resid", "--kind direction: the feature kind projected.")
    direction_file: str | None = setting(
        None,
        "--kind direction: an [m, F] (or [F]) float array of directions in a .npy file, or a direction "
        "spec of dfa (probe:[STORE:]RUN:RELATION[:L[.H]], neuron:L:I, token:ID, sae:PATH:I[:enc]).",
        metavar="FILE.npy|SPEC",
        flag="--direction",
    )
    batch_rows: int = setting(1024, "Rows per read.", low=1)
    save: bool = save_setting()
    progress: bool = setting(False, "A progress bar on stderr.", cli=False)

    def __post_init__(self) -> None:
        check_settings(self)
        if self.layer is None:
            raise InvalidSetting("layer", "name the layer")
        if self.kind == "direction" and self.direction_file is None:
            raise InvalidSetting("kind", "direction needs --direction FILE.npy")
        if self.kind != "direction" and self.direction_file is not None:
            raise InvalidSetting("direction_file", "goes with --kind direction")


@dataclass(frozen=True)
class DemoConfig:
    """One ``actstore demo``: the demo corpus ingested into ``out/store``, the analyses, the report."""

    out: str = setting("demo-out", "Folder for the store and the report.")
    model: str = setting(DEFAULT_MODEL, "Model to ingest with: alias, local folder or hub name.")
    limit_per_relation: int | None = setting(None, "Fewer prompts for a quicker demo.", low=1)
    episodes: int = setting(DEMO_EPISODES, "Probe episodes per seed.", low=1)

    def __post_init__(self) -> None:
        check_settings(self)


@dataclass(frozen=True)
class DfaConfig:
    """One ``actstore dfa`` run."""

    direction: str | None = setting(
        None,
        "The direction: FILE.npy[:ROW], neuron:LAYER:INDEX (output weights; :in or :up its input "
        "weights folded with the MLP's norm, read from the store's model), token:ID (unembedding through "
        "the final norm), sae:PATH:INDEX[:dec|enc] (SAELens folder, dictionary_learning ae.pt or .npy), "
        "probe:[STORE:]RUN:RELATION[:LAYER[.HEAD]] (a probe run's weights for a relation).",
        required=True,
    )
    k: int = setting(20, "Terms kept (largest |score|).", low=1)
    layers: tuple[int, ...] | None = setting(None, "Layers decomposed (default: every layer with sources).")
    where: str | None = setting(None, "SQL predicate over the examples table choosing the rows.", cli=False)
    batch_rows: int = setting(1024, "Rows per read.", low=1)
    save: bool = save_setting()

    def __post_init__(self) -> None:
        check_settings(self)
        if self.direction is None:
            raise InvalidSetting("direction", "name the direction")
