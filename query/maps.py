"""MAPS, static part: what each attention head does, from the store's weights alone.

For head h of layer l (Elhelo & Geva, 2025; SPEC section 5, seed 004) the vocabulary map is

    M = E W_VO U,    W_VO = W_V[l, kv(h)] W_O[l, h]       (kv(h) = h // (H / H_kv))

and its row for source token s scores every vocabulary token as a target.  We never build
the |V| x |V| matrix: W_VO has rank d_head, so a row is ``x_s B_h`` with
``x_s = e_s W_V[l, kv(h)]`` (d_head numbers) and ``B_h = W_O[l, h] U`` ([d_head, |V|], made
once per head; for few rows ``(x_s W_O[l, h]) U`` is cheaper, see :class:`HeadMap`).  Rows are computed only for the source tokens a relation needs, in chunks,
so peak memory is a few chunks of ``[rows, |V|]`` whatever the vocabulary.

Scores, per relation R with token pairs (s, t):

* ``rank_up(s, t)``   = number of vocabulary entries of row m_s strictly greater than m_s[t]
  (0 = t is the row's maximum); ``rank_down`` the same for ``-m_s``.  Ranks are kept up to
  ``k_max`` (only each row's k_max largest and smallest entries are needed: a top-k, not a
  sort), so any k <= k_max can be scored afterwards.
* relation score  phi_R(h)  = share of pairs with ``rank_up < k``  (t in the top-k of m_s);
* suppression score         = share of pairs with ``rank_down < k`` (t in the top-k of -m_s);
* head h *implements* R when phi_R(h) >= 0.15 (:data:`IMPLEMENTS_THRESHOLD`), and
  *suppresses* R when its suppression score is.

``k`` and the pairs follow the authors' released code by default (github.com/amitelhelo/MAPS,
``src/utils.py`` ``get_k`` and ``src/maps.py`` ``preprocess_dataset`` / ``is_valid_dataset_for_model``):

* ``k`` per relation (:func:`paper_k`): 1 for the copying relations (name containing "copying"),
  10 for every other; for Llama-3 models 3 and 25.  A given ``k`` applies to every relation instead.
* only pairs whose source and target are each one token (with the leading space) are scored
  (``multi_token="skip"``); ``multi_token="first"`` (ours, a named variant) lets a multi-token word
  stand as its first token, and the number of such pairs is reported.
* a relation with fewer than :data:`MIN_PAIRS` = 30 usable pairs (the authors'
  ``min_filtered_dataset_size``) is excluded: :func:`split_by_min_pairs` reports it with its counts,
  and it enters no score table, summary or figure.

Ties are broken in the target's favour (strictly greater entries are counted), which
``torch.topk`` leaves unspecified.

Words to tokens (:func:`tokenize_pairs`): each word gets a leading space (the paper's
``add_leading_space``).  Pairs whose source or target has no token, or only the tokenizer's
unknown token, are dropped and counted.

Choices where the paper leaves room (documented, and parameters where it matters):

* Embedding scale (Gemma multiplies embeddings by sqrt(d_model)): applied, but it is one
  positive number per row, so neither phi nor sigma changes.
* Final norm: by default (``final_norm=True``) the unembedding is read through the final
  norm's elementwise weight, U' = diag(w) U^T, which is how a head's output reaches the
  logits (the norm's 1/rms is one positive number per position and cannot change a rank).
  The paper's code (TransformerLens without weight processing) uses the raw W_U;
  ``final_norm=False`` reproduces that.  Dynamic scores use the same U'.
* First MLP: the paper's code (``apply_first_mlp``, on for every model but Llama-3.1-70B:
  :func:`paper_first_mlp`) replaces the source embeddings by the first MLP's output on them,
  MLP0(norm(e_s)), for layers >= 1.  The store does not hold that MLP's input weights, so this
  needs the model: pass ``first_mlp`` (:func:`ingest.first_mlp.first_mlp_transform`).  The
  command line turns it on by default as the authors do (``--no-first-mlp``: from the store's
  weights alone).  On SmolLM2 it matters a great deal: it lifts the static-dynamic correlation
  from 0.0-0.6 to 0.7-1.0.
* Not applied, because the store does not hold them: the attention block's input norm
  weight (before W_V) and Gemma's post-attention norm.  Biases b_V, b_O are left out, as in
  the paper.

Salient operations (:func:`salient_operations`): sigma_t = |e_t W_VO| / |e_t| for every
vocabulary token t (through the Gram matrix W_O W_O^T, so again no [|V|, d_model] product
per head), the top tokens by sigma and, for each, its top mapped tokens in m_t.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import torch

from actstore.errors import QueryError
from actstore.manifest import Geometry
from actstore.store import Store

SourceTransform = Callable[[torch.Tensor], torch.Tensor]

DEFAULT_K = 10  # the paper's k for every relation but the copying ones, on every model but Llama-3
COPYING_K = 1  # the paper's k for the copying relations
MIN_PAIRS = 30  # the authors' min_filtered_dataset_size: fewer usable pairs and a relation is excluded
IMPLEMENTS_THRESHOLD = 0.15
ROW_CHUNK = 256  # source rows per [rows, |V|] block


class MapsError(QueryError):
    """Bad MAPS input (pair files, relations, heads); one line for the command line."""


# ----------------------------------------------------------------------------------- pairs


@dataclass(frozen=True)
class RelationPairs:
    """The (source, target) word pairs of one relation, as read from its file."""

    relation: str
    pairs: tuple[tuple[str, str], ...]
    path: str


def load_pair_files(paths: Sequence[str | Path], relations: Sequence[str] | None = None) -> list[RelationPairs]:
    """MAPS pair files (``[["France", "Paris"], ...]``): files, or directories searched for ``*.json``.

    The relation is the file's stem.  ``relations`` keeps only those (unknown ones are an error).
    """
    if not paths:
        raise MapsError("no pair files given (--pairs FILE_OR_DIR)")
    files: dict[str, Path] = {}
    for raw in paths:
        p = Path(raw).expanduser()
        if not p.exists():
            raise MapsError(f"pair file or directory {p} not found")
        found = sorted(p.rglob("*.json")) if p.is_dir() else [p]
        if not found:
            raise MapsError(f"{p}: no .json pair files found")
        for f in found:
            if f.stem in files and files[f.stem] != f:
                raise MapsError(f"relation {f.stem!r} is given twice: {files[f.stem]} and {f}")
            files[f.stem] = f
    names = list(files)
    if relations is not None:
        unknown = sorted(set(relations) - set(names))
        if unknown:
            raise MapsError(f"unknown relation(s) {', '.join(unknown)}; the pair files hold {', '.join(names)}")
        names = [n for n in names if n in set(relations)]
    return [RelationPairs(n, _read_pairs(files[n]), str(files[n])) for n in names]


def _read_pairs(path: Path) -> tuple[tuple[str, str], ...]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise MapsError(f"{path}: cannot read: {e}") from None
    except json.JSONDecodeError as e:
        raise MapsError(f"{path}: malformed JSON ({e.msg}, line {e.lineno})") from None
    if not isinstance(data, list):
        raise MapsError(f"{path}: expected a JSON list of [source, target] string pairs, got {type(data).__name__}")
    if not data:
        raise MapsError(f"{path}: the list of pairs is empty")
    for i, p in enumerate(data):
        if not (isinstance(p, list | tuple) and len(p) == 2 and all(isinstance(x, str) for x in p)):
            raise MapsError(f"{path}: item {i} is {json.dumps(p)[:60]}, not a [source, target] pair of strings")
    return tuple((str(a), str(b)) for a, b in data)


@dataclass(frozen=True)
class TokenPairs:
    """A relation's pairs as (source, target) token ids, with what tokenization did to them."""

    relation: str
    src: np.ndarray  # [n] int64
    dst: np.ndarray  # [n] int64
    n_pairs: int  # pairs in the file
    n_multi_token: int  # used pairs whose source or target is several tokens (first token used)
    n_unknown: int  # dropped: a word with no token, or only the unknown token
    n_skipped_multi_token: int = 0  # dropped because multi_token="skip"

    @property
    def n_used(self) -> int:
        return int(self.src.size)


