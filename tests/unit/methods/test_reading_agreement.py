"""actstore.query.methods.metrics.reading_agreement: two readings of one method (e.g. tracing with 2 and 10
noise samples) compared fact by fact, checked against sums written out here."""

from __future__ import annotations

import math

import numpy as np
import pytest

from actstore.query.methods.metrics import reading_agreement
from actstore.query.methods.readings import MethodReading


def _reading(
    ids: list[int], keys: list[int], verdicts: list[str], profile: list[list[float]]
) -> MethodReading:
    return MethodReading(
        "trace",
        np.asarray(ids, np.int64),
        np.asarray(profile, float),
        np.asarray(keys, np.int64),
        np.asarray(verdicts, dtype=object),
    )


def _r(x: list[float], y: list[float]) -> float:
    pairs = [(a, b) for a, b in zip(x, y) if math.isfinite(a) and math.isfinite(b)]
    mx = sum(a for a, _ in pairs) / len(pairs)
    my = sum(b for _, b in pairs) / len(pairs)
    sxy = sum((a - mx) * (b - my) for a, b in pairs)
    sxx = sum((a - mx) ** 2 for a, _ in pairs)
    syy = sum((b - my) ** 2 for _, b in pairs)
    return sxy / math.sqrt(sxx * syy)


P1 = [0.0, 0.1, 0.5, 0.3, 0.1]
P2 = [0.0, 0.2, 0.4, 0.4, 0.0]
P3 = [0.3, 0.2, 0.1, 0.0, 0.0]
P4 = [0.0, float("nan"), 0.2, 0.9, 0.1]


def test_reading_agreement_by_hand() -> None:
    # facts 1-4 read by both (5 only by a, 0 only by b); fact 4: b has no key layer and no verdict
    a = _reading(
        [1, 2, 3, 4, 5], [2, 3, 0, 3, 1], ["mlp", "attn", "mlp", "attn", "mlp"], [P1, P2, P3, P4, P1]
    )
    b = _reading([0, 1, 2, 3, 4], [4, 2, 0, 4, -1], ["mlp", "mlp", "attn", "mlp", ""], [P3, P2, P3, P1, P1])
    got = reading_agreement(a, b, tolerance=1, resamples=300)
    # keys (a, b): 1 (2, 2), 2 (3, 0), 3 (0, 4), 4 (3, -1)
    assert got["key"].n == 3 and got["key"].value == pytest.approx(1 / 3)
    assert got["exact"].value == pytest.approx(1 / 3)
    assert got["key_distance"].n == 3 and got["key_distance"].value == pytest.approx((0 + 3 + 4) / 3)
    # verdicts: 1 mlp/mlp, 2 attn/attn, 3 mlp/mlp, 4 none in b
    assert got["verdict"].n == 3 and got["verdict"].value == pytest.approx(1.0)
    # profiles compared fact by fact; fact 4's NaN layer is left out of its r
    want = [_r(P1, P2), _r(P2, P3), _r(P3, P1), _r(P4, P1)]
    assert got["profile_r"].n == 4 and got["profile_r"].value == pytest.approx(sum(want) / 4)
    for s in got.values():
        assert s.low <= s.value <= s.high or (math.isnan(s.low) and s.n < 2)
    # tolerance 3 takes in fact 2 (distance 3) but not fact 3 (distance 4)
    assert reading_agreement(a, b, tolerance=3, resamples=300)["key"].value == pytest.approx(2 / 3)


def test_reading_agreement_of_a_reading_with_itself() -> None:
    a = _reading([1, 2, 3], [2, 3, 0], ["mlp", "attn", "mlp"], [P1, P2, P3])
    got = reading_agreement(a, a, tolerance=0, resamples=200)
    assert got["key"].value == 1.0 and got["exact"].value == 1.0 and got["verdict"].value == 1.0
    assert got["key_distance"].value == 0.0 and got["profile_r"].value == pytest.approx(1.0)
    flat = _reading([1], [0], ["mlp"], [[0.2] * 5])
    assert math.isnan(
        reading_agreement(flat, flat, tolerance=0)["profile_r"].value
    )  # a flat profile has no r
