"""actstore.core.dependencies: a lazy module imports its package on first use, and a missing one is
one line naming what to install."""

from __future__ import annotations

import subprocess
import sys

import pytest

from actstore.core.dependencies import LazyModule
from actstore.core.errors import MissingDependency, QueryError


def test_a_lazy_module_imports_on_first_attribute() -> None:
    code = (
        "import sys\nfrom actstore.core.dependencies import scipy_stats\n"
        "before = 'scipy.stats' in sys.modules\nx = scipy_stats.norm.cdf(0.0)\n"
        "print(before, 'scipy.stats' in sys.modules, x)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/")
    assert out.stdout.split() == ["False", "True", "0.5"]


def test_a_missing_package_is_one_line_with_the_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "not_a_package_here", None)
    lazy = LazyModule("not_a_package_here", "pip install 'actstore[extra]'")
    with pytest.raises(MissingDependency) as e:
        lazy.anything  # noqa: B018
    assert str(e.value) == "not_a_package_here is not installed: pip install 'actstore[extra]'"
    assert isinstance(e.value, QueryError) and isinstance(e.value, ImportError)


def test_a_dunder_is_not_forwarded() -> None:
    lazy = LazyModule("json")
    with pytest.raises(AttributeError):
        lazy.__wrapped__  # noqa: B018
    assert lazy.dumps([1]) == "[1]"