MultiToken = Literal["skip", "first"]


def tokenize_pairs(
    rel: RelationPairs,
    tokenizer: Any,
    *,
    vocab_size: int | None = None,
    leading_space: bool = True,
    multi_token: MultiToken = "skip",
    allow_empty: bool = False,
) -> TokenPairs:
    """Token ids of a relation's words (see the module docstring for the policy).

    ``multi_token="skip"`` (default, the authors' filter) keeps only pairs whose source and target
    are one token each; ``"first"`` keeps every pair, a multi-token word standing as its first
    token.  A relation left with no pair is an error unless ``allow_empty`` (then it comes back
    with ``n_used == 0``, to be reported as excluded).
    """
    if multi_token not in ("first", "skip"):
        raise MapsError(f"multi_token must be 'first' or 'skip', not {multi_token!r}")
    words = [w for pair in rel.pairs for w in pair]
    prefix = " " if leading_space else ""
    enc = tokenizer([prefix + w.strip() if w.strip() else "" for w in words], add_special_tokens=False)["input_ids"]
    unk = getattr(tokenizer, "unk_token_id", None)
    src: list[int] = []
    dst: list[int] = []
    multi = unknown = skipped = 0
    for i in range(len(rel.pairs)):
        a, b = list(enc[2 * i]), list(enc[2 * i + 1])
        if not a or not b or a[0] == unk or b[0] == unk or (
            vocab_size is not None and max(a[0], b[0]) >= vocab_size
        ):
            unknown += 1
            continue
        if len(a) > 1 or len(b) > 1:
            if multi_token == "skip":
                skipped += 1
                continue
            multi += 1
        src.append(int(a[0]))
        dst.append(int(b[0]))
    if not src and not allow_empty:
        why = "has a source and a target the tokenizer knows" if unknown == len(rel.pairs) else (
            "is left after dropping multi-token words")
        raise MapsError(f"relation {rel.relation}: none of its {len(rel.pairs)} pairs {why}")
    return TokenPairs(rel.relation, np.asarray(src, np.int64), np.asarray(dst, np.int64), len(rel.pairs),
                      multi, unknown, skipped)


