"""Comparing interpretability methods on factual recall (the ACL 2025 comparison of methods for factual recall).

Every method reads each fact as a per-layer effect profile over the decoder layers 0..L-1 and
names a *key layer* and an *MLP-vs-attention verdict*.  Our definitions (the paper leaves them
open):

    trace        causal tracing (``trace_effects``): mlp[l] = max over positions of the windowed-MLP
                 indirect effect, attn[l] likewise; profile = max(mlp, attn); key = peak of the
                 profile (below); verdict = the component with the larger peak.
    patch        activation patching (``patch_effects``): mlp[l], attn[l] = max over the patched
                 positions of the logit-difference recovery of layer l's MLP / attention output;
                 profile, key and verdict as for tracing.
    logit_lens   object probability read through the final norm and unembedding at each residual
                 index; profile[l] = p(after layer l) - p(before layer l); key = argmax profile;
                 verdict: split the layer's step into attention (p(h_l + attn_l) - p(h_l)) and MLP
                 (p(h_{l+1}) - p(h_l + attn_l)) at the key layer, larger wins.
    tuned_lens   the same through the tuned lens (translator of index l for h_l and h_l + attn_l),
                 fit on the store's facts that are not compared (:func:`tuned_lens_reading`):
                 by default trained with Adam on the KL to the model's output (Belrose et al.;
                 ``COMPARISON_TRAIN``: 250 steps of 64 facts), or ``sgd``, or the ridge fit.
    probe        a multinomial logistic probe per residual index predicting the object among the
                 store's frequent objects, cross-validated (each fact read by probes that did not
                 train on it); profile[l] = step of p(true object); key = argmax; verdict: the
                 probe of index key+1 is linear, so attn_key and mlp_key each add w_true - mean
                 w_other times their output to the true object's margin; larger wins.
    attention    attention attribution from the store: mass[l, h] = attention of the last token
                 to the subject tokens; profile[l] = max_h mass; key = argmax; verdict: "attn" when
                 the subject-sourced attention write (attn_entity summed over heads) at the key
                 layer is larger in norm than the MLP output there, else "mlp".

The verdicts that split a residual step into its attention and MLP parts need the two outputs to
add up to the step (Llama, Qwen, GPT-2, GPT-NeoX); for models that normalise a sublayer's output
before adding it (Gemma 3) the store's outputs do not, and those verdicts are left undefined.

Key layer = the middle of the contiguous run of layers around the profile's maximum whose values
are at least ``plateau`` (0.9) times it.  A restoration window of w layers smears one decisive
layer over a plateau of about w layers (every window containing it restores it); the middle of the
plateau undoes that, while for a single sharp peak it is the argmax.  ``plateau`` = 1 is the plain
argmax.

Agreement over facts where both methods are defined: key layers agree when they differ by at most
``tolerance`` layers (default max(1, round(L/10))); verdicts agree when equal; profiles are
compared by the Pearson correlation per fact, averaged.  Consensus: the share of facts, among
those every method reads, whose key layers all lie within ``tolerance`` of each other.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from actstore.core.errors import MethodsError
from actstore.query.analyses.corpus_lens import load_corpus_lens
from actstore.query.analyses.lens import (
    FinalReadout,
    fit_tuned_lens,
    read_objects,
    stored_residuals,
)
from actstore.query.analyses.lens_methods import CORPUS_PREFIX, check_tuned_method
from actstore.query.analyses.tuned_lens import TrainConfig
from actstore.query.methods.defaults import COMPARISON_BATCH, COMPARISON_STEPS, PLATEAU
from actstore.query.select.rows import Rows, rows_condition
from actstore.query.select.selection import Selection

SEED_001 = {  # the paper's agreement table (GPT-2): key layer %, MLP/attn %, effect correlation
    ("trace", "patch"): (82.5, 76.3, 0.84),
    ("trace", "probe"): (68.2, 61.5, 0.67),
    ("patch", "logit_lens"): (74.8, 69.2, 0.73),
    ("probe", "attention"): (55.3, 48.7, 0.52),
}
SEED_001_CONSENSUS = 47.6


@dataclass
class MethodReading:
    """One method's reading of facts: per-layer profiles, key layers and verdicts."""

    method: str
    example_ids: np.ndarray  # [n]
    profile: np.ndarray  # [n, L]
    key_layer: np.ndarray  # [n] int, -1 when undefined
    verdict: np.ndarray  # [n] "mlp" | "attn" | "" (undefined)
    mlp: np.ndarray | None = None  # [n, L] component profiles where the method has them
    attn: np.ndarray | None = None
    info: dict[str, Any] = field(default_factory=dict)  # how the reading was made (tuned lens: its fit)

    def table(self) -> pa.Table:
        return pa.table(
            {
                "example_id": pa.array(self.example_ids, pa.int64()),
                "method": pa.array([self.method] * len(self.example_ids), pa.string()),
                "key_layer": pa.array(self.key_layer, pa.int32()),
                "verdict": pa.array(self.verdict.tolist(), pa.string()),
                "profile": pa.array(
                    [[None if not np.isfinite(v) else float(v) for v in p] for p in self.profile],
                    pa.list_(pa.float64()),
                ),
            }
        )


