"""Key-layer readings on one scale: variants read from the stored trace, patch and lens runs.

The readings of :mod:`actstore.query.methods.readings` name key layers on different scales: the trace key is
the *label* of a restoration window, patching's key the larger of two positions, the lens key the
layer where P(object) jumps.  These variants read the same stored runs differently (all ours):

    trace@centre   the centre block of the trace key's window.  Tracing restores, for label l, the
                   blocks ``max(0, l - w//2) .. min(L, l + ceil(w/2)) - 1`` (ROME's window,
                   ``TraceConfig.window`` = w).  For an odd w that range is symmetric and its centre
                   is l itself away from the edges; for the stored runs' w = 10 it is l-5 .. l+4,
                   whose centre l - 0.5 is between two blocks: the reading takes the lower middle
                   block, ``(lo + hi) // 2`` = l - 1, so it is biased by -0.5 block against the
                   true centre (at the edges the clipped window's centre: label 0 -> block 2).
                   Single-block restorations (w = 1, the ACL 2025 method study's "precision down to layer") need new
                   trace runs (``TraceConfig(window=1)``); for them label = centre.
    patch@subject_last, patch@last   patching's profile at one position only (the recovery of
                   patching layer l's MLP / attention output at the subject's last token, or at the
                   last token), key and verdict as before (plateau middle; the component with the
                   larger peak).  The stored reading ``patch`` is the max over both positions (a
                   third reading, kept), which is bimodal: 0 (subject) or late (last token).
    LENS@top10     the first block l whose output h_{l+1} puts the object in the lens's top 10
                   (rank < 10); -1 if none does.
    LENS@half      the first block l whose output h_{l+1} gives the object at least half of p_clean
                   (P at the last index L, the model's own output for the logit lens); -1 if none.
                   Both vary per fact where "where P jumps" (the argmax step) is nearly always the
                   last block.  LENS = logit_lens, or tuned_lens through its translators.

A variant keeps its method's verdict rule: trace and patch verdicts do not depend on the key; a
lens variant splits the residual step at its own key (undefined where the sublayers do not add
up, as on Gemma 3).

:func:`window_contains` is the share of facts whose other key lies inside the trace key's window
(the reading ROME's window suggests: "the window restores the site").
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import torch

from actstore.core.errors import MethodsError
from actstore.query.analyses.lens import FinalReadout, read_objects
from actstore.query.methods.defaults import PLATEAU
from actstore.query.methods.metrics import concat_readings
from actstore.query.methods.readings import PATCH_POSITIONS, MethodReading, StoredOutputs, patch_reading

TOP_K = 10
FRACTION = 0.5


# ------------------------------------------------------------------------------------ tracing


def window_range(label: int, window: int, n_layers: int) -> tuple[int, int]:
    """(first, last) block restored for trace label ``label`` (inclusive), as ROME's window."""
    return max(0, label - window // 2), min(n_layers, label - (-window // 2)) - 1


def centre_keys(keys: np.ndarray, window: int, n_layers: int) -> np.ndarray:
    """Per fact, the centre block (lower middle for an even window) of the window of its trace key;
    -1 stays -1."""
    out = np.full(keys.shape, -1, np.int64)
    for i, k in enumerate(keys):
        if k >= 0:
            lo, hi = window_range(int(k), window, n_layers)
            out[i] = (lo + hi) // 2
    return out


def trace_centre_reading(trace: MethodReading, window: int, n_layers: int) -> MethodReading:
    """``trace`` with its key layers moved to their windows' centres (method ``trace@centre``)."""
    return replace(trace, method="trace@centre", key_layer=centre_keys(trace.key_layer, window, n_layers))


def trace_window(store: Any, runs: list[str] | tuple[str, ...]) -> int:
    """The restoration window of the trace runs (one value; an error if they differ)."""
    if not runs:
        raise MethodsError("no trace runs named")
    got = (
        store.sql(
            'SELECT DISTINCT "window" AS w FROM trace_facts WHERE list_contains($runs, run_id)',
            {"runs": list(runs)},
        )
        .column("w")
        .to_pylist()
    )
    if len(got) != 1:
        raise MethodsError(f"the trace runs have windows {sorted(got)}; read runs of one window")
    return int(got[0])


def window_kernel(window: int, n_layers: int) -> np.ndarray:
    """W[k, j] = 1 when block j lies in the window of trace label k: the agreement kernel of
    ``in_trace_window`` for :func:`actstore.query.methods.chance.coded_chance`.  [L, L] float."""
    W = np.zeros((n_layers, n_layers))
    for k in range(n_layers):
        lo, hi = window_range(k, window, n_layers)
        W[k, lo : hi + 1] = 1.0
    return W


def window_contains(
    trace: MethodReading, other: MethodReading, window: int, n_layers: int
) -> tuple[np.ndarray, np.ndarray]:
    """(fact ids, 1.0 where ``other``'s key lies in the window of the trace key, else 0.0) over the
    facts both read with a key layer."""
    common = np.intersect1d(trace.example_ids, other.example_ids)
    kt = trace.key_layer[np.searchsorted(trace.example_ids, common)]
    ko = other.key_layer[np.searchsorted(other.example_ids, common)]
    ok = (kt >= 0) & (ko >= 0)
    inside = np.asarray(
        [
            window_range(int(a), window, n_layers)[0] <= b <= window_range(int(a), window, n_layers)[1]
            for a, b in zip(kt[ok], ko[ok])
        ],
        dtype=np.float64,
    )
    return common[ok], inside


# ------------------------------------------------------------------------------------ patching


def patch_position_readings(
    store: Any, runs: list[str] | tuple[str, ...], plateau: float = PLATEAU
) -> dict[str, MethodReading]:
    """``patch@subject_last`` and ``patch@last`` over the patch runs (joined as the study joins them)."""

    out = {}
    named: list[str | None] = list(runs) or [None]  # none named: the newest run
    for pos in PATCH_POSITIONS:
        r = concat_readings([patch_reading(store, run, plateau, position=pos) for run in named])
        out[f"patch@{pos}"] = replace(r, method=f"patch@{pos}")
    return out


# ------------------------------------------------------------------------------------ lenses


def lens_keys(
    prob: np.ndarray, rank: np.ndarray, top_k: int = TOP_K, fraction: float = FRACTION
) -> dict[str, np.ndarray]:
    """``top10`` and ``half`` keys (see the module docstring) from the lens's object probability and
    rank at every residual index, ``prob``/``rank`` [n, L+1] (index 0 = the embeddings)."""

    def first(hit: np.ndarray) -> np.ndarray:  # [n, L] -> first True block, -1 if none
        return np.where(hit.any(axis=1), np.argmax(hit, axis=1), -1).astype(np.int64)

    p_clean = prob[:, -1:]
    return {
        f"top{top_k}": first(rank[:, 1:] < top_k),
        "half": first(prob[:, 1:] >= fraction * p_clean),
    }


def rekey(reading: MethodReading, keys: np.ndarray, method: str) -> MethodReading:
    """``reading`` with other key layers; a lens reading's verdict is split again at the new key
    (where it has component steps), any other method keeps its verdicts."""
    verdict = reading.verdict
    if reading.method in ("logit_lens", "tuned_lens"):
        if reading.mlp is None or reading.attn is None:
            verdict = np.array([""] * len(keys), dtype=object)
        else:
            rows = np.arange(len(keys))
            k = np.maximum(keys, 0)
            verdict = np.where(reading.mlp[rows, k] >= reading.attn[rows, k], "mlp", "attn").astype(object)
            verdict = np.where(keys >= 0, verdict, "").astype(object)
    return replace(reading, method=method, key_layer=np.asarray(keys, np.int64), verdict=verdict)


def lens_variant_readings(
    store: Any, out: StoredOutputs, base: MethodReading, tuned: Any = None
) -> dict[str, MethodReading]:
    """``LENS@top10`` and ``LENS@half`` of the facts in ``out`` (in ``base``'s order: ``base`` is
    the lens's reading of ``out``, :func:`actstore.query.methods.readings.lens_reading`)."""

    if not np.array_equal(out.example_ids, base.example_ids):
        raise MethodsError("the lens reading and the stored outputs cover different facts")
    resid = torch.as_tensor(out.resid)
    if tuned is not None:
        resid = tuned.translate(resid)
    lr = read_objects(FinalReadout.from_store(store), resid, out.objects)
    return {
        f"{base.method}@{name}": rekey(base, k, f"{base.method}@{name}")
        for name, k in lens_keys(lr.prob, lr.rank).items()
    }
