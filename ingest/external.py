"""Activations captured elsewhere, written into a corpus store (``actstore.write_corpus``, ``actstore import``).

Three sources, each read into windows of token ids with the residual stream at some of the store's
residual indices (``resid`` index ``i`` is the input of block ``i``; ``L`` the output of the last block,
before the final norm):

- a mapping of ``[batch, pos, d_model]`` tensors with the token ids ``[batch, pos]`` it was run on:
  a TransformerLens ``run_with_cache`` cache (``blocks.{l}.hook_resid_pre`` is index ``l``,
  ``blocks.{l}.hook_resid_post`` index ``l + 1``), nnsight saves keyed by the transformers module
  path (``model.layers.{l}``: the output of block ``l``, index ``l + 1``; ``model.embed_tokens``:
  index 0) or by residual index;
- the safetensors files vLLM's ``extract_hidden_states`` method writes (ExampleHiddenStatesConnector,
  vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py, vllm-project/vllm
  at 015a95c8): one file a request, ``token_ids`` int64 ``[seq]`` and ``hidden_states``
  ``[seq, n_layer_ids, d]``, the layers being ``eagle_aux_hidden_state_layer_ids`` (vLLM collects
  layer id ``i`` as ``hidden_states + residual`` entering layer ``i``: residual index ``i``).

Every window's shapes are checked against the model before the store is touched (a wrong width, a
layer past the model, ids and activations of different lengths: one line, nothing written).  Its values
(finite; within float16's range for a float16 store) are checked as each segment is cast, so that a new
store reads every file once; a bad one gives one line and the store is removed (with a store to
overwrite or resume, they are checked before it is touched: ``actstore.write_corpus``).  The rows are written
by the corpus writer path (:func:`actstore.ingest.capture_store.capture_segments`): the same commit
protocol, resume, ``verify``, tables and weights as ``actstore ingest --positions all``; every position
of a window is a row.  ``z`` and ``mlp`` are not captured (zero chunks, refused on read), only
``resid``.  ``positions.top``/``lp``/``rank`` come from the model's final norm and head over residual
``L`` where it was given, -1/NaN otherwise.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from actstore.core.errors import InvalidSetting
from actstore.core.layout import SEGMENT_ARRAYS
from actstore.core.manifest import Geometry
from actstore.core.storage.base import StoreLocation
from actstore.core.tables import to_parquet_bytes
from actstore.ingest.capture.architectures import architecture_for
from actstore.ingest.capture.host import predictions, to_host
from actstore.ingest.capture_store import (
    FLOAT16_MAX,
    CapturedSegment,
    CaptureMode,
    IngestReport,
    capture_segments,
    finite16,
    require_lock,
)
from actstore.ingest.corpus import ROW_FIELDS
from actstore.ingest.corpus_windows import CorpusPlan, Window, segment_corpus_tables
from actstore.ingest.settings import IngestConfig

_TL = re.compile(r"^blocks\.(\d+)\.hook_resid_(pre|post)$")
_HF = re.compile(r"^(?:model\.)?layers\.(\d+)$")


class FileRows:
    """One layer of a vLLM hidden-states file (``hidden_states[:, k]``, ``[seq, d]``), read on demand
    through safetensors' lazy slices in the file's own dtype (float32, float16 or bfloat16): an import
    holds only the rows the segment being written reads, never the whole corpus."""

    def __init__(self, path: str, k: int, shape: tuple[int, int]) -> None:
        self.path, self.k, self.shape = path, k, shape

    def __getitem__(self, rows: slice) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(self.path, "pt") as f:
            return f.get_slice("hidden_states")[rows, self.k]  # type: ignore[no-any-return]


def window_rows(
    resid: Mapping[int, np.ndarray | FileRows], layers: Sequence[int], a: int, b: int
) -> list[Any]:
    """Rows ``a:b`` of each of ``layers`` of a window: where they all lie in one vLLM file, one read of
    its ``hidden_states[a:b]`` (a contiguous range of the file, opened once) and a view a layer; else
    each layer's own rows."""
    parts = [resid[i] for i in layers]
    if parts and all(isinstance(p, FileRows) for p in parts) and len({p.path for p in parts}) == 1:  # type: ignore[union-attr]
        from safetensors import safe_open

        with safe_open(parts[0].path, "pt") as f:  # type: ignore[union-attr]
            block = f.get_slice("hidden_states")[a:b]  # [b - a, layers in the file, d]
        return [block[:, p.k] for p in parts]  # type: ignore[union-attr]
    return [p[a:b] for p in parts]