def key_layer(profile: np.ndarray, plateau: float = PLATEAU) -> int:
    """The middle of the run of layers around the maximum of ``profile`` within ``plateau`` of it
    (-1 when the profile is undefined); see the module docstring."""
    q = np.where(np.isfinite(profile), profile, -np.inf)
    if not np.isfinite(q).any():
        return -1
    k = int(np.argmax(q))
    top = q[k]
    if top <= 0 or plateau >= 1:
        return k
    lo, hi = k, k
    while lo > 0 and q[lo - 1] >= plateau * top:
        lo -= 1
    while hi < q.size - 1 and q[hi + 1] >= plateau * top:
        hi += 1
    return (lo + hi) // 2


def key_layers(profile: np.ndarray, plateau: float) -> np.ndarray:
    return np.asarray([key_layer(p, plateau) for p in profile], dtype=np.int64)


def _from_components(
    method: str, ids: np.ndarray, mlp: np.ndarray, attn: np.ndarray, plateau: float = PLATEAU
) -> MethodReading:
    profile = np.fmax(mlp, attn)
    ok = np.isfinite(profile).any(axis=1)
    key = key_layers(profile, plateau)
    verdict = np.where(np.fmax.reduce(mlp, axis=1) >= np.fmax.reduce(attn, axis=1), "mlp", "attn")
    verdict = np.where(ok, verdict, "")
    return MethodReading(method, ids, profile, key.astype(np.int64), verdict.astype(object), mlp, attn)


def _key_and_split(
    method: str,
    ids: np.ndarray,
    profile: np.ndarray,
    d_attn: np.ndarray | None,
    d_mlp: np.ndarray | None,
    plateau: float = PLATEAU,
) -> MethodReading:
    key = key_layers(profile, plateau)
    rows = np.arange(len(ids))
    if d_attn is None or d_mlp is None:
        verdict = np.array([""] * len(ids), dtype=object)
    else:
        verdict = np.where(d_mlp[rows, key] >= d_attn[rows, key], "mlp", "attn").astype(object)
    return MethodReading(method, ids, profile, key.astype(np.int64), verdict, d_mlp, d_attn)


# ------------------------------------------------------------------------------------ from result tables


def fact_ids(store: Any, rows: Rows | None = None, correct_only: bool = False) -> np.ndarray:
    """Example ids (sorted, int64) of the store's facts: prompts with an object token, optionally only
    those the model answers (``object_rank = 0``) and those of ``rows`` (all when None)."""
    cond, params = rows_condition(rows, "e.example_id")
    conds = ["t.object_token_id >= 0", cond] + (["t.object_rank = 0"] if correct_only else [])
    q = f"SELECT e.example_id FROM examples e JOIN targets t USING (example_id) WHERE {' AND '.join(conds)} ORDER BY 1"
    return np.asarray(store.sql(q, params).column("example_id").to_pylist(), dtype=np.int64)


def latest_run(store: Any, table: str, run_id: str | None = None) -> str:
    """``run_id`` if it is in ``table``, else the newest run there."""
    if table not in store.table_files():
        raise MethodsError(f"{store.url}: no {table} table (run 'actstore {table.split('_')[0]}' first)")
    runs = store.sql(f"SELECT DISTINCT run_id FROM {table} ORDER BY run_id").column("run_id").to_pylist()
    if not runs:
        raise MethodsError(f"{store.url}: the {table} table is empty")
    if run_id is None:
        return str(runs[-1])
    if run_id not in runs:
        raise MethodsError(f"{store.url}: no run {run_id!r} in {table} (have {', '.join(runs)})")
    return run_id


