"""The settings of MAPS, torch-free so that the command line builds its options from them without
loading the scores: the fields every MAPS command shares, each written once (:func:`k_setting`,
:func:`threshold_setting`, :func:`multi_token_setting`, :func:`min_pairs_setting`, defaulting to
:mod:`actstore.query.maps.defaults`), and the settings of the MAPS causal check,
:class:`AblationConfig` (``actstore ablate``; used by :mod:`actstore.interventions.ablation`, so it
lives on a floor below the interventions)."""

from __future__ import annotations

from dataclasses import dataclass

from actstore.core.errors import InvalidSetting
from actstore.core.settings import check_settings, setting
from actstore.query.maps.defaults import IMPLEMENTS_THRESHOLD, MIN_PAIRS, MULTI_TOKEN

ABLATION_MODES = ("zero", "mean")
K_HELP = (
    "Top-k of a source's row that counts as a hit, for every relation.  Default: the authors' k per relation "
    "(1 for copying relations, 10 otherwise; Llama-3: 3 and 25)."
)


def k_setting() -> int | None:
    """``k`` of a MAPS run (a dataclass field); None: the authors' k per relation."""
    return setting(None, K_HELP, low=1)


def threshold_setting() -> float:
    """``threshold`` of a MAPS run (a dataclass field)."""
    return setting(
        IMPLEMENTS_THRESHOLD, "A head implements R when its score is at least this.", low=0, high=1
    )


def multi_token_setting(help: str) -> str:
    """``multi_token`` of a MAPS run: the authors' single-token filter (``skip``) or a word's first
    token; ``help`` says what it applies to in the command."""
    return setting("skip", help, choices=MULTI_TOKEN)


def min_pairs_setting(help: str) -> int:
    """``min_pairs`` of a MAPS run: the authors' minimum of usable pairs a relation needs."""
    return setting(MIN_PAIRS, help, low=0)


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
    k: int | None = k_setting()
    min_pairs: int = min_pairs_setting(
        "Relations with fewer usable pairs take no part (the authors' minimum)."
    )
    multi_token: str = multi_token_setting(
        "Pair files: single-token pairs only (the authors' filter), or a word's first token (ours)."
    )
    threshold: float = threshold_setting()
    top_m: int | None = setting(
        None, "Remove the m best non-zero heads instead of those >= threshold.", low=1
    )
    heads: tuple[tuple[int, int], ...] | None = setting(
        None, "Explicit (layer, head) pairs removed instead of MAPS's.", cli=False
    )
    random_draws: int = setting(5, "Draws of as many random heads.", low=0)
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
