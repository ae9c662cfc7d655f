"""Command-line options made from a settings dataclass (:mod:`actstore.core.settings`), so that each
default, help text and set of choices is written once, in the dataclass.

    @options_from(ProbeConfig, skip=("seeds",))
    def probe(store: str, **given: Any) -> None:
        cfg = config_from(ProbeConfig, given, seeds=...)

A field ``n_way: int`` becomes ``--n-way`` (an integer, its default shown); a boolean defaulting to
False becomes the flag ``--name``, one defaulting to True the flag ``--no-name`` (or the field's
``flag``), one that may be None (the default behaviour) the pair ``--name/--no-name``;
``tuple[int, ...]`` takes a list like ``0,3,5-7`` and ``tuple[str, ...]`` a comma-separated list.
A field made with :func:`actstore.core.settings.nested` (a lower floor's settings inside a job's)
gives its own settings' options in its place, and :func:`config_from` makes it from them.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import click

from actstore.cli._options import parse_int_list, split_list

F = TypeVar("F", bound=Callable[..., Any])
C = TypeVar("C")


def _kind(hint: Any) -> tuple[type, bool]:
    """(the base type, whether None is allowed) of a field's annotation."""
    args = typing.get_args(hint)
    optional = type(None) in args
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next(a for a in args if a is not type(None))
    if typing.get_origin(hint) is tuple:
        return (tuple, optional) if typing.get_args(hint)[0] is int else (list, optional)
    return hint, optional


def _flag(name: str, meta: Mapping[str, Any] | None = None) -> str:
    return str((meta or {}).get("flag") or "--" + name.replace("_", "-"))


def cli_fields(cls: type, skip: tuple[str, ...] = ()) -> list[dataclasses.Field[Any]]:
    """The fields of ``cls`` that become options: declared with a help text, not ``cli=False``."""
    return [
        f
        for f in dataclasses.fields(cls)
        if "help" in f.metadata and f.metadata.get("cli", True) and f.name not in skip
    ]


def _nested_fields(cls: type) -> list[tuple[str, type]]:
    """(name, settings class) of each field of ``cls`` made with :func:`actstore.core.settings.nested`."""
    return [(f.name, f.metadata["nested"]) for f in dataclasses.fields(cls) if "nested" in f.metadata]


def _option_fields(cls: type, skip: tuple[str, ...]) -> list[tuple[dataclasses.Field[Any], Any]]:
    """(field, annotation) of every option of ``cls``, a nested settings field's own options in its
    place; two settings of one name are a mistake in the dataclasses."""
    hints, own = typing.get_type_hints(cls), cli_fields(cls, skip)
    out: list[tuple[dataclasses.Field[Any], Any]] = []
    for f in dataclasses.fields(cls):
        inner = f.metadata.get("nested")
        if inner is not None:
            out += _option_fields(inner, skip)
        elif f in own:
            out.append((f, hints[f.name]))
    names = [f.name for f, _ in out]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise TypeError(f"{cls.__name__}: more than one setting named {', '.join(twice)}")
    return out


def _option(f: dataclasses.Field[Any], hint: Any) -> Callable[[F], F]:
    base, optional = _kind(hint)
    meta, default = f.metadata, f.default if f.default is not dataclasses.MISSING else None
    help = str(meta["help"])
    if base is bool:
        if default is True:
            return click.option(_flag("no_" + f.name, meta), "no_" + f.name, is_flag=True, help=help)
        if optional and default is None:
            flag = _flag(f.name, meta)
            return click.option(f"{flag}/--no-{flag[2:]}", f.name, default=None, help=help)
        return click.option(_flag(f.name, meta), f.name, is_flag=True, help=help)
    kw: dict[str, Any] = {"default": default, "help": help, "show_default": default is not None}
    if meta.get("required"):
        kw.update(required=True, default=None, show_default=False)
    if meta.get("metavar"):
        kw["metavar"] = meta["metavar"]
    if meta.get("multiple"):
        kw.update(multiple=True, default=tuple(default or ()), show_default=False)
    elif base in (tuple, list):
        kw.update(
            default=None if default is None else ",".join(map(str, default)),
            metavar=kw.get("metavar", "LIST"),
        )
    elif meta.get("choices"):
        kw["type"] = click.Choice([str(c) for c in meta["choices"]])
    elif base is int and (meta.get("low") is not None or meta.get("high") is not None):
        high = meta.get("high")
        kw["type"] = click.IntRange(min=meta.get("low"), max=None if high is None else int(high))
    elif base is float and meta.get("above") is not None:
        kw["type"] = click.FloatRange(min=float(meta["above"]), max=meta.get("high"), min_open=True)
    elif base is float and (meta.get("low") is not None or meta.get("high") is not None):
        kw["type"] = click.FloatRange(min=meta.get("low"), max=meta.get("high"))
    elif base in (int, float):
        kw["type"] = base
    return click.option(_flag(f.name, meta), f.name, **kw)


def options_from(cls: type, *, skip: tuple[str, ...] = (), first: tuple[str, ...] = ()) -> Callable[[F], F]:
    """The options of every command-line field of ``cls`` (see the module docstring), in field order
    after those named in ``first``."""
    order = {name: i for i, name in enumerate(first)}
    chosen = sorted(_option_fields(cls, skip), key=lambda fh: order.get(fh[0].name, len(order)))
    options = [_option(f, hint) for f, hint in chosen]

    def deco(fn: F) -> F:
        for opt in reversed(options):
            fn = opt(fn)
        return fn

    return deco


def config_from(cls: type[C], given: dict[str, Any], /, **values: Any) -> C:
    """``cls`` from the parsed options of :func:`options_from` (taken out of ``given``) and
    ``values`` (settings the command sets itself; a nested settings field not among them is made
    from ``given`` likewise)."""
    for name, inner in _nested_fields(cls):
        if name not in values:
            values[name] = config_from(inner, given)
    hints = typing.get_type_hints(cls)
    for f in cli_fields(cls, tuple(values)):
        base, _ = _kind(hints[f.name])
        if base is bool and f.default is True:
            values[f.name] = not given.pop("no_" + f.name)
            continue
        raw = given.pop(f.name)
        if f.metadata.get("multiple"):
            raw = tuple(raw) or f.default  # none given: the field's default (None: decided later)
        elif base is tuple and raw is not None:
            ints = parse_int_list(raw, f.name.replace("_", "-"))
            raw = None if ints is None else tuple(ints)
        elif base is list and raw is not None:
            raw = split_list(raw)
        values[f.name] = raw
    return cls(**values)


def defaults(cls: type) -> Mapping[str, Any]:
    """Field name -> default of ``cls`` (for help texts that quote a default)."""
    return {f.name: f.default for f in dataclasses.fields(cls)}
