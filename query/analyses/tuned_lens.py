"""The tuned lens of Belrose et al. (2023): affine translators trained on the KL divergence.

For each residual index i < L (0 = embeddings, i = output of layer i-1, before the final norm)
a translator maps the state into the last layer's coordinates, identity-initialised:

    h -> h + h A_i + b_i          A_i = 0, b_i = 0 at the start

and is trained so that the final norm and unembedding read the translated state as the model
reads its own last residual: the loss is the sum over indices of the mean over rows of

    KL( softmax(U norm(h_L)) || softmax(U norm(h_i + h_i A_i + b_i)) )

(``FinalReadout.logits``: the store's final norm, unembedding, its bias and Gemma's logit
soft-capping).  Index L has no translator (the lens is the model's output there).

Training, as the ``tuned-lens`` package's ``train`` command (version 0.2.0, read from its
source) does it: every step the per-index losses of one batch are back-propagated, the
gradient of all translators together is clipped to norm 1, then

- ``adam`` (our default): Adam with AMSGrad, betas (0.9, 0.999), learning rate 1e-3, weight
  decay 1e-3 (L2, added to the gradient), no warm-up (the package intends 20% warm-up for Adam
  but its 0.2.0 code compares an enum with a string and uses none), linear decay to 0;
- ``sgd`` (the package's default): SGD with Nesterov momentum 0.9, learning rate 0.1 (the
  package's "1.0" times 1 - momentum), weight decay 1e-3, linear decay to 0;

250 steps.  The package takes 2^18 tokens per step from a text corpus; here a row is a stored
residual stream (a fact's last token), and a step takes ``batch`` rows (default 2^18, i.e.
every training row when there are fewer: full-batch gradient descent) drawn from seeded
permutations of the rows, so a run is a function of its data and seed.  Rows are processed in
chunks of ``chunk_elements / V`` so that memory stays bounded for large vocabularies.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from actstore.core.errors import LensError
from actstore.query.analyses.readout import FinalReadout, TunedLens

OPTIMIZERS = ("adam", "sgd")
DEFAULT_LR = {"adam": 1e-3, "sgd": 0.1}


@dataclass(frozen=True)
class TrainConfig:
    """Hyperparameters of the translators' training (defaults: the package's, see the module)."""

    optimizer: str = "adam"  # adam | sgd
    steps: int = 250
    lr: float | None = None  # None: 1e-3 for adam, 0.1 for sgd
    momentum: float = 0.9  # SGD momentum (Nesterov) or Adam's beta1
    weight_decay: float = 1e-3
    warmup: int = 0  # steps of linear warm-up before the linear decay
    batch: int = 2**18  # rows per step (every row when there are fewer)
    clip: float = 1.0  # max norm of the gradient of all translators together (0: no clipping)
    seed: int = 0
    chunk_elements: int = 2**24  # rows x vocabulary per forward chunk (memory bound)
    device: str = "cpu"  # cpu | cuda | auto

    def check(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise LensError(
                f"unknown tuned-lens optimizer {self.optimizer!r} (one of {', '.join(OPTIMIZERS)})"
            )
        if self.steps < 1:
            raise LensError(f"the tuned lens needs at least 1 training step, not {self.steps}")
        if self.batch < 1:
            raise LensError(f"the tuned lens batch must be at least 1 row, not {self.batch}")
        if not 0 <= self.warmup < self.steps:
            raise LensError(f"warm-up steps must be in [0, steps), not {self.warmup}")
        if self.lr is not None and not self.lr > 0:
            raise LensError(f"the learning rate must be positive, not {self.lr}")

    @property
    def learning_rate(self) -> float:
        return float(self.lr if self.lr is not None else DEFAULT_LR[self.optimizer])

    def describe(self) -> dict[str, Any]:
        """The configuration as recorded with a run (the learning rate resolved)."""
        return asdict(self) | {"lr": self.learning_rate}


def lr_factor(step: int, steps: int, warmup: int) -> float:
    """Multiplier of the learning rate at ``step`` (0-based): linear warm-up, then linear decay to 0."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    return (steps - step) / (steps - warmup)


def rows_from_padded(hidden: np.ndarray | torch.Tensor, mask: np.ndarray | torch.Tensor) -> torch.Tensor:
    """[B, T, K, d] states of padded sequences and their [B, T] attention mask -> [N, K, d] real rows."""
    h = torch.as_tensor(hidden)
    m = torch.as_tensor(mask).bool()
    if h.ndim != 4 or m.shape != h.shape[:2]:
        raise LensError(
            f"states {tuple(h.shape)} and mask {tuple(m.shape)} do not match ([B, T, K, d] and [B, T])"
        )
    return h[m]


def _rows(resid: np.ndarray | torch.Tensor, mask: np.ndarray | torch.Tensor | None) -> torch.Tensor:
    x = torch.as_tensor(resid, dtype=torch.float32)
    if x.ndim != 3 or x.shape[1] < 2:
        raise LensError(f"residual rows must be [n, L+1, d] with L >= 1, not {tuple(x.shape)}")
    if mask is not None:
        m = torch.as_tensor(mask).bool()
        if m.shape != x.shape[:1]:
            raise LensError(f"row mask {tuple(m.shape)} does not match {x.shape[0]} rows")
        x = x[m]
    if x.shape[0] < 1:
        raise LensError("the tuned lens has no training rows")
    if not torch.isfinite(x).all():
        raise LensError("the training residuals contain non-finite values")
    return x


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _readout_on(readout: FinalReadout, device: torch.device) -> FinalReadout:
    if device.type == "cpu":
        return readout

    def mv(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device)

    return FinalReadout(
        readout.kind,
        readout.eps,
        readout.weight.to(device),
        mv(readout.bias),
        readout.unembed.to(device),
        mv(readout.unembed_bias),
        readout.softcap,
    )