@dataclass(frozen=True)
class ExternalWindow:
    """One sequence captured elsewhere: its token ids (int64 ``[T]``) and, by residual index, ``[T, d]``
    (an array, or :class:`FileRows` read on demand)."""

    ids: np.ndarray
    resid: dict[int, np.ndarray | FileRows]


def _extremes(w: ExternalWindow) -> dict[int, tuple[float, float]]:
    """(max, min) of each residual of ``w`` as floats (NaN or infinite when any value is); a vLLM file is
    read whole once for all its layers (not one strided read a layer)."""
    from safetensors import safe_open

    whole: dict[str, np.ndarray] = {}
    out = {}
    for i, a in w.resid.items():
        if isinstance(a, FileRows):
            if a.path not in whole:
                with safe_open(a.path, "pt") as f:
                    t = f.get_tensor("hidden_states")  # [seq, layers, d]
                # (numpy's reductions: 3-5x torch's here)
                whole[a.path] = (t.float() if t.dtype == torch.bfloat16 else t).numpy()
            x = whole[a.path][:, a.k]
        else:
            x = a
        out[i] = (float(x.max()), float(x.min()))
    return out


def resid_index(key: str | int) -> int:
    """The store's residual index of a TransformerLens hook name, a transformers module path or an int."""
    if isinstance(key, (int, np.integer)):
        return int(key)
    m = _TL.match(key)
    if m:
        return int(m.group(1)) + (m.group(2) == "post")
    m = _HF.match(key)
    if m:
        return int(m.group(1)) + 1
    if key in ("hook_embed", "model.embed_tokens", "embed_tokens"):
        return 0
    raise InvalidSetting(
        "source", f"{key!r} is not a residual-stream name (blocks.L.hook_resid_pre/post, model.layers.L)"
    )


def _numpy(x: Any) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", torch.float32).numpy()
    return np.asarray(x, dtype=np.float32)


def windows_from_mapping(acts: Mapping[Any, Any], tokens: Any) -> list[ExternalWindow]:
    """Windows of a TransformerLens cache or nnsight saves (``[batch, pos, d]`` each) run on ``tokens``
    (``[batch, pos]``); keys that are not residual-stream names are ignored (a full cache has many)."""
    ids = np.asarray(tokens.cpu() if isinstance(tokens, torch.Tensor) else tokens, dtype=np.int64)
    if ids.ndim == 1:
        ids = ids[None]
    by_index: dict[int, np.ndarray] = {}
    for key in acts.keys():
        try:
            idx = resid_index(key)
        except InvalidSetting:
            continue
        a = _numpy(acts[key])
        if a.ndim == 2:
            a = a[None]
        if a.shape[:2] != ids.shape:
            raise InvalidSetting(
                "source",
                f"{key}: shape {tuple(a.shape)} does not match the tokens' {tuple(ids.shape)} [batch, pos]",
            )
        by_index.setdefault(idx, a)  # resid_post of block l and resid_pre of l + 1 are the same index
    if not by_index:
        raise InvalidSetting(
            "source", "no residual-stream activation in it (blocks.L.hook_resid_pre/post, model.layers.L)"
        )
    return [
        ExternalWindow(ids[b], {i: a[b] for i, a in sorted(by_index.items())}) for b in range(ids.shape[0])
    ]


