"""The tuned lens trained on the KL divergence (query/analyses/tuned_lens.py), against an independent loop.

The reference loop below is written from the method's description only: one ``nn.Linear`` per
residual index, zero-initialised and added to the state, the store's final norm and unembedding
recomputed here from the raw stored weights, ``F.kl_div`` for KL(final || lens), the summed loss
back-propagated once, the gradient clipped to norm 1, ``torch.optim.Adam`` (AMSGrad) or Nesterov
SGD, and a linear learning-rate decay.  Training rows are the stored residual streams of a tiny
model's store (helpers.build_store).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from helpers import FIXTURES

import actstore
from actstore.query.analyses.lens import (
    FinalReadout,
    LensError,
    TunedLens,
    lens_study,
    read_objects,
    stored_residuals,
)
from actstore.query.analyses.tuned_lens import (
    TrainConfig,
    kl_per_index,
    lr_factor,
    rows_from_padded,
    train_tuned_lens,
)

KNOWN = f"known1000:{FIXTURES / 'known_1000' / 'known_1000.json'}"  # invented facts
STORE_KW: dict[str, Any] = {"dataset": KNOWN, "limit": 20}

pytestmark = pytest.mark.usefixtures("one_thread")


def _store_rows(store_factory: Callable[..., Path], arch: str) -> tuple[Any, np.ndarray]:
    store = actstore.open(store_factory(arch, **STORE_KW))
    ids = store.sql("SELECT example_id FROM targets ORDER BY 1").column("example_id").to_numpy()
    return store, stored_residuals(store, ids)[0]


def _reference_logits(store: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """Final norm + unembedding from the raw stored weights (llama: RMSNorm, gpt2: LayerNorm)."""
    attrs = store.weight_attrs
    assert not store.has_weight("unembed_bias") and not attrs.get("final_logit_softcapping")
    w = torch.from_numpy(np.array(store.weight("final_norm_weight"), dtype=np.float32))
    U = torch.from_numpy(np.array(store.weight("unembed"), dtype=np.float32))
    eps = float(attrs["final_norm_eps"])
    if attrs["final_norm"] == "layernorm":
        bias = torch.from_numpy(np.array(store.weight("final_norm_bias"), dtype=np.float32))
        return lambda h: F.layer_norm(h, (h.shape[-1],), w, bias, eps) @ U.T
    assert attrs["final_norm"] == "rmsnorm"
    return lambda h: (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * w) @ U.T


def _reference_training(
    logits: Callable[[torch.Tensor], torch.Tensor], resid: np.ndarray, optimizer: str, steps: int
) -> tuple[list[torch.nn.Linear], list[float], float]:
    x = torch.as_tensor(resid, dtype=torch.float32)
    L, d = x.shape[1] - 1, x.shape[2]
    translators = [torch.nn.Linear(d, d) for _ in range(L)]
    for t in translators:
        torch.nn.init.zeros_(t.weight)
        torch.nn.init.zeros_(t.bias)
    params = [p for t in translators for p in t.parameters()]
    opt: torch.optim.Optimizer
    if optimizer == "adam":
        opt = torch.optim.Adam(params, lr=1e-3, betas=(0.9, 0.999), weight_decay=1e-3, amsgrad=True)
    else:
        opt = torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / steps)
    with torch.no_grad():
        final = torch.log_softmax(logits(x[:, L]), dim=-1)
    history, first_norm = [], 0.0
    for step in range(steps):
        opt.zero_grad()
        loss = sum(
            F.kl_div(
                torch.log_softmax(logits(x[:, i] + translators[i](x[:, i])), dim=-1),
                final,
                log_target=True,
                reduction="batchmean",
            )
            for i in range(L)
        )
        assert isinstance(loss, torch.Tensor)
        loss.backward()
        norm = float(torch.nn.utils.clip_grad_norm_(params, 1.0))
        first_norm = norm if step == 0 else first_norm
        opt.step()
        sched.step()
        history.append(float(loss.detach()))
    return translators, history, first_norm


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _synthetic(seed: int = 0) -> tuple[FinalReadout, Callable[[torch.Tensor], torch.Tensor], np.ndarray]:
    """Peaked output distributions (a large unembedding), so that the gradient norm exceeds the clip."""
    g = torch.Generator().manual_seed(seed)
    d, V = 16, 50
    w, U = 1 + 0.1 * torch.randn(d, generator=g), 4 * torch.randn(V, d, generator=g)
    resid = torch.randn(40, 4, d, generator=g).cumsum(1).numpy()

    def logits(h: torch.Tensor) -> torch.Tensor:
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * w) @ U.T

    return FinalReadout("rmsnorm", 1e-6, w, None, U, None, None), logits, resid


@pytest.mark.parametrize(
    ("data", "optimizer"),
    [("llama", "adam"), ("llama", "sgd"), ("gpt2", "adam"), ("synthetic", "adam"), ("synthetic", "sgd")],
)
def test_translators_match_an_independent_gradient_descent_loop(
    data: str, optimizer: str, store_factory: Callable[..., Path]
) -> None:
    if data == "synthetic":
        readout, logits, resid = _synthetic()
    else:
        store, resid = _store_rows(store_factory, data)
        readout, logits = FinalReadout.from_store(store), _reference_logits(store)
    # SGD at lr 0.1 on the peaked synthetic data amplifies rounding after ~60 steps (the reference
    # loop in float32 and float64 then differ by 1e-3 themselves): compare 40 steps there.
    steps = 40 if data == "synthetic" else 120
    lens = train_tuned_lens(readout, resid, TrainConfig(optimizer=optimizer, steps=steps))
    ref, history, first_norm = _reference_training(logits, resid, optimizer, steps)
    if data == "synthetic":
        assert first_norm > 2  # the clip is active here (the tiny models' gradients stay below 1)
    L = resid.shape[1] - 1
    assert lens.D.shape == (L, resid.shape[2], resid.shape[2]) and lens.method == optimizer
    for i, t in enumerate(ref):
        W = t.weight.detach().T  # nn.Linear computes h W^T: our D is W^T
        assert float(W.norm()) > 1e-2  # the translators moved away from the identity ...
        assert _rel(lens.D[i], W) < 1e-5, (i, _rel(lens.D[i], W))  # ... the same way (measured ~1e-7)
        assert _rel(lens.b[i], t.bias.detach()) < 1e-5, (i, _rel(lens.b[i], t.bias.detach()))
    np.testing.assert_allclose(lens.info["loss_per_step"], history, rtol=1e-3, atol=1e-6)  # float32 KL near 0
    assert history[-1] < history[0]
    assert lens.info["rows"] == resid.shape[0] and lens.info["config"]["lr"] == (
        1e-3 if optimizer == "adam" else 0.1
    )


def test_kl_falls_below_the_logit_lens(store_factory: Callable[..., Path]) -> None:
    store, resid = _store_rows(store_factory, "llama")
    readout = FinalReadout.from_store(store)
    calls: list[tuple[int, float]] = []
    lens = train_tuned_lens(readout, resid, progress=lambda step, loss: calls.append((step, loss)))
    assert calls == list(enumerate(lens.info["loss_per_step"], start=1)) and len(calls) == 250
    identity = kl_per_index(readout, resid)
    tuned = kl_per_index(readout, resid, lens)
    L = resid.shape[1] - 1
    assert identity[L] == 0 and tuned[L] == 0  # index L: the model's output itself
    assert (identity[:L] > 0).all() and (tuned[:L] < 0.7 * identity[:L]).all(), (identity, tuned)
    # kl_per_index against a direct computation for one index
    logits = _reference_logits(store)
    x = torch.as_tensor(resid)
    h = x[:, 0] + x[:, 0] @ lens.D[0] + lens.b[0]
    direct = F.kl_div(
        torch.log_softmax(logits(h).double(), -1),
        torch.log_softmax(logits(x[:, L]).double(), -1),
        log_target=True,
        reduction="batchmean",
    )
    assert tuned[0] == pytest.approx(float(direct), rel=1e-6)
    assert (
        lens.info["loss_last"] < lens.info["loss_first"] == pytest.approx(float(identity[:L].sum()), rel=1e-5)
    )


def test_an_index_that_already_gives_the_output_keeps_the_identity(
    store_factory: Callable[..., Path],
) -> None:
    """Where the residual already is the last one, KL = 0 at the identity and its gradient is 0 up to
    rounding: the translator stays at the identity (Adam rescales rounding-level gradients by
    g / (|g| + eps), so its drift is small but not zero; SGD's is of the order of the rounding)."""
    store, resid = _store_rows(store_factory, "llama")
    readout = FinalReadout.from_store(store)
    L = resid.shape[1] - 1
    copy = resid.copy()
    copy[:, L - 1] = copy[:, L]
    for optimizer, bound in (("adam", 1e-2), ("sgd", 1e-5)):
        lens = train_tuned_lens(readout, copy, TrainConfig(optimizer=optimizer, steps=60))
        moved = float(lens.D[0].norm())
        assert moved > 1e-2  # the other index did move
        assert float(lens.D[L - 1].norm()) < bound * moved and float(lens.b[L - 1].norm()) < bound * moved
        assert kl_per_index(readout, copy, lens)[L - 1] < 1e-6  # logit lens at index 0: ~1e-3


def test_masks_minibatches_and_seeds(store_factory: Callable[..., Path]) -> None:
    store, resid = _store_rows(store_factory, "llama")
    readout = FinalReadout.from_store(store)
    n = resid.shape[0]
    keep = np.arange(n) % 3 != 0
    cfg = TrainConfig(steps=30)
    masked = train_tuned_lens(readout, resid, cfg, mask=keep)
    subset = train_tuned_lens(readout, resid[keep], cfg)
    torch.testing.assert_close(masked.D, subset.D, rtol=0, atol=0)
    # padded sequences: rows_from_padded drops the padding (rows filled with garbage)
    padded = np.full((2, n, *resid.shape[1:]), 1e6, dtype=np.float32)
    padded[0, :5], padded[1, : n - 5] = resid[:5], resid[5:]
    attn = np.zeros((2, n), dtype=bool)
    attn[0, :5], attn[1, : n - 5] = True, True
    torch.testing.assert_close(rows_from_padded(padded, attn), torch.as_tensor(resid))
    # chunking rows changes nothing but summation order
    chunked = train_tuned_lens(readout, resid, TrainConfig(steps=30, chunk_elements=3 * 512))
    full = train_tuned_lens(readout, resid, cfg)
    # Two float32 summation orders, then 30 Adam steps that carry their last bits forward: a tolerance
    # relative to the values' size (docs/testing.md, "Tolerances"); under the plain CPU kernels one
    # element of 8,192 differed by 2.3e-6 against an absolute 1e-6.
    scale = float(full.D.abs().max())
    torch.testing.assert_close(chunked.D, full.D, rtol=1e-4, atol=1e-4 * scale)
    # mini-batches: deterministic with the seed, different across seeds
    a = train_tuned_lens(readout, resid, TrainConfig(steps=30, batch=4, seed=1))
    b = train_tuned_lens(readout, resid, TrainConfig(steps=30, batch=4, seed=1))
    c = train_tuned_lens(readout, resid, TrainConfig(steps=30, batch=4, seed=2))
    torch.testing.assert_close(a.D, b.D, rtol=0, atol=0)
    assert _rel(a.D[0], c.D[0]) > 1e-3


def test_schedule_and_bad_settings() -> None:
    assert [lr_factor(s, 4, 0) for s in range(4)] == [1.0, 0.75, 0.5, 0.25]
    assert [lr_factor(s, 6, 2) for s in range(6)] == pytest.approx([1 / 3, 2 / 3, 1.0, 0.75, 0.5, 0.25])
    resid = np.zeros((3, 2, 4), dtype=np.float32)
    readout = FinalReadout("rmsnorm", 1e-6, torch.ones(4), None, torch.eye(4), None, None)
    for cfg, msg in (
        (TrainConfig(optimizer="lbfgs"), "unknown tuned-lens optimizer"),
        (TrainConfig(steps=0), "at least 1 training step"),
        (TrainConfig(batch=0), "at least 1 row"),
        (TrainConfig(lr=-1.0), "must be positive"),
        (TrainConfig(warmup=250), "warm-up"),
    ):
        with pytest.raises(LensError, match=msg):
            train_tuned_lens(readout, resid, cfg)
    with pytest.raises(LensError, match="no training rows"):
        train_tuned_lens(readout, resid, mask=np.zeros(3, dtype=bool))
    bad = resid.copy()
    bad[0, 0, 0] = np.nan
    with pytest.raises(LensError, match="non-finite"):
        train_tuned_lens(readout, bad)
    with pytest.raises(LensError, match="do not match"):
        rows_from_padded(np.zeros((2, 3, 2, 4)), np.ones((2, 2)))


def test_lens_study_methods(store_factory: Callable[..., Path]) -> None:
    store = actstore.open(store_factory("llama", **STORE_KW))
    ids = store.sql("SELECT example_id FROM targets ORDER BY 1").column("example_id").to_numpy()
    train, held = ids[ids % 2 == 0], ids[ids % 2 == 1]
    readout = FinalReadout.from_store(store)
    study, lens = lens_study(store, held, train, method="sgd", train_config=TrainConfig(steps=40))
    assert lens is not None and lens.method == "sgd" and study.method == "sgd" and study.kl_tuned is not None
    # the held-out reading is the trained translators' reading of the held-out rows
    resid, obj, _ = stored_residuals(store, held)
    again = train_tuned_lens(
        readout, stored_residuals(store, train)[0], TrainConfig(optimizer="sgd", steps=40)
    )
    np.testing.assert_allclose(
        study.tuned.prob if study.tuned else None,
        read_objects(readout, again.translate(resid), obj).prob,
        rtol=1e-5,
    )
    np.testing.assert_allclose(study.kl_tuned, kl_per_index(readout, resid, again), rtol=1e-5)
    assert {"logit_kl", "tuned_kl"} <= set(study.summary()[0])
    ridge_study, ridge = lens_study(store, held, train, method="ridge")
    assert ridge is not None and ridge.method == "ridge" and len(ridge_study.alphas) == resid.shape[1] - 1
    torch.testing.assert_close(ridge.D, TunedLens.fit_ridge(stored_residuals(store, train)[0]).D)
    with pytest.raises(LensError, match="unknown tuned-lens method"):
        lens_study(store, held, train, method="newton")


def test_cli_lens_methods(store_factory: Callable[..., Path]) -> None:
    from actstore.cli import main

    path = store_factory("llama", **STORE_KW)
    runner = CliRunner()
    outs = {}
    for method in ("adam", "ridge"):
        res = runner.invoke(
            main,
            [
                "lens",
                str(path),
                "--json",
                "--train-fraction",
                "0.6",
                "--tuned",
                method,
                "--tuned-steps",
                "50",
            ],
        )
        assert res.exit_code == 0, res.output
        outs[method] = json.loads(res.stdout)
    adam, ridge = outs["adam"], outs["ridge"]
    assert adam["tuned_method"] == "adam" and adam["tuned_config"]["steps"] == 50
    assert adam["tuned_config"]["optimizer"] == "adam" and adam["tuned_config"]["lr"] == 1e-3
    tr = adam["tuned_training"]
    L = len(adam["per_index"]) - 1
    assert all(t < i for t, i in zip(tr["train_kl_tuned"][:L], tr["train_kl_logit"][:L]))
    assert (
        ridge["tuned_method"] == "ridge" and len(ridge["ridge_alphas"]) == L and ridge["tuned_training"] == {}
    )
    store = actstore.open(path)
    for method, out in outs.items():
        cfg = (
            store.sql(f"SELECT config FROM runs WHERE run_id = '{out['run_id']}'").column("config")[0].as_py()
        )
        assert json.loads(cfg)["tuned"] == method
    text = runner.invoke(
        main, ["lens", str(path), "--train-fraction", "0.6", "--tuned-steps", "5", "--no-save"]
    )
    assert text.exit_code == 0 and "tuned lens: adam, 5 steps" in text.output and "tuned KL" in text.output
    assert "tuned lens (adam): step 5/5" in text.output  # progress on stderr
    bad = runner.invoke(main, ["lens", str(path), "--tuned", "newton"])
    assert bad.exit_code != 0 and "newton" in bad.output
    bad = runner.invoke(main, ["lens", str(path), "--tuned-steps", "0"])
    assert bad.exit_code == 2 and "'--tuned-steps': 0 is not in the range x>=1" in bad.output
