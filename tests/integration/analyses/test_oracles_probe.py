"""Independent oracles for the probe pipeline: RelSpec selection, standardisation, the contrast,
HeadScore (per prediction and the stored per-(layer, head) table) and TokenScore.

The reference here is written in the test with numpy (selection, standardisation, the grouping
of dW * x' by the feature layout) and plain torch (autograd of the contrast logit, an
``nn.Linear`` trained by ``torch.optim.Adam``); it calls none of actstore.query.analyses.relspec,
actstore.query.analyses.attribution or the unit bookkeeping of actstore.query.analyses.probe.  The trained probe itself (W, b) is
recorded from the library's trainer by a spy, so that the attribution is checked exactly for
the probe that made the predictions; the trainer is checked separately against the plain loop.

Tolerances are relative to the size of the compared values (never an absolute 1e-4 on numbers
that may themselves be ~1e-4).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import actstore
import actstore.query.analyses.probe as probe_mod
from actstore.jobs.probe import record_probe
from actstore.query.analyses.attribution import contrast_coefficients
from actstore.query.analyses.explain import explain_example, stored_weights
from actstore.query.analyses.probe import ProbeConfig, ProbeOutput, run_probe
from actstore.query.analyses.relspec import gather_standardized, select_features

pytestmark = pytest.mark.usefixtures("one_thread")

POOLED_EPS = 1e-6  # the documented floor of the pooled variance, relative to the feature's support variance
RTOL = 1e-4


def close(got: Any, want: Any, rtol: float = RTOL, scale: float | None = None) -> bool:
    """|got - want| <= rtol * scale everywhere; ``scale`` defaults to the largest |want|."""
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    s = float(np.abs(want).max()) if scale is None else scale
    assert s > 0, "comparing against all zeros would check nothing"
    return bool(np.abs(got - want).max() <= rtol * s)


# ------------------------------------------------------------------------------------ numpy reference
TIE = 1e-4  # |d| this close (relative) to a relation's cut may fall either side in float32


@dataclass(frozen=True)
class NpSelection:
    index: np.ndarray  # selected features, ascending
    mean: np.ndarray  # support mean of each selected feature
    std: np.ndarray  # support population std (1 for constant features)


def np_relspec(
    xs: np.ndarray, n_way: int, k_shot: int, top_k: int, library: np.ndarray | None = None
) -> NpSelection:
    """RelSpec as SPEC section 5 and query/analyses/relspec.py define it, one relation at a time: Cohen's d of
    relation c against the rest of the support set (pooled within-group variance, floored at
    POOLED_EPS times the feature's variance), top ``top_k`` |d| per relation, union.

    Features whose |d| is within TIE of a relation's cut are ties that rounding may break either
    way: with ``library`` (the indices the library chose) given, its choice is accepted among
    those ties only; every other feature must be chosen exactly as here."""
    x = xs.astype(np.float64)
    S, F = x.shape
    var = x.var(0)
    sure: set[int] = set()
    may: set[int] = set()
    for c in range(n_way):
        mine = np.zeros(S, dtype=bool)
        mine[c * k_shot : (c + 1) * k_shot] = True
        a, rest = x[mine], x[~mine]
        ss = ((a - a.mean(0)) ** 2).sum(0) + ((rest - rest.mean(0)) ** 2).sum(0)
        d = np.abs(a.mean(0) - rest.mean(0)) / np.sqrt(ss / (S - 2) + POOLED_EPS * var + 1e-30)
        top = set(np.argsort(-d, kind="stable")[:top_k].tolist())
        cut = min(d[list(top)])
        near = set(np.flatnonzero(np.abs(d - cut) <= TIE * cut).tolist())
        if near <= top:  # the cut is clear: this relation's top k is certain
            sure |= top
        else:
            sure |= top - near
            may |= near
    if library is not None:
        lib = set(library.tolist())
        assert sure <= lib <= sure | may, f"selection differs beyond ties: {sorted(lib ^ sure)}"
        chosen = lib
    else:
        assert not may - sure, f"near-tie at the cut: {sorted(may - sure)}"
        chosen = sure
    index = np.array(sorted(chosen))
    std = x[:, index].std(0)
    return NpSelection(index, x[:, index].mean(0), np.where(std > 0, std, 1.0))


def np_standardize(x: np.ndarray, s: NpSelection) -> np.ndarray:
    return (x[:, s.index].astype(np.float64) - s.mean) / s.std


def np_contrast(probs: np.ndarray, pred: int) -> np.ndarray:
    """onehot(c_hat) - pi', pi' = pi renormalised over the competitors: a loop over classes."""
    others = sum(float(probs[c]) for c in range(probs.size) if c != pred)
    return np.array([1.0 if c == pred else -float(probs[c]) / others for c in range(probs.size)])


def autograd_contrast_direction(
    x: np.ndarray, W: np.ndarray, b: np.ndarray
) -> tuple[np.ndarray, int, np.ndarray]:
    """dW = d/dx' [logit_c_hat - sum_{c != c_hat} pi'_c logit_c] (pi' held fixed), by autograd."""
    xt = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    logits = xt @ torch.tensor(W, dtype=torch.float64) + torch.tensor(b, dtype=torch.float64)
    p = torch.softmax(logits, -1).detach()
    pred = int(p.argmax())
    comp = p.clone()
    comp[pred] = 0
    contrast = logits[pred] - (comp / comp.sum() * logits).sum()
    (grad,) = torch.autograd.grad(contrast, xt)
    return grad.numpy(), pred, p.numpy()


def brute_force_units(contrib: np.ndarray, index: np.ndarray, layout: tuple[int, ...]) -> np.ndarray:
    """Group per-feature contributions (``contrib`` for the features ``index``) into units by the
    feature layout: [L', H', d] -> per (layer, head); [L', d] -> per layer.  One feature at a time."""
    units = np.zeros(layout[:-1])
    d = layout[-1]
    for value, f in zip(contrib, index.tolist()):
        if len(layout) == 3:
            layer, rem = divmod(f, layout[1] * d)
            units[layer, rem // d] += value
        else:
            units[f // d] += value
    return units


def plain_train(
    xs: np.ndarray, y: np.ndarray, n_classes: int, epochs: int, lr: float
) -> tuple[np.ndarray, np.ndarray]:
    """nn.Linear from zeros, cross-entropy, torch.optim.Adam, full batch."""
    lin = torch.nn.Linear(xs.shape[1], n_classes)
    torch.nn.init.zeros_(lin.weight)
    torch.nn.init.zeros_(lin.bias)
    opt = torch.optim.Adam(lin.parameters(), lr=lr)
    xt, yt = torch.tensor(xs, dtype=torch.float32), torch.tensor(y)
    for _ in range(epochs):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(lin(xt), yt).backward()
        opt.step()
    return lin.weight.detach().numpy().T.astype(np.float64), lin.bias.detach().numpy().astype(np.float64)


# ------------------------------------------------------------------------------------ the library, observed
@dataclass
class Trained:
    xs: np.ndarray  # [S, width] the standardised support the trainer saw (padding columns 0)
    W: np.ndarray  # [width, C]
    b: np.ndarray  # [C]


@dataclass
class Spy:
    trained: list[Trained] = field(default_factory=list)
    selected: list[np.ndarray] = field(default_factory=list)  # feature indices RelSpec chose, per episode


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> Iterator[Spy]:
    """Records, episode by episode, what actstore.query.analyses.probe's trainer was given and returned, and which
    features its RelSpec call chose (only to settle exact float ties at a cut, see np_relspec)."""
    seen = Spy()
    real_train, real_select = probe_mod.train_batched, probe_mod.select_features

    def train(
        xs: torch.Tensor, y: torch.Tensor, n_classes: int, **kw: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        W, b = real_train(xs, y, n_classes, **kw)
        for e in range(xs.shape[0]):
            seen.trained.append(
                Trained(
                    xs[e].double().numpy().copy(), W[e].double().numpy().copy(), b[e].double().numpy().copy()
                )
            )
        return W, b

    def select(xs: torch.Tensor, n_way: int, k_shot: int, top_k: int) -> Any:
        sel = real_select(xs, n_way, k_shot, top_k)
        seen.selected.extend(sel.index[e][sel.valid[e]].numpy().copy() for e in range(xs.shape[0]))
        return sel

    monkeypatch.setattr(probe_mod, "train_batched", train)
    monkeypatch.setattr(probe_mod, "select_features", select)
    yield seen


@pytest.fixture(scope="module")
def store_paths(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """Tiny models (2 layers, 4 heads, d_mlp 128; Llama with GQA and no biases, GPT-2 with an output
    bias b_O), demo corpus: 6 relations x 6 prompts, float32; built on first use."""
    from helpers import BuildCache, build_store

    cache = BuildCache()

    def get(arch: str) -> Path:
        path: Path = cache.get_or_build(
            arch, lambda: build_store(tmp_path_factory.mktemp("probe-oracle") / arch, arch, limit=6)
        )
        return path

    return get


@pytest.fixture
def open_copy(store_paths: Callable[[str], Path], tmp_path: Path) -> Callable[[str], actstore.Store]:
    """A private copy of the architecture's store (the tests write result tables)."""

    def get(arch: str) -> actstore.Store:
        shutil.copytree(store_paths(arch), tmp_path / arch)
        return actstore.open(tmp_path / arch)

    return get


@dataclass
class EpisodeOracle:
    """Everything the reference derives for one episode."""

    sel: NpSelection
    xs: np.ndarray  # [S, m]
    xq: np.ndarray  # [Q, m]
    query_ids: np.ndarray  # [Q]
    gold: list[str]  # [Q] relation of each query
    probs: np.ndarray  # [Q, C] from the recorded probe on the reference inputs
    pred: np.ndarray  # [Q]
    dW: np.ndarray  # [Q, m] contrast direction
    units: np.ndarray  # [Q, *unit grid] head scores by brute-force grouping
    W: np.ndarray  # [m, C] the recorded probe


def reference_episodes(
    store: actstore.Store, cfg: ProbeConfig, out: ProbeOutput, spy: Spy
) -> tuple[list[EpisodeOracle], tuple[int, ...], np.ndarray]:
    """Re-derive every episode of ``out`` from the raw feature matrix, checking on the way that
    the library's trainer saw exactly the reference's standardised support set."""
    ep = out.episodes
    n, k, q = ep.n_way, ep.k_shot, ep.queries
    sel_all = store.select(cfg.where)
    feats = sel_all.features(cfg.kind, layers=cfg.layers, heads=cfg.heads, groups=cfg.groups)
    layout = tuple(feats.shape[1:])
    X = feats.reshape(feats.shape[0], -1).astype(np.float64)
    assert np.array_equal(sel_all.example_ids, out.example_ids)
    assert len(spy.trained) == len(spy.selected) == len(ep)
    y = np.repeat(np.arange(n), k)
    result = []
    for e in range(len(ep)):
        s = np_relspec(X[ep.support[e]], n, k, cfg.top_k, library=spy.selected[e])
        xs, xq = np_standardize(X[ep.support[e]], s), np_standardize(X[ep.query[e]], s)
        m = s.index.size
        t = spy.trained[e]
        # The library's standardised support = the reference's, column for column; padding stays 0.
        assert t.xs.shape[1] >= m and not t.xs[:, m:].any() and not t.W[m:].any()
        assert close(t.xs[:, :m], xs), f"episode {e}: standardised support differs from the reference"
        # The library's trainer against the plain loop on the reference inputs.
        W_ref, b_ref = plain_train(xs, y, n, cfg.epochs, cfg.lr)
        assert close(t.W[:m], W_ref, rtol=1e-3)
        W, b = t.W[:m], t.b
        dWs, preds, probs, units = [], [], [], []
        for qi in range(xq.shape[0]):
            g, pred, p = autograd_contrast_direction(xq[qi], W, b)
            assert close(g, W @ np_contrast(p, pred), rtol=1e-10)  # autograd and the class loop agree
            dWs.append(g)
            preds.append(pred)
            probs.append(p)
            units.append(brute_force_units(g * xq[qi], s.index, layout))
        p_ref = xq @ W_ref + b_ref
        margin = np.sort(p_ref, 1)
        clear = margin[:, -1] - margin[:, -2] > 0.05 * np.abs(p_ref).max()
        assert np.array_equal(
            p_ref.argmax(1)[clear], np.asarray(preds)[clear]
        )  # plain loop: same predictions
        gold = [ep.relations[ep.classes[e, c]] for c in np.repeat(np.arange(n), q)]
        result.append(
            EpisodeOracle(
                s,
                xs,
                xq,
                out.example_ids[ep.query[e]],
                gold,
                np.stack(probs),
                np.asarray(preds),
                np.stack(dWs),
                np.stack(units),
                W,
            )
        )
    return result, layout, X


def output_bias(arch: str) -> np.ndarray:
    """b_O [L, d_model] read from the tiny model's own output projections (zeros where it has none)."""
    from actstore.ingest.models.tiny import tiny_model

    model = tiny_model(arch).model
    if arch == "gpt2":
        projs = [b.attn.c_proj for b in model.transformer.h]
    else:
        projs = [b.self_attn.o_proj for b in model.model.layers]
    d = int(model.config.hidden_size)
    return np.stack([p.bias.detach().double().numpy() if p.bias is not None else np.zeros(d) for p in projs])


def unit_labels(store: actstore.Store, cfg: ProbeConfig, layout: tuple[int, ...]) -> list[tuple[int, int]]:
    """(layer, head) of each unit of the grid, in grid order; head -1 for per-layer kinds."""
    g = store.geometry
    layers = list(cfg.layers) if cfg.layers is not None else list(range(layout[0]))
    if len(layout) == 2:
        return [(layer, -1) for layer in layers]
    n_units = (cfg.groups or g.n_heads) if cfg.kind == "mlp_group" else g.n_heads
    heads = list(cfg.heads) if cfg.heads is not None else list(range(n_units))
    assert len(heads) == layout[1]
    return [(layer, h) for layer in layers for h in heads]


# ------------------------------------------------------------------------------------ selection, standardisation
def test_contrast_coefficients_equal_a_loop_over_classes() -> None:
    g = torch.Generator().manual_seed(3)
    for C in (2, 3, 5, 16):
        logits = torch.randn(20, C, generator=g, dtype=torch.float64) * 3
        probs = torch.softmax(logits, -1)
        for pred in (probs.argmax(-1), torch.randint(0, C, (20,), generator=g)):
            got = contrast_coefficients(probs, pred).numpy()
            want = np.stack([np_contrast(probs[i].numpy(), int(pred[i])) for i in range(20)])
            assert close(got, want, rtol=1e-12, scale=1.0)


def test_relspec_and_standardisation_equal_numpy_and_support_is_standardised() -> None:
    """select_features and gather_standardized against the numpy reference, on support sets whose
    features have very different scales and offsets (so a missing division shows)."""
    rng = np.random.default_rng(7)
    B, n, k, F, top_k = 3, 4, 3, 120, 6
    scale = np.exp(rng.uniform(-3, 3, F))
    base = rng.normal(0, 1, (B, n * k, F)) * scale + rng.normal(0, 20, F)
    for b in range(B):  # plant class signals of various sizes
        for c in range(n):
            base[b, c * k : (c + 1) * k, rng.choice(F, 5, replace=False)] += (
                rng.uniform(1, 4) * scale[:5].mean()
            )
    base[:, :, 11] = 4.5  # a constant feature
    xs = torch.tensor(base, dtype=torch.float32)
    sel = select_features(xs, n, k, top_k)
    z = gather_standardized(xs.reshape(-1, F), torch.arange(B * n * k).reshape(B, -1), sel).double().numpy()
    for b in range(B):
        ref = np_relspec(base[b].astype(np.float32), n, k, top_k)
        m = ref.index.size
        got = sel.index[b][sel.valid[b]].numpy()
        assert np.array_equal(got, ref.index)
        assert close(sel.mean[b][:m].numpy(), ref.mean, rtol=1e-5) and close(
            sel.std[b][:m].numpy(), ref.std, rtol=1e-5
        )
        assert close(z[b, :, :m], np_standardize(base[b].astype(np.float32), ref), rtol=1e-4)
        assert not z[b, :, m:].any()
        # The standardised support set: every selected feature has mean 0 and (population) std 1.
        # (float32 inputs whose offset is up to ~1000 times their spread: rounding ~1e-5 in std units)
        assert np.abs(z[b, :, :m].mean(0)).max() < 1e-3
        np.testing.assert_allclose(z[b, :, :m].std(0), 1.0, rtol=1e-3)


# ------------------------------------------------------------------------------------ the probe run
RUNS = {  # name: (tiny architecture, probe)
    "attn_head": ("llama", ProbeConfig(kind="attn_head")),
    "attn_head_subset": ("llama", ProbeConfig(kind="attn_head", layers=(1,), heads=(3, 1))),
    "mlp_group_3": ("llama", ProbeConfig(kind="mlp_group", groups=3)),  # d_mlp 128 = 43 + 43 + 42
    "attn": ("gpt2", ProbeConfig(kind="attn")),  # per-layer units; b_O != 0 enters the centering term
    "attn_entity": ("llama", ProbeConfig(kind="attn_entity", heads=(0, 2))),
}


def small(cfg: ProbeConfig, **kw: Any) -> ProbeConfig:
    from dataclasses import replace

    return replace(
        cfg,
        n_way=3,
        k_shot=3,
        queries=2,
        episodes=4,
        seeds=(5,),
        top_k=8,
        epochs=40,
        lr=1e-2,
        token_scores="all",
        threads=1,
        **kw,
    )


@pytest.mark.parametrize("name", list(RUNS))
def test_probe_run_equals_reference_pipeline_and_head_scores(name: str, open_copy: Any, spy: Spy) -> None:
    """Selection, standardisation, predictions, dW . x' per prediction, and the stored
    per-(layer, head) HeadScore table, against the reference."""
    arch, cfg = RUNS[name]
    cfg = small(cfg)
    store = open_copy(arch)
    out = run_probe(store, cfg)
    refs, layout, _ = reference_episodes(store, cfg, out, spy)
    for e, r in enumerate(refs):
        assert np.array_equal(out.pred[e], r.pred)
        assert close(out.prob[e], r.probs[np.arange(r.pred.size), r.pred])
        total = r.units.reshape(r.units.shape[0], -1).sum(1)  # dW . x'
        size = np.abs(r.dW * r.xq).sum(1).max()  # the size of the summed terms
        assert close(out.head_total[e], total, scale=size)
    # The stored table: per gold relation, the mean over its predictions of each unit's score.
    record_probe(store, out)
    labels = unit_labels(store, cfg, layout)
    sums: dict[str, np.ndarray] = {}
    counts: dict[str, int] = {}
    for r in refs:
        for qi, rel in enumerate(r.gold):
            sums[rel] = sums.get(rel, 0) + r.units[qi].reshape(-1)
            counts[rel] = counts.get(rel, 0) + 1
    rows = store.sql(
        f"SELECT relation_id, layer, head, score, n FROM head_scores WHERE run_id = '{out.run_id}'"
    ).to_pylist()
    assert len(rows) == len(sums) * len(labels)
    got = {(x["relation_id"], x["layer"], x["head"]): (x["score"], x["n"]) for x in rows}
    scale = max(float(np.abs(v / counts[k]).max()) for k, v in sums.items())
    for rel, v in sums.items():
        for (layer, head), want in zip(labels, v / counts[rel]):
            score, n_pred = got[rel, layer, head]
            assert n_pred == counts[rel]
            assert abs(score - want) <= RTOL * scale, (rel, layer, head, score, want)


@pytest.mark.parametrize("name", ["attn_head", "attn_entity", "attn"])
def test_token_scores_equal_materialised_per_token_contributions(name: str, open_copy: Any, spy: Spy) -> None:
    """TokenScore(j) = sum_m u_m [Delta_att(t, j)]_m with u = dW / sd (raw feature space), from the
    per-token contributions materialised by ``attn_head_token``; the centering term is
    sum_m u_m (offset_m - mu_m); token scores plus centering add up to dW . x'."""
    arch, cfg = RUNS[name]
    cfg = small(cfg)
    store = open_copy(arch)
    out = run_probe(store, cfg)
    refs, layout, _ = reference_episodes(store, cfg, out, spy)
    ep = out.episodes
    heads = None if cfg.kind == "attn" else cfg.heads
    b_O = output_bias(arch)
    assert cfg.kind != "attn" or np.abs(b_O).max() > 0
    rows = {(x["episode"], x["example_id"]): x for x in out.token_rows}
    assert len(out.token_rows) == len(ep) * ep.n_way * ep.queries
    for e, r in enumerate(refs):
        for qi, ex in enumerate(r.query_ids.tolist()):
            u = np.zeros(int(np.prod(layout)))
            u[r.sel.index] = r.dW[qi] / r.sel.std
            sel = store.select(f"example_id = {ex}")
            per_tok = sel.features("attn_head_token", heads=None if heads is None else list(heads))[
                0
            ]  # [L, H', S, d]
            if cfg.kind == "attn_entity":
                s0, s1 = (
                    store.sql(f"SELECT subject_start, subject_end FROM examples WHERE example_id = {ex}")
                    .to_pylist()[0]
                    .values()
                )
                keep = np.zeros(per_tok.shape[2])
                keep[s0:s1] = 1
                per_tok = per_tok * keep[None, None, :, None]
            if cfg.kind == "attn":
                per_tok = per_tok.sum(1)  # [L, S, d]: the layer's attention output, without b_O
                offset = b_O.reshape(-1)
                want_ts = np.einsum("lsd,ld->s", per_tok, u.reshape(layout))
            else:
                offset = np.zeros(u.size)
                want_ts = np.einsum("lhsd,lhd->s", per_tok, u.reshape(layout))
            want_cent = float((u[r.sel.index] * (offset[r.sel.index] - r.sel.mean)).sum())
            row = rows[int(ep.index[e]), ex]
            assert row["relation_id"] == r.gold[qi]
            assert row["predicted"] == ep.relations[ep.classes[e, r.pred[qi]]]
            got_ts = np.asarray(row["scores"])
            assert close(got_ts, want_ts), (e, qi)
            assert close(row["centering"], want_cent, scale=max(abs(want_cent), float(np.abs(want_ts).max())))
            total = float(r.units[qi].sum())
            terms = np.abs(r.dW[qi] * r.xq[qi]).sum()  # the size of the numbers that were summed
            assert abs(got_ts.sum() + row["centering"] - total) <= 1e-4 * terms, (e, qi)
            assert abs(row["head_score_total"] - total) <= 1e-4 * terms


@pytest.mark.parametrize("name", ["attn_head", "attn"])
def test_explain_example_equals_reference(name: str, open_copy: Any, spy: Spy) -> None:
    """The second reading of the contrast (explain_example re-trains one stored episode and
    attributes one query) against the same reference: head scores per unit, token scores per
    layer, centering per layer."""
    arch, cfg = RUNS[name]
    cfg = small(cfg)
    store = open_copy(arch)
    out = run_probe(store, cfg)
    record_probe(store, out)
    refs, layout, _ = reference_episodes(store, cfg, out, spy)
    labels = unit_labels(store, cfg, layout)
    ep = out.episodes
    # both ways of explaining: training the episode again, and reading the probe the run stored
    for e, stored in ((0, False), (len(ep) - 1, False), (0, True), (len(ep) - 1, True)):
        r = refs[e]
        wrong = np.flatnonzero(r.pred != ep.query_labels)
        qi = int(wrong[0]) if wrong.size else 0  # an error if there is one (what TokenScore is for)
        ex = int(r.query_ids[qi])
        spy.trained.clear()
        x = explain_example(
            store, out.run_id, ex, seed=int(ep.seed[e]), episode=int(ep.index[e]), stored=stored
        )
        m = r.sel.index.size
        again = spy.trained
        if stored:  # nothing trained; the stored probe is the reference's
            w = stored_weights(store, out.run_id, int(ep.seed[e]), int(ep.index[e]))
            assert not again and w is not None and np.array_equal(w["features"], r.sel.index)
            assert close(w["weight"], r.W)
        else:
            assert (
                len(again) == 1 and close(again[0].W[:m], r.W) and not again[0].W[m:].any()
            )  # the same probe
        assert x.predicted == ep.relations[ep.classes[e, r.pred[qi]]]
        assert abs(x.probability - r.probs[qi, r.pred[qi]]) <= 1e-4
        assert [(int(a), int(b)) for a, b in zip(x.unit_layer, x.unit_head)] == labels
        assert close(x.head_scores, r.units[qi].reshape(-1))
        # Per layer: token scores from the materialised contributions, centering from the support stats.
        u = np.zeros(int(np.prod(layout)))
        u[r.sel.index] = r.dW[qi] / r.sel.std
        per_tok = store.select(f"example_id = {ex}").features("attn_head_token")[0]  # [L, H, S, d]
        if cfg.kind == "attn":
            want = np.einsum("lhsd,ld->ls", per_tok, u.reshape(layout))
            offset = output_bias(arch).reshape(-1)
        else:
            want = np.einsum("lhsd,lhd->ls", per_tok, u.reshape(layout))
            offset = np.zeros(u.size)
        assert close(x.token_scores, want)
        cent = np.zeros(u.size)
        cent[r.sel.index] = u[r.sel.index] * (offset[r.sel.index] - r.sel.mean)
        want_cent = cent.reshape(layout[0], -1).sum(1)
        assert close(
            x.centering, want_cent, scale=float(np.abs(np.concatenate([want_cent, want.ravel()])).max())
        )
