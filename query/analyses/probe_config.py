"""The settings of a probe run, torch-free so that the command line builds its options from them
(:mod:`actstore.cli._config`) without loading the analysis."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from actstore.core.errors import InvalidSetting
from actstore.core.settings import check_settings, setting, threads_setting

PROBE_KINDS = ("attn_head", "attn", "attn_entity", "mlp", "mlp_group", "resid", "z")
# dW for HeadScore/TokenScore (actstore.query.analyses.attribution): "renormalised" (ours) or "seed"
CONTRASTS = ("renormalised", "seed")
DEFAULT_CONTRAST = "renormalised"


@dataclass(frozen=True)
class ProbeConfig:
    """The settings of one probe run (each field's help is the command line's)."""

    kind: str = setting(
        "attn_head",
        "Feature kind: attn_head, attn, attn_entity, mlp, mlp_group, resid or z.",
        choices=PROBE_KINDS,
    )
    where: str | None = setting(None, "SQL predicate over the examples table choosing the rows.", cli=False)
    layers: tuple[int, ...] | None = setting(
        None, "Layer subset, e.g. 0,3,5-7 (resid: residual indices; default: all).", low=0
    )
    heads: tuple[int, ...] | None = setting(
        None, "Head (or mlp_group group) subset, e.g. 0-3 (default: all).", low=0
    )
    groups: int | None = setting(None, "mlp_group: number of neuron groups (default: heads).", low=1)
    n_way: int = setting(5, "Classes (relations) per episode.", low=2)
    k_shot: int = setting(5, "Support examples per class.", low=1)
    queries: int = setting(5, "Queries per class.", low=1)
    episodes: int = setting(500, "Episodes per seed.", low=1)
    seeds: tuple[int, ...] = setting((0, 1, 2, 3, 4), "Seeds of the episode samplers.", low=0, cli=False)
    top_k: int = setting(3000, "RelSpec features per relation.", low=1)
    epochs: int = setting(200, "Training epochs per episode.", low=1)
    lr: float = setting(1e-3, "Adam learning rate.", above=0)
    feature_dtype: str = setting(
        "float32", "In-memory feature matrix dtype (float16 halves memory).", choices=("float32", "float16")
    )
    token_scores: str = setting(
        "errors",
        "Which predictions get TokenScores stored (kinds with per-source factors only).",
        choices=("errors", "all", "none"),
    )
    memory_mb: int = setting(1024, "Working-memory budget per chunk (MB).", low=1)
    threads: int = threads_setting(
        "Use 1 when other jobs share the cores (1 is fastest on a shared machine)."
    )
    train_batch: int = setting(2, "Episodes per training tensor problem (1-2 is fastest on a CPU).", low=1)
    relspec: bool = setting(
        True, "Baseline without RelSpec: every feature, the same standardisation and training."
    )
    store_weights: bool = setting(
        True,
        "Keep the episodes' trained probes out of the store (by default each is stored in the probe_weights "
        "table: selected features, support mean and std, weights, bias, 32 bytes per selected feature, about "
        "0.5 MB per 5-way SmolLM2 attn_head episode; an explanation reads it instead of training again).",
    )
    contrast: str = setting(
        DEFAULT_CONTRAST,
        "dW for HeadScore/TokenScore: competitors weighted by the softmax renormalised over them (ours) "
        "or by the full softmax (as written in Tracing Relational Knowledge Recall in Large Language Models, "
        "arXiv 2604.19934).",
        choices=CONTRASTS,
    )

    def __post_init__(self) -> None:
        check_settings(self)
        if not self.seeds:
            raise InvalidSetting("seeds", "give at least one seed")

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ProbeConfig:
        d = json.loads(text)
        for k in ("layers", "heads", "seeds"):
            if d.get(k) is not None:
                d[k] = tuple(d[k])
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})
