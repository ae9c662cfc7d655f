"""Agreement between methods against chance: the permutation null, Cohen's kappa, the excess.

A raw agreement share (two methods' key layers within ``tolerance`` on 43.7% of facts) says nothing
until it is set against what two methods would share if their readings had nothing to do with the
fact: when each method's key layer is nearly a constant of the method, the raw share is high or
low for that reason alone.  Every agreement figure of :mod:`actstore.query.methods.tables` is
therefore reported with (all ours; the ACL 2025 method study gives raw shares only):

    chance      the mean agreement under the *permutation null*: method B's readings shuffled over
                the facts of the same stratum (methods2k's relation x frequency band x uniqueness,
                or another grouping), so that each fact is compared with B's reading of another
                fact of its stratum.  Computed exactly: within a stratum s of n_s facts the expected
                share is ``h_A^T W h_B / n_s^2`` (h the stratum's histograms of the two methods'
                codes, W[x, y] = 1 when codes x and y agree: |x - y| <= tolerance for key layers,
                x == y for exact layers and verdicts); the chance level is the facts' mean of their
                stratum's value.  A stratum of one fact has chance = its observed agreement.
    null range  the 2.5% and 97.5% quantiles of the share over ``permutations`` (1,000) seeded
                within-stratum shuffles, and the one-sided permutation p-value
                ``(1 + #{shuffles >= observed}) / (1 + permutations)``.  Their mean estimates the
                exact chance (to Monte Carlo error).
    excess      observed - chance: the headline figure.  0 = no more agreement than between a fact
                and another fact of its stratum.
    kappa       Cohen's kappa ``(p_o - p_e) / (1 - p_e)`` with ``p_e = h_A^T W h_B / n^2`` from the
                pooled marginals (all facts: the unstratified shuffle, ``chance_pooled``).  For
                verdicts and exact key layers W is the identity and this is Cohen's kappa; for key
                layers within a tolerance it is the kappa of that 0/1 agreement (a weighted kappa
                with 0/1 weights; ours).

Consensus of m methods (every key layer within ``tolerance`` of every other, i.e. max - min <=
tolerance) is treated the same way: the null shuffles every method but the first independently
within the stratum, and its exact mean per stratum is, with F_k(I) the share of the stratum's facts
whose method-k key lies in the interval I,

    P(max - min <= t) = sum_lo [ prod_k F_k([lo, lo + t]) - prod_k F_k([lo + 1, lo + t]) ]

(the minimum is at lo and everything lies within t of it); kappa uses the pooled F_k.  For m = 2
this equals the pair formula (a test holds the two equal).

Intervals: percentile bootstrap 95% over facts (``resamples`` resamples of the facts, seeded; the
same resamples for every figure of one comparison, so chance, excess and kappa are paired); the
chance of a resampled fact is its stratum's chance in the full sample, kappa's p_e is recomputed on
each resample.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from actstore.query.methods.readings import MethodReading, common_keys

PERMUTATIONS = 1000
RESAMPLES = 2000
VERDICT_CODES = {"mlp": 0, "attn": 1}
NAN = float("nan")


@dataclass(frozen=True)
class ChanceFigure:
    """One agreement figure against chance (see the module docstring); NaN where undefined."""

    n: int
    value: float  # observed share
    chance: float
    chance_low: float
    chance_high: float
    null_low: float
    null_high: float
    p_value: float
    excess: float
    excess_low: float
    excess_high: float
    kappa: float
    kappa_low: float
    kappa_high: float
    chance_pooled: float

    def columns(self) -> dict[str, float]:
        """The pair-table columns (all but ``n`` and ``value``, which the table has already)."""
        d = asdict(self)
        d.pop("n")
        d.pop("value")
        return d


EMPTY = ChanceFigure(0, *([NAN] * 14))


# ------------------------------------------------------------------------------------ building blocks


def tolerance_kernel(n_codes: int, tolerance: int) -> np.ndarray:
    """W[x, y] = 1 when |x - y| <= tolerance: key layers agree.  [n_codes, n_codes] float."""
    x = np.arange(n_codes)
    return (np.abs(x[:, None] - x[None, :]) <= tolerance).astype(np.float64)


def group_codes(labels: Sequence[object]) -> np.ndarray:
    """Integer codes of the labels (equal labels, equal codes), [n] int64."""
    _, inv = np.unique(np.asarray([str(x) for x in labels], dtype=object), return_inverse=True)
    return inv.astype(np.int64).reshape(-1)


def stratum_chance(a: np.ndarray, b: np.ndarray, groups: np.ndarray, kernel: np.ndarray) -> np.ndarray:
    """Per fact, the exact expected agreement of its stratum under the within-stratum shuffle of
    ``b``: ``h_a^T W h_b / n_s^2``.  ``a``, ``b``: codes [n]; ``groups``: stratum codes [n]."""
    out = np.zeros(a.size)
    for g in np.unique(groups):
        m = groups == g
        ha = np.bincount(a[m], minlength=kernel.shape[0]).astype(np.float64)
        hb = np.bincount(b[m], minlength=kernel.shape[1]).astype(np.float64)
        out[m] = ha @ kernel @ hb / m.sum() ** 2
    return out


def shuffles_within(groups: np.ndarray, permutations: int, rng: np.random.Generator) -> np.ndarray:
    """``permutations`` random permutations of the facts that keep each within its stratum: row p
    gives, for each fact, the fact whose reading it receives.  [permutations, n] int64."""
    n = groups.size
    base = np.argsort(groups, kind="stable")  # facts grouped by stratum
    order = np.argsort(groups[None, :] + rng.random((permutations, n)), axis=1)  # grouped, shuffled within
    out = np.empty((permutations, n), np.int64)
    out[:, base] = order
    return out


def _interval(x: np.ndarray) -> tuple[float, float]:
    x = x[np.isfinite(x)]
    if x.size == 0:
        return NAN, NAN
    lo, hi = np.percentile(x, [2.5, 97.5])
    return float(lo), float(hi)


def _kappa(p_o: np.ndarray, p_e: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(p_e < 1, (p_o - p_e) / (1 - p_e), np.nan)


def _figure(
    obs: np.ndarray,
    chance: np.ndarray,
    null: np.ndarray,
    p_e: float,
    boot_idx: np.ndarray,
    boot_pe: np.ndarray,
) -> ChanceFigure:
    n = obs.size
    value = float(obs.mean())
    ch = float(chance.mean())
    kappa = float(_kappa(np.asarray(value), np.asarray(p_e)))
    b_obs = obs[boot_idx].mean(axis=1)
    b_ch = chance[boot_idx].mean(axis=1)
    return ChanceFigure(
        n,
        value,
        ch,
        *_interval(b_ch),
        *_interval(null),
        float((1 + np.sum(null >= value - 1e-12)) / (1 + null.size)),
        value - ch,
        *_interval(b_obs - b_ch),
        kappa,
        *_interval(_kappa(b_obs, boot_pe)),
        float(p_e),
    )


def _boot(n: int, resamples: int, rng: np.random.Generator) -> np.ndarray:
    return rng.integers(0, n, size=(resamples, n))


def _histograms(codes: np.ndarray, idx: np.ndarray, n_codes: int) -> np.ndarray:
    """Per resample (rows of ``idx``), the histogram of ``codes`` [R, n_codes]."""
    R = idx.shape[0]
    flat = (np.arange(R)[:, None] * n_codes + codes[idx]).ravel()
    return np.bincount(flat, minlength=R * n_codes).reshape(R, n_codes).astype(np.float64)


# ------------------------------------------------------------------------------------ pairs


def coded_chance(
    a: np.ndarray,
    b: np.ndarray,
    groups: np.ndarray,
    kernel: np.ndarray,
    permutations: int = PERMUTATIONS,
    resamples: int = RESAMPLES,
    seed: int = 0,
) -> ChanceFigure:
    """The figure of two coded readings of the same facts (``a``, ``b``: codes [n], every fact
    defined; ``groups``: stratum codes [n]; ``kernel``: W)."""
    n = a.size
    if n == 0:
        return EMPTY
    rng = np.random.default_rng(seed)
    obs = kernel[a, b]
    chance = stratum_chance(a, b, groups, kernel)
    perms = shuffles_within(groups, permutations, rng)
    null = kernel[a[None, :], b[perms]].mean(axis=1)
    ha = np.bincount(a, minlength=kernel.shape[0]).astype(np.float64)
    hb = np.bincount(b, minlength=kernel.shape[1]).astype(np.float64)
    p_e = float(ha @ kernel @ hb / n**2)
    idx = _boot(n, resamples, rng)
    bha, bhb = _histograms(a, idx, kernel.shape[0]), _histograms(b, idx, kernel.shape[1])
    boot_pe = np.einsum("rk,kl,rl->r", bha, kernel, bhb) / n**2
    return _figure(obs, chance, null, p_e, idx, boot_pe)


def _common(ra: MethodReading, rb: MethodReading) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    common = np.intersect1d(ra.example_ids, rb.example_ids)
    return common, np.searchsorted(ra.example_ids, common), np.searchsorted(rb.example_ids, common)


def _labels(ids: np.ndarray, strata: Mapping[int, str] | None) -> np.ndarray:
    """Stratum codes of the facts; facts without a label share one stratum (and all, without strata)."""
    if not strata:
        return np.zeros(ids.size, np.int64)
    return group_codes([strata.get(int(i), "") for i in ids])


def pair_chance(
    ra: MethodReading,
    rb: MethodReading,
    tolerance: int,
    strata: Mapping[int, str] | None,
    permutations: int = PERMUTATIONS,
    resamples: int = RESAMPLES,
    seed: int = 0,
) -> dict[str, ChanceFigure]:
    """``key_layer`` (within ``tolerance``), ``key_layer_exact`` and ``verdict`` of two readings,
    over the facts both read with a key layer (a verdict), against chance within the strata of
    ``strata`` (example id -> label; None: all facts one stratum)."""
    common, ia, ib = _common(ra, rb)
    ka, kb = ra.key_layer[ia], rb.key_layer[ib]
    ok = (ka >= 0) & (kb >= 0)
    out: dict[str, ChanceFigure] = {}
    n_codes = int(max(ka.max(initial=0), kb.max(initial=0))) + 1
    groups = _labels(common[ok], strata)
    for name, kernel in (
        ("key_layer", tolerance_kernel(n_codes, tolerance)),
        ("key_layer_exact", tolerance_kernel(n_codes, 0)),
    ):
        out[name] = coded_chance(ka[ok], kb[ok], groups, kernel, permutations, resamples, seed)
    va, vb = ra.verdict[ia], rb.verdict[ib]
    vok = np.isin(va, list(VERDICT_CODES)) & np.isin(vb, list(VERDICT_CODES))
    ca = np.asarray([VERDICT_CODES[v] for v in va[vok]], np.int64)
    cb = np.asarray([VERDICT_CODES[v] for v in vb[vok]], np.int64)
    out["verdict"] = coded_chance(
        ca, cb, _labels(common[vok], strata), np.eye(2), permutations, resamples, seed
    )
    return out


# ------------------------------------------------------------------------------------ consensus


def consensus_share(F: np.ndarray, tolerance: int) -> np.ndarray:
    """P(max - min <= tolerance) for independent keys with distributions ``F`` [..., m, K] (each
    row sums to 1): the formula of the module docstring, over the leading axes."""
    K = F.shape[-1]
    C = np.concatenate([np.zeros(F.shape[:-1] + (1,)), np.cumsum(F, axis=-1)], axis=-1)  # C[x] = P(key < x)

    def within(lo: int, hi: int) -> np.ndarray:  # P(lo <= key <= hi) per method
        lo_, hi_ = max(lo, 0), min(hi, K - 1)
        if hi_ < lo_:
            return np.zeros(F.shape[:-1])
        return C[..., hi_ + 1] - C[..., lo_]

    total = np.zeros(F.shape[:-2])
    for lo in range(K):
        total = (
            total + within(lo, lo + tolerance).prod(axis=-1) - within(lo + 1, lo + tolerance).prod(axis=-1)
        )
    return total


def coded_consensus_chance(
    keys: np.ndarray,
    groups: np.ndarray,
    tolerance: int,
    permutations: int = PERMUTATIONS,
    resamples: int = RESAMPLES,
    seed: int = 0,
) -> ChanceFigure:
    """The consensus figure of ``keys`` [m, n] (every entry >= 0) in strata ``groups`` [n]."""
    m, n = keys.shape
    if n == 0:
        return EMPTY
    rng = np.random.default_rng(seed)
    K = int(keys.max()) + 1

    def spread_ok(k: np.ndarray) -> np.ndarray:
        return (k.max(axis=0) - k.min(axis=0) <= tolerance).astype(np.float64)

    def dist(idx: np.ndarray) -> np.ndarray:  # [m, K] key distribution of the facts idx
        return np.stack([np.bincount(keys[j, idx], minlength=K) for j in range(m)]) / idx.size

    obs = spread_ok(keys)
    chance = np.zeros(n)
    for g in np.unique(groups):
        sel = np.flatnonzero(groups == g)
        chance[sel] = consensus_share(dist(sel), tolerance)
    null = np.empty(permutations)
    perms = [shuffles_within(groups, permutations, rng) for _ in range(m - 1)]
    for p in range(permutations):
        shuffled = np.stack([keys[0]] + [keys[j + 1, perms[j][p]] for j in range(m - 1)])
        null[p] = spread_ok(shuffled).mean()
    p_e = float(consensus_share(dist(np.arange(n)), tolerance))
    idx = _boot(n, resamples, rng)
    F = np.stack([_histograms(keys[j], idx, K) for j in range(m)], axis=1) / n  # [R, m, K]
    return _figure(obs, chance, null, p_e, idx, consensus_share(F, tolerance))


def consensus_chance(
    readings: Sequence[MethodReading],
    tolerance: int,
    strata: Mapping[int, str] | None,
    permutations: int = PERMUTATIONS,
    resamples: int = RESAMPLES,
    seed: int = 0,
) -> ChanceFigure:
    """All-method consensus over the facts every reading reads with a key layer, against chance."""
    common, keys = common_keys(readings)
    ok = (keys >= 0).all(axis=0)
    return coded_consensus_chance(
        keys[:, ok], _labels(common[ok], strata), tolerance, permutations, resamples, seed
    )