def _batches(n: int, batch: int, steps: int, seed: int) -> Iterator[torch.Tensor]:
    """Row indices for each step: all rows, or consecutive slices of seeded permutations."""
    if batch >= n:
        every = torch.arange(n)
        for _ in range(steps):
            yield every
        return
    gen = torch.Generator().manual_seed(seed)
    perm, pos = torch.randperm(n, generator=gen), 0
    for _ in range(steps):
        take: list[torch.Tensor] = []
        need = batch
        while need:
            if pos == n:
                perm, pos = torch.randperm(n, generator=gen), 0
            k = min(need, n - pos)
            take.append(perm[pos : pos + k])
            pos += k
            need -= k
        yield torch.cat(take)


def train_tuned_lens(
    readout: FinalReadout,
    resid: np.ndarray | torch.Tensor,
    config: TrainConfig | None = None,
    mask: np.ndarray | torch.Tensor | None = None,
    progress: Callable[[int, float], None] | None = None,
) -> TunedLens:
    """Translators for indices 0..L-1 trained on rows ``resid`` [n, L+1, d] (``mask`` [n]: rows to use).

    ``progress(step, loss)`` is called after every step (loss: the sum over indices of the mean KL)."""
    started = time.time()
    cfg = config or TrainConfig()
    cfg.check()
    x = _rows(resid, mask)
    n, K, d = x.shape
    L = K - 1
    dev = _device(cfg.device)
    ro = _readout_on(readout, dev)
    A = [torch.zeros((d, d), device=dev, requires_grad=True) for _ in range(L)]
    b = [torch.zeros(d, device=dev, requires_grad=True) for _ in range(L)]
    params = [p for pair in zip(A, b) for p in pair]
    opt: torch.optim.Optimizer
    if cfg.optimizer == "adam":
        opt = torch.optim.Adam(
            params,
            lr=cfg.learning_rate,
            betas=(cfg.momentum, 0.999),
            weight_decay=cfg.weight_decay,
            amsgrad=True,
        )
    else:
        opt = torch.optim.SGD(
            params, lr=cfg.learning_rate, momentum=cfg.momentum, nesterov=True, weight_decay=cfg.weight_decay
        )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg.steps, cfg.warmup))
    V = ro.unembed.shape[0]
    chunk = max(1, cfg.chunk_elements // V)
    losses: list[float] = []
    for rows in _batches(n, cfg.batch, cfg.steps, cfg.seed):
        opt.zero_grad(set_to_none=False)
        B = rows.numel()
        step_loss = 0.0
        for lo in range(0, B, chunk):
            h = x[rows[lo : lo + chunk]].to(dev)
            with torch.no_grad():
                target = torch.log_softmax(ro.logits(h[:, L]), dim=-1)
                p = target.exp()
            for i in range(L):
                hi = h[:, i]
                logq = torch.log_softmax(ro.logits(hi + hi @ A[i] + b[i]), dim=-1)
                loss = (p * (target - logq)).sum() / B
                loss.backward()
                step_loss += float(loss.detach())
        if cfg.clip > 0:
            torch.nn.utils.clip_grad_norm_(params, cfg.clip)
        opt.step()
        sched.step()
        losses.append(step_loss)
        if progress is not None:
            progress(len(losses), step_loss)
    D = torch.stack([a.detach() for a in A]).cpu()
    bias = torch.stack([c.detach() for c in b]).cpu()
    info = {
        "config": cfg.describe(),
        "rows": int(n),
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "loss_per_step": losses,
        "seconds": round(time.time() - started, 2),
    }
    return TunedLens(D, bias, method=cfg.optimizer, info=info)


def kl_per_index(
    readout: FinalReadout,
    resid: np.ndarray | torch.Tensor,
    lens: TunedLens | None = None,
    chunk_elements: int = 2**22,
) -> np.ndarray:
    """Mean over rows of KL(final distribution || lens distribution) at each index [K] (nats).

    ``lens`` None: the logit lens (index L gives 0)."""
    x = torch.as_tensor(resid, dtype=torch.float32)
    n, K, _ = x.shape
    rows = max(1, chunk_elements // readout.unembed.shape[0])
    total = torch.zeros(K, dtype=torch.float64)
    with torch.no_grad():
        for lo in range(0, n, rows):
            h = x[lo : lo + rows]
            target = torch.log_softmax(readout.logits(h[:, -1]).double(), dim=-1)
            p = target.exp()
            for k in range(K):
                hk = h[:, k] if lens is None else lens.translate_index(h[:, k], k)
                logq = torch.log_softmax(readout.logits(hk).double(), dim=-1)
                total[k] += float((p * (target - logq)).sum())
    return (total / max(n, 1)).numpy()


__all__ = ["TrainConfig", "train_tuned_lens", "kl_per_index", "rows_from_padded", "lr_factor", "OPTIMIZERS"]
