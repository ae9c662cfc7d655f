"""What every lens shares: the stored final norm and unembedding (``FinalReadout``), object
probabilities and ranks read through it, and the affine translators of a tuned lens
(``TunedLens``, with the closed-form ridge fit).  :mod:`actstore.query.analyses.lens` (the study) and
:mod:`actstore.query.analyses.tuned_lens` (training on the KL) both build on this module; see
:mod:`actstore.query.analyses.lens` for the formulas.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from actstore.core.errors import LensError
from actstore.query.analyses.lens_methods import TUNED_METHODS as TUNED_METHODS  # named once, without torch

ALPHAS = (1e-3, 1e-2, 1e-1, 1.0, 10.0)


# ------------------------------------------------------------------------------------ readout


@dataclass
class FinalReadout:
    """The store's final norm and unembedding, as torch float32 tensors."""

    kind: str  # rmsnorm | layernorm
    eps: float
    weight: torch.Tensor  # [d] effective weight (Gemma's 1 + w folded in)
    bias: torch.Tensor | None
    unembed: torch.Tensor  # [V, d]
    unembed_bias: torch.Tensor | None
    softcap: float | None

    @classmethod
    def from_store(cls, store: Any) -> FinalReadout:
        attrs = store.weight_attrs

        def t(name: str) -> torch.Tensor | None:
            return (
                torch.from_numpy(store.weight(name)) if store.has_weight(name) or name == "unembed" else None
            )

        unembed = t("unembed")
        assert unembed is not None
        weight = t("final_norm_weight")
        if weight is None:
            raise LensError(f"{store.url}: no stored final norm weight")
        cap = attrs.get("final_logit_softcapping")
        return cls(
            str(attrs.get("final_norm", "rmsnorm")),
            float(attrs.get("final_norm_eps", 1e-6)),
            weight,
            t("final_norm_bias"),
            unembed,
            t("unembed_bias"),
            float(cap) if cap else None,
        )

    def norm(self, h: torch.Tensor) -> torch.Tensor:
        h = h.float()
        if self.kind == "layernorm":
            h = h - h.mean(-1, keepdim=True)
            out = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight
            return out + self.bias if self.bias is not None else out
        out = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight
        return out + self.bias if self.bias is not None else out

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """[..., d] residual states -> [..., V] logits."""
        out = self.norm(h) @ self.unembed.T
        if self.unembed_bias is not None:
            out = out + self.unembed_bias
        if self.softcap:
            out = torch.tanh(out / self.softcap) * self.softcap
        return out


@dataclass
class LensReading:
    """Per fact and residual index: the object's probability and rank, and the top token."""

    prob: np.ndarray  # [n, L+1]
    rank: np.ndarray  # [n, L+1] 0 = top
    top: np.ndarray  # [n, L+1] top token id


def read_objects(
    readout: FinalReadout, resid: np.ndarray | torch.Tensor, objects: np.ndarray, batch: int = 64
) -> LensReading:
    """Object probability/rank at every index of ``resid`` [n, K, d] for ``objects`` [n]."""
    x = torch.as_tensor(resid, dtype=torch.float32)
    n, K, _ = x.shape
    prob = np.zeros((n, K))
    rank = np.zeros((n, K), np.int64)
    top = np.zeros((n, K), np.int64)
    obj = torch.as_tensor(np.array(objects, dtype=np.int64))
    for i in range(0, n, batch):
        lg = readout.logits(x[i : i + batch])  # [b, K, V]
        logp = torch.log_softmax(lg.double(), dim=-1)
        o = obj[i : i + batch]
        lp = logp.gather(-1, o[:, None, None].expand(-1, K, 1))[..., 0]
        prob[i : i + batch] = lp.exp().numpy()
        rank[i : i + batch] = (logp > lp[..., None]).sum(-1).numpy()
        top[i : i + batch] = logp.argmax(-1).numpy()
    return LensReading(prob, rank, top)


# ------------------------------------------------------------------------------------ tuned lens


@dataclass
class TunedLens:
    """Affine translators h -> h + h D_i + b_i, one per residual index 0..L-1 (index L: identity)."""

    D: torch.Tensor  # [L, d, d]
    b: torch.Tensor  # [L, d]
    alphas: list[float] = field(default_factory=list)  # ridge only: the chosen alpha per index
    method: str = (
        "ridge"  # adam | sgd (trained on the KL, actstore.query.analyses.tuned_lens) | ridge (closed form)
    )
    info: dict[str, Any] = field(default_factory=dict)  # training record (config, losses)

    def translate(self, resid: np.ndarray | torch.Tensor) -> torch.Tensor:
        """[n, K, d] with K = L+1 (or fewer leading indices) -> translated states."""
        x = torch.as_tensor(resid, dtype=torch.float32)
        K = x.shape[1]
        out = x.clone()
        k = min(K, self.D.shape[0])
        out[:, :k] = x[:, :k] + torch.einsum("nkd,kde->nke", x[:, :k], self.D[:k]) + self.b[:k]
        return out

    def translate_index(self, h: torch.Tensor, index: int) -> torch.Tensor:
        """[..., d] states at residual index ``index``."""
        if index >= self.D.shape[0]:
            return h
        return h + h @ self.D[index] + self.b[index]

    @classmethod
    def fit_ridge(cls, resid: np.ndarray, alphas: Sequence[float] = ALPHAS, seed: int = 0) -> TunedLens:
        """The ridge fit (not Belrose et al.'s training) on residuals [n, L+1, d]: see the module docstring."""
        x = torch.as_tensor(resid, dtype=torch.float64)
        n, K, d = x.shape
        if n < 5:
            raise LensError(f"the tuned lens needs at least 5 training facts, not {n}")
        perm = np.random.default_rng(seed).permutation(n)
        n_val = max(1, n // 5)
        val, tr = perm[:n_val], perm[n_val:]
        Y = x[:, -1]
        D = torch.zeros((K - 1, d, d), dtype=torch.float64)
        b = torch.zeros((K - 1, d), dtype=torch.float64)
        chosen = []
        for i in range(K - 1):
            errs = [_ridge_error(x[tr, i], Y[tr], x[val, i], Y[val], a) for a in alphas]
            a = float(alphas[int(np.argmin(errs))])
            chosen.append(a)
            D[i], b[i] = _ridge(x[:, i], Y, a)
        return cls(D.float(), b.float(), chosen, method="ridge", info={"alphas": chosen})


def _ridge(X: torch.Tensor, Y: torch.Tensor, alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """D, b minimising ||(Y - X) - X D - b||^2 + lam ||D||^2, lam = alpha * mean eigenvalue."""
    mx, my = X.mean(0), Y.mean(0)
    Xc, Rc = X - mx, (Y - X) - (my - mx)
    G = Xc.T @ Xc
    lam = alpha * float(torch.diagonal(G).mean()) + 1e-12
    D = torch.linalg.solve(G + lam * torch.eye(G.shape[0], dtype=G.dtype), Xc.T @ Rc)
    b = (my - mx) - mx @ D
    return D, b


def _ridge_error(X: torch.Tensor, Y: torch.Tensor, Xv: torch.Tensor, Yv: torch.Tensor, alpha: float) -> float:
    D, b = _ridge(X, Y, alpha)
    pred = Xv + Xv @ D + b
    return float(((pred - Yv) ** 2).mean())