def single_token_pairs(pairs: Sequence[tuple[str, str]], tokenizer: Any, *, vocab_size: int | None = None,
                       leading_space: bool = True) -> np.ndarray:
    """[n] bool: whether source and target are each one known token (the rule of
    ``tokenize_pairs(..., multi_token="skip")``, pair by pair)."""
    if not pairs:
        return np.zeros(0, bool)
    prefix = " " if leading_space else ""
    words = [w for pair in pairs for w in pair]
    enc = tokenizer([prefix + w.strip() if w.strip() else "" for w in words], add_special_tokens=False)["input_ids"]
    unk = getattr(tokenizer, "unk_token_id", None)
    out = np.zeros(len(pairs), bool)
    for i in range(len(pairs)):
        a, b = list(enc[2 * i]), list(enc[2 * i + 1])
        out[i] = (len(a) == 1 and len(b) == 1 and unk not in (a[0], b[0])
                  and (vocab_size is None or max(a[0], b[0]) < vocab_size))
    return out


def paper_k(relation: str, model_name: str = "") -> int:
    """The authors' k for ``relation`` (``get_k`` in their ``src/utils.py``): 1 for a copying relation
    (its name contains "copying") and 10 otherwise; for Llama-3 models 3 and 25."""
    copying = "copying" in relation
    if re.search(r"llama-?3", model_name, re.IGNORECASE):
        return 3 if copying else 25
    return COPYING_K if copying else DEFAULT_K


def paper_first_mlp(model_name: str = "") -> bool:
    """Whether the authors read sources through the first MLP for this model (every model but
    Llama-3.1-70B: ``apply_first_mlp`` in their ``src/experiment1_correlative.py``)."""
    return re.search(r"llama-?3\.1-70b", model_name, re.IGNORECASE) is None


def relation_ks(relations: Iterable[str], k: int | None, model_name: str = "") -> dict[str, int]:
    """k per relation: the given ``k`` for all, or (``None``) the authors' :func:`paper_k`."""
    return {r: (int(k) if k is not None else paper_k(r, model_name)) for r in relations}


def k_of(k: int | Mapping[str, int], relation: str) -> int:
    return int(k) if isinstance(k, int) else int(k[relation])


def split_by_min_pairs(pairs: Sequence[TokenPairs], min_pairs: int = MIN_PAIRS
                       ) -> tuple[list[TokenPairs], list[dict[str, Any]]]:
    """(relations with at least ``min_pairs`` usable pairs, the others as report rows).

    An excluded relation enters no score, summary or figure; its row says why (pairs in the file,
    usable, multi-token dropped or kept, unknown)."""
    if min_pairs < 0:
        raise MapsError(f"the minimum number of pairs must not be negative, not {min_pairs}")
    kept = [p for p in pairs if p.n_used >= max(min_pairs, 1)]
    excluded = [{"relation": p.relation, "n_pairs": p.n_pairs, "n_used": p.n_used,
                 "n_skipped_multi_token": p.n_skipped_multi_token, "n_multi_token": p.n_multi_token,
                 "n_unknown": p.n_unknown, "min_pairs": int(min_pairs)}
                for p in pairs if p.n_used < max(min_pairs, 1)]
    return kept, excluded


def excluded_line(rows: Sequence[Mapping[str, Any]]) -> str:
    """``year_to_following 0/700, english_to_spanish 6/82`` (usable / pairs in the file)."""
    return ", ".join(f"{r['relation']} {r['n_used']}/{r['n_pairs']}" for r in rows)


# ----------------------------------------------------------------------------------- projection


def check_head(g: Geometry, layer: int, head: int) -> None:
    """One error line for a head outside the store's geometry."""
    if not (0 <= layer < g.n_layers and 0 <= head < g.n_heads):
        raise MapsError(f"head {layer}.{head} is out of range: layers 0..{g.n_layers - 1}, heads 0..{g.n_heads - 1}")


