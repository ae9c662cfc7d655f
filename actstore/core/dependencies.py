"""The third-party packages actstore imports only when a function needs them, in one place.

``import actstore`` (and ``actstore --help``) stays fast and torch-free because the heavy and the
optional packages are named here as :class:`LazyModule` s: a module imports one at its top,
``from actstore.core.dependencies import scipy_stats``, and the package itself is imported on the
first attribute read.  A missing optional package is one line naming what to install, raised as
the error type of the caller's floor (:class:`~actstore.core.errors.QueryError` by default).
"""

from __future__ import annotations

import importlib
import types
from typing import TYPE_CHECKING, Any

from actstore.core.errors import ActstoreError, MissingDependency


class LazyModule(types.ModuleType):
    """The module ``name``, imported on first attribute access; ``install``: the one-line hint."""

    def __init__(
        self, name: str, install: str | None = None, error: type[ActstoreError] = MissingDependency
    ) -> None:
        super().__init__(name)
        self._install = install
        self._error = error

    def load(self) -> types.ModuleType:
        """The module, imported now if it was not yet (then a lookup in ``sys.modules``)."""
        try:
            return importlib.import_module(self.__name__)
        except ImportError:
            hint = self._install or f"pip install {self.__name__.split('.')[0]}"
            raise self._error(f"{self.__name__} is not installed: {hint}") from None

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return getattr(self.load(), attr)

    def __repr__(self) -> str:
        return f"<lazy module {self.__name__!r}>"


DASK_HINT = "pip install 'actstore[dask]'"

scipy_stats = LazyModule("scipy.stats")
sklearn_text = LazyModule("sklearn.feature_extraction.text")
dask = LazyModule("dask", DASK_HINT)
dask_array = LazyModule("dask.array", DASK_HINT)
dask_base = LazyModule("dask.base", DASK_HINT)
dask_distributed = LazyModule("dask.distributed", "pip install 'dask[distributed]'")
transformers = LazyModule("transformers")
transformers_logging = LazyModule("transformers.utils.logging")
wordfreq = LazyModule("wordfreq", "pip install 'actstore[methods]'")

if TYPE_CHECKING:
    import duckdb as duckdb
    import pyarrow.dataset as pyarrow_dataset
else:
    # DuckDB and pyarrow.dataset (which imports pandas: about 0.4 s) load when a statement first runs.
    duckdb = LazyModule("duckdb")
    pyarrow_dataset = LazyModule("pyarrow.dataset")