def windows_from_vllm(paths: Iterable[str | Path], layer_ids: Sequence[int]) -> list[ExternalWindow]:
    """Windows of vLLM ``extract_hidden_states`` files (``token_ids [seq]``, ``hidden_states [seq, n, d]``;
    ``layer_ids``: the ``eagle_aux_hidden_state_layer_ids`` they were written with, in that order)."""
    from safetensors import SafetensorError, safe_open

    out = []
    for path in paths:
        try:
            with safe_open(str(path), "pt") as f:
                keys = set(f.keys())
                if keys != {"hidden_states", "token_ids"}:
                    raise InvalidSetting(
                        "source", f"{path}: not a vLLM hidden-states file (keys {sorted(keys)})"
                    )
                ids = f.get_tensor("token_ids").numpy().astype(np.int64)
                hs = f.get_slice("hidden_states")
                shape, dtype = tuple(hs.get_shape()), hs.get_dtype()
        except SafetensorError as e:
            raise InvalidSetting("source", f"{path}: not a safetensors file ({e})") from None
        if len(shape) != 3 or shape[0] != ids.size or shape[1] != len(layer_ids):
            raise InvalidSetting(
                "source", f"{path}: hidden_states {shape} is not [seq={ids.size}, layers={len(layer_ids)}, d]"
            )
        if dtype not in ("F32", "F16", "BF16", "F64"):
            raise InvalidSetting(
                "source", f"{path}: hidden_states of dtype {dtype}, not a floating point type"
            )
        p = str(path)
        out.append(
            ExternalWindow(
                ids, {int(i): FileRows(p, k, (shape[0], shape[2])) for k, i in enumerate(layer_ids)}
            )
        )
    return out


def check_windows(
    windows: Sequence[ExternalWindow],
    g: Geometry,
    storage_dtype: str = "float32",
    values: bool = True,
    only: Collection[int] | None = None,
) -> list[int]:
    """The residual indices every window holds (the same in each), after checking them against ``g``
    and, with ``values``, that every value is finite (for a float16 store: within float16's range;
    one read of every value, so a caller that checked them does not again); ``only``: the values of
    these windows alone (a rank's)."""
    if not windows:
        raise InvalidSetting("source", "no windows to write")
    layers = sorted(windows[0].resid)
    for k, w in enumerate(windows):
        if sorted(w.resid) != layers:
            raise InvalidSetting("source", f"window {k} holds layers {sorted(w.resid)}, window 0 {layers}")
        if w.ids.ndim != 1 or w.ids.size == 0:
            raise InvalidSetting("source", f"window {k}: no tokens")
        for i, a in w.resid.items():
            if not 0 <= i <= g.n_layers:
                raise InvalidSetting("source", f"residual index {i} is past the model's 0..{g.n_layers}")
            if a.shape != (w.ids.size, g.d_model):
                raise InvalidSetting(
                    "source",
                    f"window {k}, residual {i}: shape {tuple(a.shape)}, the model's is [{w.ids.size}, {g.d_model}]",
                )
        if not values or (only is not None and k not in only):
            continue
        for i, (hi, lo) in sorted(_extremes(w).items()):
            problem = _value_problem(k, i, hi, lo, storage_dtype)
            if problem is not None:
                raise problem
    return layers


def _value_problem(k: int, i: int, hi: float, lo: float, storage_dtype: str) -> InvalidSetting | None:
    """The error for window ``k``'s residual ``i`` whose largest and smallest values are ``hi`` and ``lo``
    (None when a store of ``storage_dtype`` holds them)."""
    if not (np.isfinite(hi) and np.isfinite(lo)):
        return InvalidSetting("source", f"window {k}, residual {i}: not finite")
    if storage_dtype == "float16" and max(hi, -lo) > FLOAT16_MAX:
        return InvalidSetting(
            "dtype",
            f"window {k}, residual {i}: a value of magnitude {max(hi, -lo):.6g} is past float16's "
            f"{FLOAT16_MAX:g}; import it with --dtype float32",
        )
    return None


def _all_finite(r: torch.Tensor) -> bool:
    """Every value of the float16 or float32 ``r`` finite (a float16 value past 65504 was cast to infinity)."""
    if r.dtype == torch.float16:
        return finite16(r.numpy())
    return bool(torch.isfinite(r).all())


