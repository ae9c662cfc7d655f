"""The settings of the interventions: causal tracing (:mod:`actstore.interventions.tracing`),
activation patching (:mod:`~actstore.interventions.patching`) and the MAPS head ablation
(:mod:`~actstore.interventions.ablation`), torch-free so that the command line builds their
options from them (:mod:`actstore.cli._config`) without loading the model code.  Each is validated
when it is made; :meth:`TraceConfig.validate` adds what depends on the model."""

from __future__ import annotations

from dataclasses import dataclass

from actstore.core.errors import PatchError, TraceError
from actstore.core.invalid import InvalidSetting
from actstore.core.settings import check_settings, setting
from actstore.query.maps.defaults import IMPLEMENTS_THRESHOLD, MIN_PAIRS, MULTI_TOKEN

TRACE_COMPONENTS = ("resid", "mlp", "attn")  # restored by causal tracing
PATCH_COMPONENTS = ("resid", "attn", "mlp")  # patched per layer (heads apart)
POSITIONS = ("subject_last", "last")  # the named positions that align two prompts
ABLATION_MODES = ("zero", "mean")


@dataclass(frozen=True)
class TraceConfig:
    """Causal tracing.  ``skip_before_subject``: positions before the subject have IE = 0 exactly and
    are not run (``--all-positions`` runs them)."""

    samples: int = setting(3, "Noise samples per fact.")  # ROME: 10
    noise_scale: float = setting(
        3.0, "Noise std in multiples of the std of the store's subject-token embeddings.", flag="--noise"
    )
    window: int = setting(10, "Layers restored together for MLP and attention.")
    components: tuple[str, ...] = setting(
        TRACE_COMPONENTS, "Components restored (comma-separated).", choices=TRACE_COMPONENTS
    )
    skip_before_subject: bool = setting(
        True, "Also run the positions before the subject (their effect is 0).", flag="--all-positions"
    )
    seed: int = setting(0, "Seed of the noise.")
    # incremental: batch_size x longest prompt positions per forward pass
    batch_size: int = setting(64, "Corrupted copies per forward pass.")
    max_rows_per_call: int = setting(8192, "Restorations held in memory at once (several facts).", cli=False)
    incremental: bool = setting(
        True, "Restorations reuse the corrupted run (False: recompute every row in full).", cli=False
    )

    def __post_init__(self) -> None:
        check_settings(self)
        if not self.components:
            raise TraceError(f"unknown component '(none)' (one of {', '.join(TRACE_COMPONENTS)})")
        if self.samples < 1:
            raise TraceError(f"the number of noise samples must be at least 1, not {self.samples}")
        if self.noise_scale < 0:
            raise TraceError(f"the noise scale must be >= 0, not {self.noise_scale}")
        if self.window < 1:
            raise TraceError(f"the window must be at least 1 layer, not {self.window}")
        if self.batch_size < 1:
            raise TraceError("the batch size must be positive")

    def validate(self, n_layers: int) -> None:
        """What depends on the model: the window no larger than its ``n_layers``."""
        if self.window > n_layers:
            raise TraceError(
                f"the window of {self.window} layers is larger than the model ({n_layers} layers)"
            )


@dataclass(frozen=True)
class PatchConfig:
    """Activation patching: the sites patched and the batch."""

    components: tuple[str, ...] = setting(
        PATCH_COMPONENTS, "Components patched (comma-separated).", choices=PATCH_COMPONENTS
    )
    positions: tuple[str, ...] = setting(
        POSITIONS,
        "Positions patched: subject_last (the subject's last token), last (the prompt's), or both "
        "(comma-separated).",
        choices=POSITIONS,
    )
    heads: bool = setting(True, "Skip the per-head patches.")
    head_positions: tuple[str, ...] = setting(
        ("last",), "Positions of the per-head patches.", choices=POSITIONS
    )
    batch_size: int = setting(64, "Patched runs per forward pass.")
    min_denominator: float = setting(
        1e-3, "|LD_clean - LD_cf| below this: recovery undefined (NaN).", cli=False
    )

    def __post_init__(self) -> None:
        check_settings(self)
        if not self.components and not self.heads:
            raise PatchError("nothing to patch: give a component or heads")
        if self.batch_size < 1:
            raise PatchError("the batch size must be positive")


@dataclass(frozen=True)
class AblationConfig:
    """The MAPS causal check on ``relation`` (see :mod:`actstore.interventions.ablation`).
    ``controls`` None: chosen as the paper does; ``k``, ``first_mlp`` None: the authors' per relation
    (:func:`actstore.query.maps.paper_k`, :func:`~actstore.query.maps.paper_first_mlp`); ``multi_token``:
    the policy the given pair files were tokenized with (to match stored runs); ``reuse_stored``: read
    the static scores from a matching stored ``maps`` run when there is one."""

    relation: str = setting("", "Relation id whose MAPS heads are removed.", required=True)
    controls: tuple[str, ...] | None = setting(
        None,
        "Control relation (repeatable); default: chosen as in the paper among the store's relations.",
        multiple=True,
        flag="--control",
    )
    max_controls: int = setting(3, "Automatic controls: at most this many.", low=0)
    max_head_overlap: float = setting(
        0.15,
        "Automatic controls: share of RELATION's heads among a control's own top heads, below this.",
        low=0,
        high=1,
    )
    max_accuracy_gap: float = setting(
        0.2, "Automatic controls: base accuracy within this of RELATION's.", low=0
    )
    min_control_base: float = setting(
        0.0, "A control must answer some prompts (base accuracy above this).", cli=False
    )
    reuse_stored: bool = setting(
        True, "Always compute the static scores from the weights.", flag="--no-stored-scores"
    )
    k: int | None = setting(
        None,
        "Top-k for every relation (default: the authors' k per relation, 1 for copying relations, 10 "
        "otherwise).",
        low=1,
    )
    min_pairs: int = setting(
        MIN_PAIRS, "Relations with fewer usable pairs take no part (the authors' minimum).", low=0
    )
    multi_token: str = setting(
        "skip",
        "Pair files: single-token pairs only (the authors' filter), or a word's first token (ours).",
        choices=MULTI_TOKEN,
    )
    threshold: float = setting(
        IMPLEMENTS_THRESHOLD,
        "A head implements the relation when its static score is at least this.",
        low=0,
        high=1,
    )
    top_m: int | None = setting(
        None, "Remove the m best non-zero heads instead of those >= threshold.", low=1
    )
    heads: tuple[tuple[int, int], ...] | None = setting(
        None, "Explicit (layer, head) pairs removed instead of MAPS's.", cli=False
    )
    random_draws: int = setting(5, "Draws of as many random heads.")
    seed: int = setting(0, "Seed of the random draws.")
    mode: str = setting(
        "zero", "zero: z_h = 0; mean: z_h = its mean over the store's rows.", choices=ABLATION_MODES
    )
    all_positions: bool = setting(False, "Ablate at every position, not only the last prompt token.")
    where: str | None = setting(
        None, "SQL predicate over the examples table choosing the prompts.", cli=False
    )
    batch_size: int = setting(32, "Prompts per forward pass.", low=1)
    final_norm: bool = setting(True, "Static scores through the raw unembedding.")
    first_mlp: bool | None = setting(
        None,
        "Static scores through the first MLP's output (the paper's code; default on, except Llama-3.1-70B).",
    )

    def __post_init__(self) -> None:
        check_settings(self)
        if not self.relation:
            raise InvalidSetting("relation", "name the relation whose heads are removed")
