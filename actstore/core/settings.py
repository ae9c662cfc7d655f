"""Settings of a job or an analysis, declared once: a dataclass field per setting whose metadata
carries its help text and its allowed values, validated by :func:`check_settings` (one error type,
:class:`~actstore.core.invalid.InvalidSetting`) and turned into command-line options by
``actstore.cli._config``.

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
from typing import Any

from actstore.core.invalid import InvalidSetting


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