class VocabProjection:
    """The store's weights arranged for vocabulary projections of heads (float32 torch)."""

    def __init__(self, store: Store, *, final_norm: bool = True, first_mlp: SourceTransform | None = None) -> None:
        g = store.geometry
        self.geometry = g
        self.final_norm = final_norm
        self.first_mlp = first_mlp
        self._sources: tuple[bytes, torch.Tensor] | None = None
        attrs = store.weight_attrs
        self.W_V = torch.from_numpy(store.weight("W_V"))  # [L, Hkv, d, dh]
        self.W_O = torch.from_numpy(store.weight("W_O"))  # [L, H, dh, d]
        scale = float(attrs.get("embed_scale") or 1.0)
        self.embed = torch.from_numpy(store.weight("embed")) * scale  # [V_in, d]
        U = torch.from_numpy(store.weight("unembed"))  # [V, d]
        if final_norm and store.has_weight("final_norm_weight"):
            U = U * torch.from_numpy(store.weight("final_norm_weight"))[None, :]
        self.U_T = U.T.contiguous()  # [d, V]

    @property
    def vocab_size(self) -> int:
        return int(self.U_T.shape[1])

    def check_head(self, layer: int, head: int) -> None:
        check_head(self.geometry, layer, head)

    def kv(self, head: int) -> int:
        return head // self.geometry.kv_group

    def readout(self, layer: int, head: int, n_rows: int) -> HeadMap:
        """The map x -> x W_O[l, h] U' for about ``n_rows`` vectors x (see :class:`HeadMap`)."""
        return HeadMap(self.W_O[layer, head], self.U_T, n_rows)

    def sources(self, layer: int, token_ids: torch.Tensor) -> torch.Tensor:
        """The source vectors layer ``layer`` reads: the embeddings, or with ``first_mlp``
        (the paper's option) the first MLP's output on them for layers >= 1.  [n, d_model]."""
        e = self.embed[token_ids]
        if self.first_mlp is None or layer == 0:
            return e
        key = token_ids.numpy().tobytes()
        if self._sources is None or self._sources[0] != key:
            with torch.inference_mode():
                out = torch.cat([self.first_mlp(e[i:i + 4096]).float() for i in range(0, e.shape[0], 4096)])
            self._sources = (key, out)
        return self._sources[1]

    def values(self, layer: int, kv: int, token_ids: torch.Tensor) -> torch.Tensor:
        """x_s = src_s W_V[l, kv] for the given source tokens (see :meth:`sources`): [n, d_head]."""
        return self.sources(layer, token_ids) @ self.W_V[layer, kv]


class HeadMap:
    """x [n, d_head] -> rows x W_O U' [n, |V|], in the cheaper of two orders.

    Through B = W_O U' ([d_head, |V|], made once) a row costs d_head*|V|; directly, (x W_O) U'
    costs d_model*|V| per row but nothing up front.  B pays off from about
    d_head*d_model / (d_model - d_head) rows: 72 for SmolLM2 (64, 576), 427 for Gemma-3-270M
    (256, 640, whose |V| = 262144 makes B cost as much as 640 direct rows).
    """

    def __init__(self, W_O: torch.Tensor, U_T: torch.Tensor, n_rows: int) -> None:
        dh, d = W_O.shape
        self.W_O = W_O
        self.U_T = U_T
        self.B = W_O @ U_T if n_rows * (d - dh) >= dh * d else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.B if self.B is not None else (x @ self.W_O) @ self.U_T


