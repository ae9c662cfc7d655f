"""Training of the episodic probes: many independent multinomial logistic probes as one tensor problem.

:func:`train_batched` trains B probes at once (zero-initialised weights, full-batch gradient of each
episode's mean cross-entropy, Adam's update with the fused kernel of ``torch.optim.Adam``);
:func:`train_reference` is the plain one-episode trainer (``nn.Linear`` + ``torch.optim.Adam``) the tests
compare it against.  Used by :mod:`actstore.query.analyses.probe`.
"""

from __future__ import annotations

import torch

__all__ = ["train_batched", "train_reference"]


def train_batched(
    xs: torch.Tensor,
    y: torch.Tensor,
    n_classes: int,
    *,
    epochs: int = 200,
    lr: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Train B independent probes at once: ``xs`` [B, S, F], labels ``y`` [S] (shared) or [B, S].
    Returns W [B, F, C] and b [B, C].

    Full-batch gradient steps of each episode's mean cross-entropy, computed by hand (softmax
    minus one-hot, no autograd graph) and applied with Adam's update (no weight decay): two
    batched matmuls and one fused optimizer kernel per step."""
    B, S, F = xs.shape
    C = n_classes
    onehot = torch.nn.functional.one_hot(y.expand(B, S) if y.dim() == 1 else y, C).to(xs.dtype)
    Wt = torch.zeros((B, C, F))  # [B, C, F]: the fastest layout for both matmuls with small C
    b = torch.zeros((B, C))
    params, grads = [Wt, b], [torch.empty_like(Wt), torch.empty_like(b)]
    adam = _Adam(params, lr, betas, eps)
    for _ in range(epochs):
        logits = torch.baddbmm(b[:, None, :], xs, Wt.transpose(1, 2))
        g = torch.softmax(logits, -1).sub_(onehot).div_(S)  # d(mean cross-entropy)/d(logits)
        torch.bmm(g.transpose(1, 2), xs, out=grads[0])
        torch.sum(g, 1, out=grads[1])
        adam.step(grads)
    return Wt.transpose(1, 2), b


class _Adam:
    """Adam (the update of ``torch.optim.Adam``, no weight decay) on plain tensors.  Uses the
    fused kernel that ``torch.optim.Adam(fused=True)`` runs, without constructing a
    ``torch.optim`` optimizer (whose first construction imports torch._dynamo: seconds)."""

    use_fused = True  # the tests switch it off to check the plain path

    def __init__(self, params: list[torch.Tensor], lr: float, betas: tuple[float, float], eps: float) -> None:
        self.params, self.lr, self.betas, self.eps = params, lr, betas, eps
        self.m = [torch.zeros_like(p) for p in params]
        self.v = [torch.zeros_like(p) for p in params]
        self.steps = [torch.zeros((), dtype=torch.float32) for _ in params]
        self.fused = self.use_fused and hasattr(torch, "_fused_adam_")

    def step(self, grads: list[torch.Tensor]) -> None:
        b1, b2 = self.betas
        for t in self.steps:
            t += 1
        if self.fused:
            torch._fused_adam_(
                self.params,
                grads,
                self.m,
                self.v,
                [],
                self.steps,
                amsgrad=False,
                lr=self.lr,
                beta1=b1,
                beta2=b2,
                weight_decay=0.0,
                eps=self.eps,
                maximize=False,
            )
            return
        n = float(self.steps[0])
        bc1, bc2 = 1 - b1**n, 1 - b2**n
        for p, g, m, v in zip(self.params, grads, self.m, self.v):
            m.mul_(b1).add_(g, alpha=1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            p.addcdiv_(m, v.sqrt().div_(bc2**0.5).add_(self.eps), value=-self.lr / bc1)


def train_reference(
    xs: torch.Tensor, y: torch.Tensor, n_classes: int, *, epochs: int = 200, lr: float = 1e-3
) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain one-episode trainer: ``xs`` [S, F] -> W [F, C], b [C]."""
    lin = torch.nn.Linear(xs.shape[1], n_classes)
    torch.nn.init.zeros_(lin.weight)
    torch.nn.init.zeros_(lin.bias)
    opt = torch.optim.Adam(lin.parameters(), lr=lr)
    for _ in range(epochs):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(lin(xs), y).backward()
        opt.step()
    return lin.weight.detach().T.contiguous(), lin.bias.detach().clone()
