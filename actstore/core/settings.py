"""Settings of a job or an analysis, declared once: a dataclass field per setting whose metadata
carries its help text and its allowed values, validated by :func:`check_settings` (one error type,
:class:`~actstore.core.errors.InvalidSetting`) and turned into command-line options by
``actstore.cli._config``.  A field holding a lower floor's settings is made with :func:`nested`.

The settings several floors share are written here once: the model's device and dtype
(:func:`device_setting`, :func:`model_dtype_setting`, the choices :data:`MODEL_DTYPES`), torch's CPU
threads (:func:`threads_setting`) and a job's ``save`` (:func:`save_setting`).

    @dataclass(frozen=True)
    class ProbeConfig:
        n_way: int = setting(5, "Classes (relations) per episode.", low=2)
        feature_dtype: str = setting("float32", "In-memory feature matrix dtype.", choices=("float32", "float16"))

        def __post_init__(self) -> None:
            check_settings(self)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, TypeVar

from actstore.core.errors import InvalidSetting

C = TypeVar("C")


def setting(
    default: Any,
    help: str,
    *,
    choices: Sequence[Any] | None = None,
    low: float | None = None,
    above: float | None = None,
    high: float | None = None,
    metavar: str | None = None,
    flag: str | None = None,
    required: bool = False,
    multiple: bool = False,
    cli: bool = True,
) -> Any:
    """A dataclass field with its default, help text and bounds (``low``: at least; ``above``:
    strictly above; ``high``: at most).  On the command line: ``flag`` (default ``--field-name``, or
    ``--no-field-name`` for a boolean defaulting to True), ``required``, ``multiple`` (a repeatable
    option); ``cli=False`` keeps it off."""
    meta = {
        "help": help,
        "choices": tuple(choices) if choices else None,
        "low": low,
        "above": above,
        "high": high,
    }
    cli_meta = {"metavar": metavar, "flag": flag, "required": required, "multiple": multiple, "cli": cli}
    return dataclasses.field(default=default, metadata={**meta, **cli_meta})


def check_settings(config: Any) -> None:
    """Every field declared with :func:`setting`: its value among the choices and within bounds, each
    element of a tuple on its own (None passes: it means the default behaviour)."""
    for f in dataclasses.fields(config):
        meta, value = f.metadata, getattr(config, f.name)
        if "help" not in meta or value is None:
            continue
        values = value if isinstance(value, tuple) else (value,)
        bad = [v for v in values if meta["choices"] and v not in meta["choices"]]
        if bad:
            raise InvalidSetting(f.name, f"{bad[0]!r} is not one of {', '.join(map(str, meta['choices']))}")
        for v in values:
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                continue
            if meta["low"] is not None and v < meta["low"]:
                raise InvalidSetting(f.name, f"must be at least {meta['low']:g}, not {v}")
            if meta["above"] is not None and v <= meta["above"]:
                raise InvalidSetting(f.name, f"must be above {meta['above']:g}, not {v}")
            if meta["high"] is not None and v > meta["high"]:
                raise InvalidSetting(f.name, f"must be at most {meta['high']:g}, not {v}")


def nested(cls: type[C]) -> C:
    """A field holding the settings dataclass ``cls`` of a floor below (an intervention's, the
    probe's), made with that class's defaults when not given.  On the command line its settings are
    the command's own options (``actstore.cli._config`` flattens them)."""
    return dataclasses.field(default_factory=cls, metadata={"nested": cls})


def save_setting() -> bool:
    """``save`` of a job: whether it writes its result tables and its ``runs`` row (the command
    line's ``--no-save``, one option for every command)."""
    return setting(True, "Write the result tables.", cli=False)


# ------------------------------------------------------------------ settings several floors share
MODEL_DTYPES = ("float32", "float16", "bfloat16")  # the dtypes a model runs in
DEFAULT_DEVICE = "cpu"
DEFAULT_MODEL_DTYPE = "float32"


def device_setting() -> str:
    """``device``: the torch device a model runs on (ingest, trace, patch, ablate)."""
    return setting(DEFAULT_DEVICE, "torch device of the model (cpu, cuda, ...).")


def model_dtype_setting() -> str:
    """``model_dtype``: the dtype a model runs in, one of :data:`MODEL_DTYPES`."""
    return setting(DEFAULT_MODEL_DTYPE, "dtype the model runs in.", choices=MODEL_DTYPES)


#: ``--threads`` of every command that computes: 0, torch's default (one thread per core).
DEFAULT_THREADS = 0
#: What ``--threads`` means, in every command (its option: ``actstore.cli._options.threads_option``,
#: or a settings field made with :func:`threads_setting`).
THREADS_HELP = (
    "torch CPU threads per process, also numpy's BLAS/OpenMP pools and DuckDB's threads "
    "(0: their defaults: torch and numpy one per core, DuckDB 2)."
)


def threads_setting(advice: str) -> int:
    """``threads``: torch's CPU threads per process, the same meaning and default
    (:data:`DEFAULT_THREADS`) in every command; ``advice`` says when to change it."""
    return setting(DEFAULT_THREADS, f"{THREADS_HELP} {advice}", low=0)


def check_model_dtype(model_dtype: str) -> None:
    """One error line unless ``model_dtype`` is one of :data:`MODEL_DTYPES`."""
    if model_dtype not in MODEL_DTYPES:
        raise InvalidSetting("model_dtype", f"{model_dtype!r} is not one of {', '.join(MODEL_DTYPES)}")