def _component_grid(
    store: Any, table: str, run_id: str, comp: str, extra: str = ""
) -> tuple[np.ndarray, np.ndarray]:
    t = store.sql(
        f"""SELECT example_id, layer, max(CASE WHEN isnan({
            "recovery" if table == "patch_effects" else "indirect_effect"
        }) THEN NULL ELSE {"recovery" if table == "patch_effects" else "indirect_effect"} END) AS v
                      FROM {table} WHERE run_id = ? AND component = ? {extra}
                      GROUP BY example_id, layer ORDER BY example_id, layer""",
        [run_id, comp],
    ).to_pandas()
    if t.empty:
        raise MethodsError(f"{store.url}: run {run_id} of {table} has no {comp!r} effects")
    grid = t.pivot(index="example_id", columns="layer", values="v")
    return grid.index.to_numpy(np.int64), grid.to_numpy(np.float64)


def trace_reading(store: Any, run_id: str | None = None, plateau: float = PLATEAU) -> MethodReading:
    run = latest_run(store, "trace_effects", run_id)
    ids, mlp = _component_grid(store, "trace_effects", run, "mlp")
    ids2, attn = _component_grid(store, "trace_effects", run, "attn")
    if not np.array_equal(ids, ids2):
        raise MethodsError(f"run {run}: mlp and attn traces cover different facts")
    return _from_components("trace", ids, mlp, attn, plateau)


PATCH_POSITIONS = ("subject_last", "last")  # the positions patching records (ingest's patching.POSITIONS)


def patch_reading(
    store: Any, run_id: str | None = None, plateau: float = PLATEAU, position: str | None = None
) -> MethodReading:
    """Patching's reading: per layer the largest recovery over the patched positions, or, with
    ``position`` (``subject_last`` or ``last``), the recovery at that position alone."""
    run = latest_run(store, "patch_effects", run_id)
    extra = "AND head = -1"
    if position is not None:
        if position not in PATCH_POSITIONS:
            raise MethodsError(f"unknown patch position {position!r} (one of {', '.join(PATCH_POSITIONS)})")
        extra += f" AND position = '{position}'"
    ids, mlp = _component_grid(store, "patch_effects", run, "mlp", extra)
    ids2, attn = _component_grid(store, "patch_effects", run, "attn", extra)
    if not np.array_equal(ids, ids2):
        raise MethodsError(f"run {run}: mlp and attn patches cover different facts")
    return _from_components("patch", ids, mlp, attn, plateau)


# ------------------------------------------------------------------------------------ from the store


@dataclass
class StoredOutputs:
    """The stored states of facts at their last token: resid [n, L+1, d], attn and mlp [n, L, d]."""

    example_ids: np.ndarray
    resid: np.ndarray
    attn: np.ndarray
    mlp: np.ndarray
    objects: np.ndarray

    @property
    def additive(self) -> bool:
        """Whether attn + mlp outputs add up to each residual step (false for post-normed sublayers)."""
        step = self.resid[:, 1:] - self.resid[:, :-1]
        err = np.linalg.norm(step - self.attn - self.mlp, axis=-1) / (np.linalg.norm(step, axis=-1) + 1e-6)
        return bool(np.median(err) < 0.05)


def stored_outputs(store: Any, example_ids: Sequence[int] | np.ndarray) -> StoredOutputs:

    ids = np.asarray(example_ids, dtype=np.int64)
    resid, obj, _ = stored_residuals(store, ids)
    sel = Selection.from_ids(store, ids.tolist())
    order = np.searchsorted(sel.example_ids, ids)
    return StoredOutputs(ids, resid, sel.features("attn")[order], sel.features("mlp")[order], obj)


def lens_reading(
    store: Any, out: StoredOutputs, tuned: Any = None, plateau: float = PLATEAU
) -> MethodReading:
    """Logit lens (``tuned`` None) or tuned lens reading of the facts in ``out``."""

    readout = FinalReadout.from_store(store)
    resid = torch.as_tensor(out.resid)
    mid = resid[:, :-1] + torch.as_tensor(out.attn)  # after attention, before the MLP of each layer
    if tuned is not None:
        resid = tuned.translate(resid)
        L = mid.shape[1]
        mid = torch.stack([tuned.translate_index(mid[:, i], i) for i in range(L)], dim=1)
    p = read_objects(readout, resid, out.objects).prob  # [n, L+1]
    profile = p[:, 1:] - p[:, :-1]
    if out.additive:
        pm = read_objects(readout, mid, out.objects).prob  # [n, L]
        d_attn, d_mlp = pm - p[:, :-1], p[:, 1:] - pm
    else:
        d_attn = d_mlp = None
    return _key_and_split(
        "tuned_lens" if tuned is not None else "logit_lens", out.example_ids, profile, d_attn, d_mlp, plateau
    )


