"""The tolerance helper of the test suite (docs/testing.md, "Tolerances") against numpy's own spacing:
it passes one ulp of the dtype and fails two, so a test that uses it can fail."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_within_ulps, ulp


def test_ulp_equals_numpys_spacing_for_float16_and_float32() -> None:
    x = np.array([0.0, 6e-8, 1e-5, 0.0021, 0.5, 1.0, 3.0, 1000.0, -0.0021], dtype=np.float16)
    np.testing.assert_array_equal(ulp(x, "float16"), np.abs(np.spacing(x)).astype(np.float64))
    y = np.array([1e-30, 0.0021, 1.0, -7.5, 1e6], dtype=np.float32)
    np.testing.assert_array_equal(ulp(y, "float32"), np.abs(np.spacing(y)).astype(np.float64))
    assert ulp(np.array([1.0]), "bfloat16")[0] == 2.0**-7 and ulp(np.array([3.0]), "bfloat16")[0] == 2.0**-6


def test_one_ulp_passes_and_two_fail() -> None:
    # The loader's value in issue "make test on AVX-512": 0.0021228790283203125 against 0.0021209716796875.
    a = np.array([0.0021228790283203125, 1.0], dtype=np.float16)
    d = np.array([0.0021209716796875, 1.0], dtype=np.float16)
    assert_within_ulps(a, d, "float16")
    two = np.array([np.nextafter(np.nextafter(d[0], np.float16(1)), np.float16(1)), 1.0], dtype=np.float16)
    with pytest.raises(AssertionError, match="1 of 2 values differ by more than 1 ulp of float16"):
        assert_within_ulps(two, d, "float16")
    assert_within_ulps(two, d, "float16", ulps=2)
    with pytest.raises(AssertionError):
        assert_within_ulps(a[:1], d, "float16")  # shapes must agree
