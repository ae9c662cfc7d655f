"""The settings of an ingest, torch-free so that the command line builds its options from them
(:mod:`actstore.cli._config`) without loading the model code.

:class:`IngestConfig` holds what the capture pipeline needs (:mod:`actstore.ingest.pipeline`);
:class:`IngestRequest` adds what the ``actstore ingest`` job resolves before it (the model, the data
set and its filters)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

from actstore.core.errors import InvalidSetting
from actstore.core.layout import WEIGHTS_MODES
from actstore.core.manifest import STORAGE_DTYPES
from actstore.core.settings import (
    check_settings,
    device_setting,
    model_dtype_setting,
    setting,
    threads_setting,
)

DEFAULT_MODEL = "smollm2-135m"  # the model an ingest (and the demo) runs by default
CORPUS_KINDS = ("resid", "mlp", "attn", "z")  # what --positions all can keep at every position
SOURCE_FACTOR_KINDS = ("attn_head_token", "attn_entity", "attn_prob", "v")  # target mode only


@dataclass(frozen=True)
class IngestConfig:
    """Settings of one ingest.  Everything except ``device``, ``rank``/``world_size``, ``progress`` and
    ``compact_every`` must match on ``--resume`` (they cannot change the stored bytes).

    ``length_batching``: each segment's prompts go through the model in batches of similar length
    (sorted by token count, ties in corpus order) instead of corpus order, so batches are padded
    less; the captured rows are put back in corpus order before they are written, so rows, tables
    and token layout are as without it.  The float values may differ in their last bits: on the
    CPU, torch's matmul and attention kernels give a row results that depend on the padded length
    of its batch (measured: 1-2 float32 ulps, tests/integration/ingest/test_length_batching.py), as they already
    depend on ``batch_size``.  It is therefore recorded in the manifest (when on) like the batch size.
    """

    out: str = setting(None, "Store directory or URL.", required=True)
    batch_size: int = setting(16, "Prompts per forward pass.")
    storage_dtype: str = setting(
        "float16", "Storage dtype of the captured arrays.", choices=STORAGE_DTYPES, flag="--dtype"
    )
    segment_size: int = setting(
        0,
        "Examples per commit, a multiple of --batch-size (0: 256; with --positions all, positions of "
        "about 16 MiB of stored activations, a multiple of 256, at most 16,384).",
        low=0,
    )
    chunk_rows: int = setting(
        0,
        "Rows per chunk of the per-position arrays (z, resid, mlp); 0: 32, or with --positions all "
        "about 256 KiB a chunk of the widest kept array (a power of two, 32 to the segment).",
        cli=False,
        low=0,
    )
    chunk_flat: int = setting(512, "Entries per chunk of the flat token/source arrays (attn, v).", cli=False)
    chunk_layers: int = setting(
        1,
        "Layers per chunk of the stored arrays (0: all layers in one chunk). One layer per chunk lets "
        "a query of a few layers read only their bytes.",
    )
    padding_side: str = setting(
        "right", "Side the prompts of a batch are padded on.", choices=("left", "right")
    )
    length_batching: bool = setting(
        False,
        "Run each segment's prompts through the model sorted by length (less padding; rows are "
        "stored in corpus order). Float values may differ from corpus-order batches in their last "
        "bits; recorded in the manifest, and --resume must repeat it.",
    )
    compact_every: int = setting(
        64,
        "Gather the new segments' table shards into a snapshot every N segments of a long ingest "
        "(0: only at the end). The end of an ingest always compacts the whole store.",
        low=0,
    )
    device: str = device_setting()
    weights: str = setting(
        "shared",
        "Where the model's weights go: shared (one copy per model in the user cache, $ACTSTORE_WEIGHTS_DIR; "
        "a remote store gets a copy), copy (in the store: to move or upload it), none (analyses that need "
        "weights refuse; docs/storage.md).",
        choices=WEIGHTS_MODES,
    )
    resume: bool = setting(False, "Continue an interrupted ingest from its last commit.")
    overwrite: bool = setting(False, "Replace an existing store at --out.")
    rank: int = setting(0, "This process's rank (set from torchrun's environment).", cli=False)
    world_size: int = setting(1, "Number of ranks.", cli=False)
    progress: bool = setting(True, "Progress bars on stderr.", cli=False)
    extra: dict[str, Any] = field(default_factory=dict)  # dataset spec and options, recorded in the manifest

    def __post_init__(self) -> None:
        if self.storage_dtype not in STORAGE_DTYPES:
            raise InvalidSetting(
                "storage_dtype", f"must be one of {', '.join(STORAGE_DTYPES)}, not {self.storage_dtype!r}"
            )
        check_sizes(self.batch_size, self.segment_size)
        if self.chunk_rows < 0:
            raise InvalidSetting(
                "chunk_rows", f"must be 0 (decided by the mode) or positive, not {self.chunk_rows}"
            )
        if self.chunk_layers < 0:
            raise InvalidSetting(
                "chunk_layers", f"must be 0 (all layers in one chunk) or positive, not {self.chunk_layers}"
            )
        if self.weights not in WEIGHTS_MODES:
            raise InvalidSetting(
                "weights", f"must be one of {', '.join(WEIGHTS_MODES)}, not {self.weights!r}"
            )
        if self.padding_side not in ("left", "right"):
            raise InvalidSetting("padding_side", f"must be left or right, not {self.padding_side!r}")
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise InvalidSetting(
                "rank", f"{self.rank} is not in 0..world_size-1 (world_size {self.world_size})"
            )


PROMPT_SEGMENT_SIZE = 256  # examples a segment of a prompt (target-mode) store, by default
PROMPT_CHUNK_ROWS = 32  # rows a chunk of a prompt store's z / resid / mlp, by default


def prompt_layout(cfg: IngestConfig) -> IngestConfig:
    """``cfg`` with the prompt-store defaults in place of 0 (automatic) ``segment_size`` and
    ``chunk_rows``: 256 examples a segment, 32 rows a chunk (a target's rows are read a few at a time)."""
    return replace(
        cfg,
        segment_size=cfg.segment_size or PROMPT_SEGMENT_SIZE,
        chunk_rows=cfg.chunk_rows or PROMPT_CHUNK_ROWS,
    )


def check_sizes(batch_size: int, segment_size: int) -> None:
    """A segment holds whole batches: ``segment_size`` must be a positive multiple of ``batch_size``
    (it is used as given, never rounded); 0 passes (automatic: decided by the ingest's mode)."""
    if segment_size == 0 and batch_size >= 1:
        return
    if batch_size < 1 or segment_size < 1:
        raise InvalidSetting(
            "batch_size" if batch_size < 1 else "segment_size",
            f"the batch size ({batch_size}) and the segment size ({segment_size}) must be positive",
        )
    if segment_size % batch_size:
        low = segment_size - segment_size % batch_size
        near = [m for m in (low, low + batch_size) if m > 0]
        raise InvalidSetting(
            "segment_size",
            f"{segment_size} is not a multiple of the batch size {batch_size} (a "
            f"segment holds whole batches): use {' or '.join(map(str, near))}, or a batch size "
            f"that divides {segment_size}",
        )


@dataclass(frozen=True)
class IngestRequest(IngestConfig):
    """One ``actstore ingest``: the capture settings of :class:`IngestConfig`, written once there, and
    what the job adds: the model, the data set and its filters."""

    model: str = setting(
        DEFAULT_MODEL, "Alias (smollm2-135m, gemma3-270m, tiny-llama, ...), local folder or hub name."
    )
    dataset: str = setting(
        "demo",
        "KIND:PATH (KIND in fewrel, lre, known1000, maps, jsonl), a public data set by name "
        "(fewrel, lre, known1000, maps; docs/datasets.md), or demo; with --positions all a text corpus: "
        "text:FILE (one document a line), jsonl:FILE (a text column) or hf:NAME[:SPLIT].",
    )
    relations: tuple[str, ...] | None = setting(None, "Comma-separated relation ids to keep.")
    limit_per_relation: int | None = setting(None, "At most this many prompts per relation.", low=1)
    template: str | None = setting(None, "Prompt template for maps pairs, e.g. 'The capital of {} is'.")
    keep_object_first: bool = setting(
        False, "fewrel: keep instances whose object comes before the subject (skipped by default)."
    )
    model_dtype: str = model_dtype_setting()
    threads: int = threads_setting(
        "Use 1 when other jobs share the cores: oversubscribed threads slow the forward pass several-fold."
    )

    positions: str = setting(
        "target",
        "Which positions are stored: target (one per prompt) or all (every kept token of a text corpus: "
        "--dataset text:FILE, jsonl:FILE or hf:NAME; docs/datasets.md).",
        choices=("target", "all"),
    )
    kinds: tuple[str, ...] | None = setting(
        None,
        "--positions all: what is kept at every position, of resid, mlp, attn, z (attn and z both keep "
        "z, from which attn_head and attn are exact); default all four.",
    )
    layers: tuple[int, ...] | None = setting(
        None,
        "--positions all: the layers kept (resid: residual indices, L keeping the last one); default all.",
    )
    context_length: int = setting(
        0,
        "--positions all: tokens per window the model sees (0: the model's maximum); a longer "
        "document is cut into windows, the cut recorded in the positions table.",
        low=0,
    )
    keep_special: bool = setting(
        False, "--positions all: keep BOS, EOS and other special tokens' positions (excluded by default)."
    )
    pack: bool = setting(
        False,
        "--positions all: join the documents by --pack-separator into one stream before cutting windows.",
    )
    pack_separator: str | None = setting(None, "--pack: the separator text (default the tokenizer's EOS).")
    sources: str | None = setting(
        None,
        "--positions all: keep at every position, per kept attention layer and head, the top K source "
        "positions' attention weights and positions, and V at every token (K, or all: every source of "
        "the window); attn_head_token and dfa then read them (docs/format.md).",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_positions()
        check_settings(self)
        if self.relations is not None and not self.relations:
            raise InvalidSetting(
                "relations", "no relation ids given (leave the setting out to keep every relation)"
            )

    def _check_positions(self) -> None:
        corpus_only = {
            "kinds": self.kinds is not None,
            "layers": self.layers is not None,
            "context_length": self.context_length != 0,
            "keep_special": self.keep_special,
            "pack": self.pack,
            "pack_separator": self.pack_separator is not None,
            "sources": self.sources is not None,
        }
        if self.positions != "all":
            given = [k for k, v in corpus_only.items() if v]
            if given:
                raise InvalidSetting(given[0], "applies to --positions all only")
            return
        for kind in self.kinds or ():
            if kind in SOURCE_FACTOR_KINDS:
                raise InvalidSetting(
                    "kinds",
                    f"{kind} needs the per-source factors, which only --positions target stores (a corpus "
                    f"store keeps {', '.join(CORPUS_KINDS)})",
                )
            if kind not in CORPUS_KINDS:
                raise InvalidSetting("kinds", f"{kind!r} is not one of {', '.join(CORPUS_KINDS)}")
        if self.kinds is not None and not self.kinds:
            raise InvalidSetting("kinds", f"no kind given (one or more of {', '.join(CORPUS_KINDS)})")
        if self.layers is not None and (not self.layers or min(self.layers) < 0):
            raise InvalidSetting("layers", "give layer numbers 0 and above")
        if (
            self.sources is not None
            and self.sources != "all"
            and not (self.sources.isdigit() and int(self.sources) >= 1)
        ):
            raise InvalidSetting(
                "sources", f"give a number of sources (1 or more) or all, not {self.sources!r}"
            )
        if self.pack_separator is not None and not self.pack:
            raise InvalidSetting("pack_separator", "applies to --pack only")
        if self.relations is not None or self.limit_per_relation is not None or self.template is not None:
            raise InvalidSetting("positions", "a text corpus has no relations or templates (--positions all)")
        if self.length_batching:
            raise InvalidSetting("length_batching", "applies to --positions target only")
        if self.padding_side != "right":
            raise InvalidSetting("padding_side", "--positions all pads on the right")

    def capture_config(self, out: str, extra: dict[str, object]) -> IngestConfig:
        """The pipeline's settings: this request's IngestConfig fields, with ``out`` and ``extra`` replaced."""
        own = {f.name: getattr(self, f.name) for f in fields(IngestConfig)}
        return IngestConfig(**(own | {"out": out, "extra": extra}))