# The comparison's tuned-lens training (see actstore.query.methods.defaults); the rest as the tuned-lens package.
COMPARISON_TRAIN = TrainConfig(steps=COMPARISON_STEPS, batch=COMPARISON_BATCH)
TUNED_LABEL = "tuned lens ({})"  # how outputs name the tuned_lens method with its fitting rule


def tuned_lens_reading(
    store: Any,
    out: StoredOutputs,
    method: str = "adam",
    config: TrainConfig | None = None,
    plateau: float = PLATEAU,
    progress: Callable[[int, float], None] | None = None,
) -> MethodReading:
    """The tuned lens's reading of ``out``'s facts, its translators fit by ``method`` (``adam``,
    ``sgd``: trained on the KL with ``config``, default ``COMPARISON_TRAIN``; ``ridge``: the
    closed-form fit) on every other fact of the store that has an object token.  ``reading.info``
    records the method, the configuration, the training facts and the seconds; ``progress(step,
    loss)`` as in :func:`actstore.query.analyses.tuned_lens.train_tuned_lens`."""

    check_tuned_method(method)
    if method.startswith(CORPUS_PREFIX):
        return corpus_tuned_reading(store, out, method, plateau)
    train = np.setdiff1d(fact_ids(store, None, correct_only=False), out.example_ids)
    if train.size < 5:
        raise MethodsError(
            f"{store.url}: only {train.size} facts outside the compared ones to train the tuned "
            "lens (ingest more facts, or leave tuned_lens out of the methods)"
        )
    lens = fit_tuned_lens(store, train, method, config or COMPARISON_TRAIN, progress=progress)
    reading = lens_reading(store, out, lens, plateau)
    reading.info = {
        "method": method,
        "label": TUNED_LABEL.format(method),
        "config": lens.info["config"],
        "train_facts": int(train.size),
        "seconds": lens.info["seconds"],
        **{k: lens.info[k] for k in ("loss_first", "loss_last") if k in lens.info},
    }
    return reading


def corpus_tuned_reading(
    store: Any, out: StoredOutputs, spec: str, plateau: float = PLATEAU
) -> MethodReading:
    """The tuned lens's reading of ``out``'s facts through translators a corpus-lens run stored
    (``spec``: ``corpus:STORE[#RUN]``, :func:`actstore.query.analyses.corpus_lens.load_corpus_lens`): trained
    on every position of a text corpus, as Belrose et al. train it, not on this store's facts."""
    started = time.time()
    lens = load_corpus_lens(spec, store)
    reading = lens_reading(store, out, lens, plateau)
    config = lens.info.get("config") or {}
    reading.info = {
        "method": "corpus",
        "label": TUNED_LABEL.format("corpus"),
        "source": lens.info["source"],
        "run_id": lens.info["run_id"],
        "config": config.get("train"),
        "train_facts": 0,
        "train_positions": config.get("train_rows"),
        "seconds": round(time.time() - started, 2),
    }
    return reading


def attention_reading(store: Any, out: StoredOutputs, plateau: float = PLATEAU) -> MethodReading:
    """Attention from the last token to the subject tokens per layer and head (``attn_prob``)."""

    sel = Selection.from_ids(store, out.example_ids.tolist())
    order = np.searchsorted(sel.example_ids, out.example_ids)
    A = sel.features("attn_prob")[order]  # [n, L, H, S]
    ent = sel.features("attn_entity")[order].sum(axis=2)  # [n, L, d]
    rows = sel.rows.to_pandas().set_index("example_id").loc[out.example_ids]
    s0, s1 = rows["subject_start"].to_numpy(), rows["subject_end"].to_numpy()
    if (s0 < 0).any():
        bad = out.example_ids[s0 < 0][0]
        raise MethodsError(f"fact {bad}: its subject is not in its prompt")
    S = A.shape[-1]
    j = np.arange(S)
    mask = ((j[None] >= s0[:, None]) & (j[None] < s1[:, None])).astype(np.float32)  # [n, S]
    mass = np.einsum("nlhs,ns->nlh", A, mask)
    profile = mass.max(axis=2)
    key = key_layers(profile, plateau)
    r = np.arange(len(key))
    verdict = np.where(
        np.linalg.norm(ent[r, key], axis=-1) >= np.linalg.norm(out.mlp[r, key], axis=-1), "attn", "mlp"
    ).astype(object)
    return MethodReading("attention", out.example_ids, profile, key.astype(np.int64), verdict)


