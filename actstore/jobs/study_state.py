"""A method study's files: its data set (methods2k), the state (JSON: the facts traced and patched, every run id, the seconds
spent), which makes ``actstore study run`` resumable and is what a checkpoint keeps, and the summary
(``--out``: the state, the readings and every figure), plain or gzip-compressed.

    state = load_state(Path("S.study.json"))       # {"trace_runs": [], "traced": []} when absent
    save_state(Path("S.study.json"), state)        # atomically
"""

from __future__ import annotations

import gzip
import json
import os
import random
from collections import defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from actstore.core.errors import MethodsError
from actstore.ingest.datasets import registry
from actstore.ingest.datasets.methods2k import DEFAULT_SIZE, build_methods2k
from actstore.jobs.study_settings import StudyDataConfig


def load_state(path: Path) -> dict[str, Any]:
    """The state in ``path``, or a new one (nothing traced) when there is no such file."""
    if not path.exists():
        return {"trace_runs": [], "traced": []}
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise MethodsError(f"{path}: not a study state ({e})") from None
    if not isinstance(state, dict) or not isinstance(state.get("trace_runs"), list):
        raise MethodsError(f"{path}: not a study state (no trace_runs list)")
    state.setdefault("traced", [])
    return state


def existing_state(path: Path) -> dict[str, Any]:
    """The state in ``path``, which must exist."""
    if not path.exists():
        raise MethodsError(f"{path}: no such state file")
    return load_state(path)


def save_state(path: Path, state: Mapping[str, Any]) -> None:
    """Write the state atomically (a reader in another process never sees half a file, and a study
    killed while saving keeps the state it had)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(state, indent=1) + "\n")
    os.replace(tmp, path)


def write_summary(path: Path, summary: Mapping[str, Any]) -> None:
    """A study's ``--out`` file; gzip-compressed when the name ends in ``.gz`` (the form kept in the
    repository: the per-relation and per-stratum rows make it about 2 MB of plain JSON)."""
    text = json.dumps(summary, indent=1, default=float) + "\n"
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(text.encode(), mtime=0))
    else:
        path.write_text(text)


def read_summary(path: Path) -> dict[str, Any]:
    """What :func:`write_summary` wrote, plain or gzip-compressed."""
    try:
        data = path.read_bytes()
        doc = json.loads(gzip.decompress(data) if path.suffix == ".gz" else data)
    except (OSError, ValueError, EOFError) as e:
        raise MethodsError(f"{path}: not a study summary ({e})") from None
    if not isinstance(doc, dict):
        raise MethodsError(f"{path}: not a study summary (not a JSON object)")
    return doc


def study_runs(state: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(kind, run id) of every run a checkpoint keeps: trace, patch and site-effect runs."""
    runs = [("trace", r) for r in state.get("trace_runs", [])] + [
        ("patch", r) for r in state.get("patch_runs", [])
    ]
    runs += [("effects", state[k]) for k in ("effects_knockout_run", "effects_restore_run") if state.get(k)]
    return runs


def stratified_order(rows: Iterable[Mapping[str, Any]], seed: int = 0) -> list[int]:
    """Example ids round-robin over the strata (sorted labels), a seeded shuffle within each, so that
    every prefix of the order is stratified (``rows``: ``example_id`` and ``stratum``)."""
    by: dict[str, list[int]] = defaultdict(list)
    for r in rows:
        by[str(r["stratum"])].append(int(r["example_id"]))
    queues = []
    for k in sorted(by):
        ids = sorted(by[k])
        random.Random(f"{seed}:{k}").shuffle(ids)
        queues.append(ids)
    out: list[int] = []
    depth = 0
    while any(depth < len(q) for q in queues):
        out.extend(q[depth] for q in queues if depth < len(q))
        depth += 1
    return out


def where_ids(ids: Iterable[int]) -> str:
    """The SQL predicate over the examples table choosing exactly ``ids``."""
    return f"example_id IN ({', '.join(str(int(i)) for i in ids)})"


def build_study_data(cfg: StudyDataConfig) -> Path:
    """Write the methods2k data set (:func:`actstore.ingest.datasets.methods2k.build_methods2k`) into
    ``cfg.out``; LRE's factual relations and known_1000 default to the public copies (as
    ``--dataset methods2k`` reads them: ``$ACTSTORE_DATA``, else the data set cache), the subjects'
    frequencies to wordfreq's unless ``cfg.frequency`` names a table; return the file."""
    frequency = None
    if cfg.frequency:
        try:
            frequency = {str(k): float(v) for k, v in json.loads(Path(cfg.frequency).read_text()).items()}
        except (OSError, ValueError, AttributeError) as e:
            raise MethodsError(f"{cfg.frequency}: not a JSON table of subject frequencies ({e})") from None
    lre = Path(cfg.lre) if cfg.lre else registry.fetch("lre") / "factual"
    known = Path(cfg.known) if cfg.known else registry.fetch("known1000")
    size = DEFAULT_SIZE if cfg.size is None else cfg.size
    return build_methods2k(lre, known, cfg.out, size=size, seed=cfg.seed, frequency=frequency)