def plan_windows(
    windows: Sequence[ExternalWindow], tokenizer: Any, spec: str
) -> tuple[CorpusPlan, list[str], str]:
    """The corpus plan (one document a window, every position kept), the windows' decoded texts and
    the SHA-256 of their token ids (the store's ``corpus_sha256``)."""
    plan_w, texts = [], []
    digest = hashlib.sha256()
    for k, w in enumerate(windows):
        n = w.ids.size
        digest.update(n.to_bytes(8, "little") + w.ids.astype("<i8").tobytes())
        minus = np.full(n, -1, np.int32)
        plan_w.append(
            Window(
                0,
                w.ids,
                np.full(n, k, np.int64),
                np.arange(n, dtype=np.int32),
                minus,
                minus,
                np.ones(n, bool),
            )
        )
        texts.append(str(tokenizer.decode(w.ids.tolist())))
    counts = np.array([w.ids.size for w in windows], np.int64)
    row_start = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    policy = {
        "positions": "all",
        "context_length": int(counts.max()),
        "special": "kept",
        "pack": False,
        "documents": len(windows),
        "windows": len(windows),
        "cut_documents": 0,
        "imported": spec,
    }
    return CorpusPlan(plan_w, row_start, policy), texts, digest.hexdigest()


class _NoTop:
    """``tokenizer`` whose ``convert_ids_to_tokens`` gives "" for -1 (no prediction: ``top`` is -1)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        known = [i for i in ids if i >= 0]
        names = iter(self.tokenizer.convert_ids_to_tokens(known)) if known else iter(())
        return [str(next(names)) if i >= 0 else "" for i in ids]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tokenizer, name)


def write_windows(
    loc: StoreLocation,
    model: torch.nn.Module,
    tokenizer: Any,
    model_info: dict[str, Any],
    windows: Sequence[ExternalWindow],
    spec: str,
    cfg: IngestConfig,
    predict: bool = True,
    check_values: bool = False,
) -> IngestReport:
    """Write ``windows`` as a corpus store at ``loc`` (writer lock held); ``predict=False``: no
    predictions from the last residual (-1/NaN, as without it).  Their values are checked by the caller
    before the store is touched (:func:`check_windows`), or with ``check_values`` here, each segment's
    after its cast and before it is written (one read of the files instead of two): a value the store
    cannot hold then raises :class:`InvalidSetting` naming the first such window and residual, with the
    segments before it committed (a caller that created the store removes it)."""
    require_lock(loc)
    arch = architecture_for(model)
    g = arch.geometry(model)
    layers = check_windows(windows, g, cfg.storage_dtype, values=False)
    plan, texts, sha = plan_windows(windows, tokenizer, spec)
    kept = {"z": [], "mlp": [], "resid": layers}  # type: dict[str, list[int]]
    dtype = getattr(torch, cfg.storage_dtype)
    S = cfg.segment_size

    def capture_segment(capture: Any, seg: int, n_before: int, bar: Any) -> CapturedSegment:
        lo, hi = seg * S, min((seg + 1) * S, plan.n_rows)
        meta: dict[str, list[np.ndarray]] = {n: [] for n in ROW_FIELDS}
        spans: list[tuple[int, int, int]] = []  # (window, first, end) of the segment's rows
        nxt: list[np.ndarray] = []
        for w in plan.windows_of(lo, hi):
            a = max(lo, int(plan.row_start[w])) - int(plan.row_start[w])
            b = min(hi, int(plan.row_start[w + 1])) - int(plan.row_start[w])
            win = plan.windows[w]
            for name, values in (
                ("document", win.document),
                ("window_index", np.full(win.ids.size, win.number, np.int32)),
                ("position", win.position),
                ("window_position", np.arange(win.ids.size, dtype=np.int32)),
                ("token_id", win.ids),
                ("char_start", win.char_start),
                ("char_end", win.char_end),
            ):
                meta[name].append(values[a:b])
            spans.append((w, a, b))
            nxt.append(np.append(win.ids, -1)[a + 1 : b + 1])
        rows = {n: np.concatenate(v) for n, v in meta.items()}
        n = rows["token_id"].size
        # each window's layers cast once, straight into the segment's array (no stack, no concatenate),
        # in pieces under torch's grain size (32,768 elements): one thread each, which on a loaded
        # machine is 2-3x faster than torch's threaded strided copy and than numpy's cast
        r = torch.empty((n, len(layers), g.d_model), dtype=dtype)
        step = max(1, 32767 // g.d_model)
        at = 0
        for w, a, b in spans:
            for k, got in enumerate(window_rows(windows[w].resid, layers, a, b)):
                src = torch.as_tensor(got)
                for c in range(0, b - a, step):
                    r[at + c : at + min(b - a, c + step), k] = src[c : c + step]
            at += b - a
        if check_values and not _all_finite(r):
            raise _first_problem(spans, r)
        next_ids = np.concatenate(nxt).astype(np.int64)
        if predict and g.n_layers in layers:
            last = [torch.as_tensor(windows[w].resid[g.n_layers][a:b]) for w, a, b in spans]  # as given
            with torch.inference_mode():
                p = next(model.parameters())
                final = torch.cat(last).to(p.device, p.dtype)
                logits = model.get_output_embeddings()(arch.final_norm(model)(final)).float()  # type: ignore[operator]
                softcap = getattr(model.config, "final_logit_softcapping", None)
                if softcap:
                    logits = torch.tanh(logits / softcap) * softcap
            preds = predictions(logits, next_ids)
        else:
            preds = (np.full(n, -1, np.int32), np.full(n, np.nan, np.float32), np.full(n, -1, np.int32))
        host = to_host(
            {
                "z": torch.zeros((n, 0, g.n_heads, g.d_head), dtype=dtype),
                "mlp": torch.zeros((n, 0, g.d_mlp), dtype=dtype),
                "resid": r,
                "attn": torch.zeros((0, g.n_layers, g.n_heads), dtype=dtype),
                "v": torch.zeros((0, g.n_layers, g.n_kv_heads, g.d_head), dtype=dtype),
            },
            SEGMENT_ARRAYS,
        )
        tables = segment_corpus_tables(seg, lo, rows, texts, _NoTop(tokenizer), preds, next_ids, spec)
        # encoded here: this thread waits for the writer's, which has the segment's files to write
        encoded: dict[str, pa.Table | bytes] = {k: to_parquet_bytes(t) for k, t in tables.items()}
        bar.update(hi - lo)
        return CapturedSegment(host, encoded, 0.0)

    def _first_problem(spans: list[tuple[int, int, int]], r: torch.Tensor) -> InvalidSetting:
        """The error for the first of ``spans`` whose cast rows in ``r`` are not all finite, from its
        values as given (a NaN, or a magnitude past float16's)."""
        at = 0
        for w, a, b in spans:
            for k, got in enumerate(window_rows(windows[w].resid, layers, a, b)):
                if not _all_finite(r[at : at + b - a, k]):
                    x = torch.as_tensor(got).float()
                    hi, lo = float(x.max()), float(x.min())
                    return _value_problem(w, layers[k], hi, lo, cfg.storage_dtype) or InvalidSetting(
                        "dtype",
                        f"window {w}, residual {layers[k]}: a value of magnitude {max(hi, -lo):.6g} is past "
                        f"{cfg.storage_dtype}'s range; import it with --dtype float32",
                    )
            at += b - a
        raise AssertionError("a segment that is not finite holds no window that is not")

    settings = {
        "padding_side": "right",
        "corpus_sha256": sha,
        **plan.policy,
        "kept": kept,
        "predict": predict,
    }
    # (the arrays go to the writer with their kept layers only: it writes the others as zeros)
    mode = CaptureMode(
        plan.n_rows, settings, "position", capture_segment, values_checked=check_values, desc="import"
    )
    return capture_segments(loc, model, tokenizer, model_info, cfg, mode)