def target_ranks(rows: torch.Tensor, targets: torch.Tensor, k_max: int,
                 local: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Ranks of each target in its row, censored at ``k_max``: ([p], [p]) int32.

    ``rank_up`` counts the row's entries strictly greater than the target's value, ``rank_down``
    those strictly smaller; either is reported as ``k_max`` when it is ``k_max`` or more.  Only
    the ``k_max`` largest and smallest entries of each row are kept (``torch.topk``), which is
    exact: fewer than k entries exceed v  <=>  the k-th largest entry is <= v.  ``local`` maps
    each target to its row (default: target i is in row i); the target's value is read from
    the same computed row, so the comparison is free of rounding differences.
    """
    idx = torch.arange(rows.shape[0]) if local is None else local
    val = rows[idx, targets][:, None]
    K = min(int(k_max), int(rows.shape[1]))
    hi = torch.topk(rows, K, dim=1, largest=True, sorted=False).values[idx]
    lo = torch.topk(rows, K, dim=1, largest=False, sorted=False).values[idx]
    return (hi > val).sum(1, dtype=torch.int32), (lo < val).sum(1, dtype=torch.int32)


def projected_ranks(x: torch.Tensor, readout: HeadMap, targets: torch.Tensor, k_max: int,
                    rows_per_chunk: int = ROW_CHUNK) -> tuple[np.ndarray, np.ndarray]:
    """:func:`target_ranks` of the rows ``readout(x)`` (x: [n, d_head]), in chunks."""
    n = int(x.shape[0])
    up = np.empty(n, np.int32)
    down = np.empty(n, np.int32)
    for lo in range(0, n, rows_per_chunk):
        hi = min(n, lo + rows_per_chunk)
        u, d = target_ranks(readout(x[lo:hi]), targets[lo:hi], k_max)
        up[lo:hi] = u.numpy()
        down[lo:hi] = d.numpy()
    return up, down


# ----------------------------------------------------------------------------------- static scores


def check_k(k: int, k_max: int) -> None:
    if not 1 <= k <= k_max:
        raise MapsError(f"k={k} is outside 1..{k_max}, the ranks computed (ranks are kept up to k_max)")


@dataclass(frozen=True)
class StaticScores:
    """Per pair and head: the target's rank in m_s and in -m_s (censored at ``k_max``).
    Scores follow for any k <= k_max."""

    pairs: TokenPairs
    rank_up: np.ndarray  # [n_pairs, L, H] int32
    rank_down: np.ndarray  # [n_pairs, L, H] int32
    k_max: int = DEFAULT_K

    def score(self, k: int = DEFAULT_K) -> np.ndarray:
        """phi_R per head: [L, H]."""
        check_k(k, self.k_max)
        return (self.rank_up < k).mean(axis=0)

    def suppression(self, k: int = DEFAULT_K) -> np.ndarray:
        check_k(k, self.k_max)
        return (self.rank_down < k).mean(axis=0)


def pair_ranks(proj: VocabProjection, src: np.ndarray, dst: np.ndarray, *, k_max: int = DEFAULT_K,
               heads: Iterable[tuple[int, int]] | None = None,
               rows_per_chunk: int = ROW_CHUNK) -> tuple[np.ndarray, np.ndarray]:
    """Ranks (censored at ``k_max``) of ``dst[i]`` in row ``src[i]`` of every head's M:
    ([n, L, H], [n, L, H]) int32.

    Each distinct source token's row is computed once per head, in chunks of distinct sources;
    only its ``k_max`` extreme values and the pairs' target entries are kept.  Heads not in
    ``heads`` get rank -1.
    """
    g = proj.geometry
    n = int(src.size)
    up = np.full((n, g.n_layers, g.n_heads), -1, np.int32)
    down = np.full_like(up, -1)
    if n == 0:
        return up, down
    uniq, inverse = np.unique(src, return_inverse=True)
    inverse = inverse.reshape(-1)
    order = np.argsort(inverse, kind="stable")  # pairs grouped by distinct source
    inv_sorted = inverse[order]
    bounds = np.searchsorted(inv_sorted, np.arange(0, uniq.size + rows_per_chunk, rows_per_chunk))
    uniq_t = torch.from_numpy(uniq)
    dst_sorted = torch.from_numpy(dst[order])
    wanted = _head_list(proj, heads)
    by_layer: dict[int, list[int]] = {}
    for layer, head in wanted:
        by_layer.setdefault(layer, []).append(head)
    with torch.inference_mode():
        for layer, hs in by_layer.items():
            xs = {kv: proj.values(layer, kv, uniq_t) for kv in sorted({proj.kv(h) for h in hs})}
            for head in hs:
                B = proj.readout(layer, head, int(uniq.size))
                x = xs[proj.kv(head)]
                for c in range(len(bounds) - 1):
                    lo, hi = int(bounds[c]), int(bounds[c + 1])
                    if lo == hi:
                        continue
                    u0 = c * rows_per_chunk
                    rows = B(x[u0:u0 + rows_per_chunk])  # [chunk, V]
                    local = torch.from_numpy(inv_sorted[lo:hi] - u0)
                    r_up, r_down = target_ranks(rows, dst_sorted[lo:hi], k_max, local)
                    up[order[lo:hi], layer, head] = r_up.numpy()
                    down[order[lo:hi], layer, head] = r_down.numpy()
    return up, down


def static_scores(proj: VocabProjection, relations: Sequence[TokenPairs], *, k_max: int = DEFAULT_K,
                  heads: Iterable[tuple[int, int]] | None = None) -> dict[str, StaticScores]:
    """Ranks for every relation's pairs, all relations in one pass (shared source rows computed once)."""
    if not relations:
        return {}
    if k_max < 1:
        raise MapsError(f"k must be at least 1, not {k_max}")
    src = np.concatenate([r.src for r in relations])
    dst = np.concatenate([r.dst for r in relations])
    if int(max(src.max(), dst.max())) >= proj.vocab_size or int(src.max()) >= proj.embed.shape[0]:
        raise MapsError(f"token ids exceed the store's vocabulary of {proj.vocab_size}: wrong tokenizer?")
    up, down = pair_ranks(proj, src, dst, k_max=k_max, heads=heads)
    out: dict[str, StaticScores] = {}
    start = 0
    for r in relations:
        stop = start + r.n_used
        out[r.relation] = StaticScores(r, up[start:stop], down[start:stop], k_max)
        start = stop
    return out


def _head_list(proj: VocabProjection, heads: Iterable[tuple[int, int]] | None) -> list[tuple[int, int]]:
    g = proj.geometry
    if heads is None:
        return [(layer, h) for layer in range(g.n_layers) for h in range(g.n_heads)]
    out = []
    for layer, h in heads:
        proj.check_head(int(layer), int(h))
        out.append((int(layer), int(h)))
    return out


def parse_heads(text: str | None, n_layers: int, n_heads: int) -> list[tuple[int, int]] | None:
    """``"3.5,10.2,7.*"`` -> [(3, 5), (10, 2), (7, 0), ...]; None for empty text or ``all``."""
    if text is None or not text.strip() or text.strip().lower() == "all":
        return None
    out: list[tuple[int, int]] = []
    for part in text.split(","):
        part = part.strip()
        layer_s, sep, head_s = part.partition(".")
        try:
            layer = int(layer_s)
            heads = list(range(n_heads)) if head_s == "*" else [int(head_s)] if sep else []
        except ValueError:
            heads = []
        if not heads:
            raise MapsError(f"--heads: {part!r} is not LAYER.HEAD (e.g. 12.3, or 12.* for a whole layer)")
        for h in heads:
            if not (0 <= layer < n_layers and 0 <= h < n_heads):
                raise MapsError(f"head {layer}.{h} is out of range: layers 0..{n_layers - 1}, heads 0..{n_heads - 1}")
            out.append((layer, h))
    return out


def implementing_heads(score: np.ndarray, threshold: float = IMPLEMENTS_THRESHOLD) -> list[tuple[int, int]]:
    """Heads with score >= threshold, best first."""
    layers, heads = np.nonzero(score >= threshold)
    order = np.argsort(-score[layers, heads], kind="stable")
    return [(int(layers[i]), int(heads[i])) for i in order]


def top_heads(score: np.ndarray, m: int) -> list[tuple[int, int]]:
    """The m best heads with a non-zero score (the paper's ablation set), best first."""
    flat = np.argsort(-score.ravel(), kind="stable")[:m]
    H = score.shape[1]
    return [(int(i // H), int(i % H)) for i in flat if score.ravel()[i] > 0]


# ----------------------------------------------------------------------------------- salient operations


@dataclass(frozen=True)
class SalientOps:
    layer: int
    head: int
    token_ids: np.ndarray  # [n] the most amplified tokens, by sigma
    sigma: np.ndarray  # [n]
    mapped_ids: np.ndarray  # [n, m] top mapped tokens of each


def salient_operations(proj: VocabProjection, heads: Iterable[tuple[int, int]] | None = None, *,
                       n_tokens: int = 10, n_mappings: int = 5, vocab_limit: int | None = None) -> list[SalientOps]:
    """Per head: the ``n_tokens`` tokens with the largest sigma_t and each one's top ``n_mappings`` targets.

    ``vocab_limit`` restricts the candidate source tokens to ids below it (the tokenizer's size,
    so padding rows of the embedding never count).
    """
    if n_tokens < 1 or n_mappings < 1:
        raise MapsError("--salient-tokens and --mappings must be positive")
    V_in = int(proj.embed.shape[0]) if vocab_limit is None else min(int(vocab_limit), int(proj.embed.shape[0]))
    all_ids = torch.arange(V_in)
    wanted = _head_list(proj, heads)
    out: list[SalientOps] = []
    with torch.inference_mode():
        cache: dict[tuple[int, int], torch.Tensor] = {}
        for layer, head in wanted:
            key = (layer, proj.kv(head))
            if key not in cache:
                cache.clear()  # heads come layer by layer: keep one layer's values
                E = proj.sources(layer, all_ids)
                e_norm = E.norm(dim=1)
                cache[key] = E @ proj.W_V[layer, key[1]]  # [V, dh]
            x = cache[key]
            WO = proj.W_O[layer, head]
            gram = WO @ WO.T  # [dh, dh]: |x W_O|^2 = x G x^T
            sq = ((x @ gram) * x).sum(1).clamp(min=0)
            sigma = torch.where(e_norm > 0, sq.sqrt() / e_norm.clamp(min=1e-30), torch.zeros_like(sq))
            top = torch.topk(sigma, min(n_tokens, V_in)).indices
            rows = (x[top] @ WO) @ proj.U_T
            mapped = torch.topk(rows, min(n_mappings, rows.shape[1]), dim=1).indices
            out.append(SalientOps(layer, head, top.numpy(), sigma[top].numpy(), mapped.numpy()))
    return out


# ----------------------------------------------------------------------------------- tables


def scores_table(scores: dict[str, StaticScores], k: int | Mapping[str, int], threshold: float,
                 kv_group: int) -> pa.Table:
    """One row per (relation, layer, head); ``k`` for all relations or per relation."""
    cols: dict[str, list[Any]] = {c: [] for c in (
        "relation", "layer", "head", "kv_head", "score", "suppression", "implements", "suppresses", "k",
        "n_pairs", "n_used", "n_multi_token")}
    for name, s in scores.items():
        kr = k_of(k, name)
        phi, sup = s.score(kr), s.suppression(kr)
        L, H = phi.shape
        for layer in range(L):
            for h in range(H):
                cols["relation"].append(name)
                cols["layer"].append(layer)
                cols["head"].append(h)
                cols["kv_head"].append(h // kv_group)
                cols["score"].append(float(phi[layer, h]))
                cols["suppression"].append(float(sup[layer, h]))
                cols["implements"].append(bool(phi[layer, h] >= threshold))
                cols["suppresses"].append(bool(sup[layer, h] >= threshold))
                cols["k"].append(kr)
                cols["n_pairs"].append(s.pairs.n_pairs)
                cols["n_used"].append(s.pairs.n_used)
                cols["n_multi_token"].append(s.pairs.n_multi_token)
    return pa.table(cols, schema=pa.schema([
        ("relation", pa.string()), ("layer", pa.int32()), ("head", pa.int32()), ("kv_head", pa.int32()),
        ("score", pa.float64()), ("suppression", pa.float64()), ("implements", pa.bool_()),
        ("suppresses", pa.bool_()), ("k", pa.int32()), ("n_pairs", pa.int32()), ("n_used", pa.int32()),
        ("n_multi_token", pa.int32())]))


def relation_summary(name: str, s: StaticScores, k: int, threshold: float) -> dict[str, Any]:
    phi, sup = s.score(k), s.suppression(k)
    best = np.unravel_index(int(np.argmax(phi)), phi.shape)
    p = s.pairs
    return {
        "relation": name, "k": int(k), "n_pairs": p.n_pairs, "n_used": p.n_used, "n_multi_token": p.n_multi_token,
        "n_unknown": p.n_unknown, "n_skipped_multi_token": p.n_skipped_multi_token,
        "n_implementing": int((phi >= threshold).sum()), "n_suppressing": int((sup >= threshold).sum()),
        "max_score": float(phi.max()), "best_layer": int(best[0]), "best_head": int(best[1]),
        "max_suppression": float(sup.max()),
    }


def salient_table(ops: Sequence[SalientOps], decode: Any) -> pa.Table:
    """One row per (head, salient token) with its mapped tokens as lists; ``decode(ids) -> list[str]``."""
    cols: dict[str, list[Any]] = {c: [] for c in (
        "layer", "head", "rank", "token_id", "token", "sigma", "mapped_ids", "mapped_tokens")}
    for op in ops:
        names = decode(op.token_ids.tolist())
        for r, (tid, name, sig, mapped) in enumerate(zip(op.token_ids.tolist(), names, op.sigma.tolist(), op.mapped_ids)):
            cols["layer"].append(op.layer)
            cols["head"].append(op.head)
            cols["rank"].append(r)
            cols["token_id"].append(int(tid))
            cols["token"].append(name)
            cols["sigma"].append(float(sig))
            cols["mapped_ids"].append([int(i) for i in mapped])
            cols["mapped_tokens"].append(decode([int(i) for i in mapped]))
    return pa.table(cols, schema=pa.schema([
        ("layer", pa.int32()), ("head", pa.int32()), ("rank", pa.int32()), ("token_id", pa.int32()),
        ("token", pa.string()), ("sigma", pa.float32()), ("mapped_ids", pa.list_(pa.int32())),
        ("mapped_tokens", pa.list_(pa.string()))]))


def token_decoder(tokenizer: Any) -> Any:
    """ids -> the text of each token on its own (as the paper prints them)."""
    def decode(ids: list[int]) -> list[str]:
        return [str(tokenizer.decode([i])) for i in ids]

    return decode


# ----------------------------------------------------------------------------------- pairs from a store


def store_pairs(store: Store, where: str | None = None, *, source_token: Literal["first", "last"] = "first") -> pa.Table:
    """Per example with a subject and an object: (example_id, relation_id, template, src_id, dst_id).

    ``src_id`` is the prompt's token at the subject's first (or last) position, ``dst_id`` the
    first token of " " + object (``targets.object_token_id``), ``template`` the dataset's
    template when its loader recorded one (``meta.template``), else ''.
    """
    if source_token not in ("first", "last"):
        raise MapsError(f"source token must be 'first' or 'last', not {source_token!r}")
    pos = "e.subject_start" if source_token == "first" else "e.subject_end - 1"
    cond = f"AND ({where})" if where and where.strip() else ""
    return store.sql(f"""
        SELECT e.example_id, e.relation_id, coalesce(json_extract_string(e.meta, '$.template'), '') AS template,
               tk.token_id::BIGINT AS src_id, t.object_token_id::BIGINT AS dst_id, {pos} AS src_position
        FROM examples e JOIN targets t USING (example_id)
        JOIN tokens tk ON tk.example_id = e.example_id AND tk.position = {pos}
        WHERE e.subject_start >= 0 AND t.object_token_id >= 0 {cond}
        ORDER BY e.example_id""")


# ----------------------------------------------------------------------------------- stored scores


@dataclass(frozen=True)
class StoredScores:
    """A relation's static scores as an ``actstore maps`` run wrote them (tables ``maps_scores``
    and ``maps_relations``), with the pair counts that run saw."""

    relation: str
    run_id: str
    score: np.ndarray  # [L, H] phi_R at the run's k
    n_pairs: int
    n_used: int
    n_multi_token: int
    n_unknown: int

    def same_pairs(self, pairs: TokenPairs) -> bool:
        """Whether ``pairs`` has the counts the stored run recorded (the check that it read the same pair file
        with the same tokenizer; the ids themselves are not stored)."""
        return (self.n_pairs, self.n_used, self.n_multi_token, self.n_unknown) == (
            pairs.n_pairs, pairs.n_used, pairs.n_multi_token, pairs.n_unknown)


def stored_static_scores(store: Store, relations: Sequence[str], *, k: int | Mapping[str, int], final_norm: bool,
                         first_mlp: bool, multi_token: str = "skip") -> dict[str, StoredScores]:
    """Static scores already in ``store`` for ``relations``, from the latest ``maps`` run whose settings match
    (final norm, first MLP, multi-token policy) and that scored the relation at its ``k`` (one for all, or per
    relation); relations no matching run holds are left out.

    A run counts for a relation only when it wrote a score for every head of the store's geometry.  Runs
    written before the multi-token policy was recorded used ``"first"``.
    """
    files = store.table_files()
    if not all(files.get(t) for t in ("runs", "maps_scores", "maps_relations")) or not relations:
        return {}
    want_k = {r: k_of(k, r) for r in relations}
    runs = store.table("runs", ["run_id", "kind", "finished", "config"]).to_pylist()
    matching: list[tuple[float, str]] = []
    for r in runs:
        if r["kind"] != "maps":
            continue
        try:
            cfg = json.loads(r["config"] or "{}")
        except json.JSONDecodeError:
            continue
        if (bool(cfg.get("final_norm", True)) == final_norm and bool(cfg.get("first_mlp", False)) == first_mlp
                and cfg.get("multi_token", "first") == multi_token):
            matching.append((float(r["finished"] or 0.0), str(r["run_id"])))
    if not matching:
        return {}
    g = store.geometry
    ids = ", ".join("'" + rid.replace("'", "''") + "'" for _, rid in matching)
    names = ", ".join("'" + n.replace("'", "''") + "'" for n in relations)
    sc = store.sql(f"""SELECT run_id, relation, layer, head, score, k FROM maps_scores
                       WHERE run_id IN ({ids}) AND relation IN ({names})""")
    rel = store.sql(f"""SELECT run_id, relation, n_pairs, n_used, n_multi_token, n_unknown FROM maps_relations
                        WHERE run_id IN ({ids}) AND relation IN ({names})""").to_pylist()
    counts = {(r["run_id"], r["relation"]): r for r in rel}
    grids: dict[tuple[str, str], np.ndarray] = {}
    cols = [sc.column(c).to_pylist() for c in ("run_id", "relation", "layer", "head", "score", "k")]
    for rid, name, layer, head, value, row_k in zip(*cols):
        if row_k != want_k[name]:
            continue
        key = (rid, name)
        if key not in grids:
            grids[key] = np.full((g.n_layers, g.n_heads), np.nan)
        if 0 <= layer < g.n_layers and 0 <= head < g.n_heads:
            grids[key][layer, head] = value
    out: dict[str, StoredScores] = {}
    for _, rid in sorted(matching, reverse=True):  # latest run first
        for name in relations:
            key = (rid, name)
            if name in out or key not in grids or key not in counts or np.isnan(grids[key]).any():
                continue
            c = counts[key]
            out[name] = StoredScores(name, rid, grids[key], int(c["n_pairs"]), int(c["n_used"]),
                                     int(c["n_multi_token"]), int(c["n_unknown"]))
    return out