# ------------------------------------------------------------------------------------ probes


# ------------------------------------------------------------------------------------ agreement


def key_mlp_at_subject(store: Any, run_id: str | None = None) -> np.ndarray:
    """Per traced fact, the layer whose windowed-MLP restoration at the subject's last token has the
    largest indirect effect (ROME's decisive MLP site), as a fraction of the depth."""
    run = latest_run(store, "trace_effects", run_id)
    t = store.sql(
        """SELECT e.example_id, e.layer, e.indirect_effect AS ie FROM trace_effects e
                      JOIN trace_facts f ON f.run_id = e.run_id AND f.example_id = e.example_id
                      WHERE e.run_id = ? AND e.component = 'mlp' AND e.position = f.subject_end - 1
                      ORDER BY 1, 2""",
        [run],
    ).to_pandas()
    if t.empty:
        return np.zeros(0)
    grid = t.pivot(index="example_id", columns="layer", values="ie").to_numpy()
    return np.argmax(grid, axis=1) / max(1, grid.shape[1] - 1)


def _spread(rel: np.ndarray) -> dict[str, float] | None:
    if rel.size == 0:
        return None
    return {
        "median": float(np.median(rel)),
        "q25": float(np.quantile(rel, 0.25)),
        "q75": float(np.quantile(rel, 0.75)),
        "mean": float(rel.mean()),
    }


def causal_shares(
    trace: MethodReading, patch: MethodReading | None, n_layers: int, subject_site: np.ndarray | None = None
) -> dict[str, Any]:
    """MLP vs attention share of the causal effect, and where the key MLP layers sit (relative depth).

    Tracing: per fact, peak windowed-MLP effect / (peak MLP + peak attention effect), positive parts.
    Patching: per fact, sum over layers of positive MLP recovery / (that + attention's).
    Key MLP layer, as a fraction of the depth (layer / (L - 1)): at the subject's last token
    (``subject_site``, from :func:`key_mlp_at_subject`; ROME's site), and over all positions
    (argmax of the tracing MLP profile).
    """
    out: dict[str, Any] = {}
    assert trace.mlp is not None and trace.attn is not None
    pm = np.clip(np.nanmax(trace.mlp, axis=1), 0, None)
    pa_ = np.clip(np.nanmax(trace.attn, axis=1), 0, None)
    ok = (pm + pa_) > 0
    out["trace_mlp_share"] = float(np.mean(pm[ok] / (pm[ok] + pa_[ok]))) if ok.any() else None
    out["trace_facts"] = int(ok.sum())
    if patch is not None and patch.mlp is not None and patch.attn is not None:
        sm = np.nansum(np.clip(patch.mlp, 0, None), axis=1)
        sa = np.nansum(np.clip(patch.attn, 0, None), axis=1)
        okp = (sm + sa) > 0
        out["patch_mlp_share"] = float(np.mean(sm[okp] / (sm[okp] + sa[okp]))) if okp.any() else None
        out["patch_facts"] = int(okp.sum())
    rel = np.nanargmax(np.where(np.isfinite(trace.mlp), trace.mlp, -np.inf), axis=1) / max(1, n_layers - 1)
    out["key_mlp_layer_relative"] = _spread(rel)
    out["key_mlp_layer_relative_subject_last"] = _spread(
        np.zeros(0) if subject_site is None else subject_site
    )
    return out


def common_keys(readings: Sequence[MethodReading]) -> tuple[np.ndarray, np.ndarray]:
    """The facts every reading reads (sorted example ids) and each reading's key layers of them: [m, n]."""
    common = functools.reduce(np.intersect1d, [r.example_ids for r in readings])
    return common, np.stack([r.key_layer[np.searchsorted(r.example_ids, common)] for r in readings])
