"""A method study's checkpoint (``actstore study checkpoint`` / ``restore``): its trace, patch and
site-effect runs outlive its store as a folder that holds numbers and run records only.  The columns
that repeat the data set's text (prompt tokens, subjects, objects, relation ids) are left out and read
back from the store they are restored into, which must hold the same facts (checked by a fingerprint
of each fact's token ids, subject span and object token) and the same model weights.

A restore writes the checkpoint's runs as they were recorded (their own run ids and ``runs`` rows, not
new runs), each run's tables before its ``runs`` row, as :func:`actstore.jobs.record.record_run` does.

    checkpoint_study(store, StudyCheckpointConfig(state="S.study.json", out="CK"))   # rows per table
    restore_study(other, StudyRestoreConfig(checkpoint="CK", state="S2.study.json"))   # the new state
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from actstore.core.dependencies import duckdb
from actstore.core.errors import MethodsError
from actstore.core.store import StoreReader
from actstore.core.tables import to_parquet_bytes
from actstore.core.writer import write_result_table
from actstore.jobs.study_settings import StudyCheckpointConfig, StudyRestoreConfig
from actstore.jobs.study_state import load_state, save_state, study_runs

CHECKPOINT_FORMAT = 1
CHECKPOINT_TABLES = {
    "trace": ("trace_effects", "trace_facts"),
    "patch": ("patch_effects", "patch_pairs"),
    "effects": ("site_effects",),
}
_BY_FACT = (("example_id", "example_id"),)
DERIVED: dict[str, dict[str, tuple[str, str, tuple[tuple[str, str], ...]]]] = {
    # table -> column -> (store table, its column, ((checkpoint key, store key), ...))
    "trace_effects": {"token": ("tokens", "token", (("example_id", "example_id"), ("position", "position")))},
    "trace_facts": {
        "relation_id": ("examples", "relation_id", _BY_FACT),
        "subject": ("examples", "subject", _BY_FACT),
        "object": ("examples", "object", _BY_FACT),
    },
    "patch_pairs": {
        "relation_id": ("examples", "relation_id", _BY_FACT),
        "object": ("examples", "object", _BY_FACT),
        "counterfactual_object": ("examples", "object", (("counterfactual_id", "example_id"),)),
    },
}


def fact_fingerprints(store: StoreReader, ids: Sequence[int]) -> dict[int, str]:
    """example id -> 16 hex digits of SHA-256 over the prompt's token ids, subject span and object token."""
    rows = store.sql(
        """SELECT e.example_id, e.subject_start, e.subject_end, t.object_token_id,
                  list(tk.token_id ORDER BY tk.position) AS ids
           FROM examples e JOIN targets t USING (example_id) JOIN tokens tk USING (example_id)
           WHERE list_contains($ids, e.example_id) GROUP BY ALL ORDER BY e.example_id""",
        {"ids": list(ids)},
    ).to_pylist()
    return {
        int(r["example_id"]): hashlib.sha256(
            json.dumps([r["ids"], r["subject_start"], r["subject_end"], r["object_token_id"]]).encode()
        ).hexdigest()[:16]
        for r in rows
    }


def write_checkpoint(store: StoreReader, state: Mapping[str, Any], out: Path) -> dict[str, int]:
    """Write the study's runs (see :data:`CHECKPOINT_TABLES`) to the folder ``out``, one file per
    table and run (``TABLE/RUN_ID.parquet``, text columns left out; a run already there is written
    again, to the same bytes), the runs' records and the facts' fingerprints; return the rows
    written per table.  Files an earlier checkpoint in ``out`` listed and this one does not (effect
    runs redone on more facts) are removed; no other file is touched."""
    doc_path = out / "checkpoint.json"
    earlier = json.loads(doc_path.read_text()).get("files", []) if doc_path.exists() else []
    ids: set[int] = set()
    counts: dict[str, int] = defaultdict(int)
    columns: dict[str, list[str]] = {}
    files: list[str] = []
    runs = store.sql(
        "SELECT * FROM runs WHERE list_contains($ids, run_id)", {"ids": [r for _, r in study_runs(state)]}
    )
    for kind, rid in study_runs(state):
        run = runs.filter(pc.equal(runs.column("run_id"), rid))
        if run.num_rows != 1:
            raise MethodsError(f"{store.url}: run {rid} of the state is not in the store")
        for name in CHECKPOINT_TABLES[kind]:
            t = store.table(name, files=[f"tables/{name}/{rid}.parquet"])
            columns[name] = t.column_names
            for col in ("example_id", "counterfactual_id"):
                if col in t.column_names:
                    ids |= {int(i) for i in t.column(col).to_pylist()}
            files.append(f"{name}/{rid}.parquet")
            (out / name).mkdir(parents=True, exist_ok=True)
            pq.write_table(t.drop_columns(list(DERIVED.get(name, {}))), out / files[-1], compression="zstd")
            counts[name] += t.num_rows
        files.append(f"runs/{rid}.parquet")
        (out / "runs").mkdir(parents=True, exist_ok=True)
        pq.write_table(run, out / files[-1], compression="zstd")
    fps = fact_fingerprints(store, sorted(ids))
    if len(fps) != len(ids):
        raise MethodsError(f"{store.url}: {len(ids) - len(fps)} facts of the runs are not in the store")
    pq.write_table(
        pa.table({"example_id": list(fps), "fingerprint": list(fps.values())}),
        out / "facts.parquet",
        compression="zstd",
    )
    model = store.manifest.model
    doc = {
        "format": CHECKPOINT_FORMAT,
        "model": {"name": model.get("name"), "weight_hash": model.get("weight_hash")},
        "columns": columns,
        "rows": counts,
        "files": files,
        "state": state,
    }
    doc_path.write_text(json.dumps(doc, indent=1) + "\n")
    for rel in sorted(set(earlier) - set(files)):
        stale = out / rel
        if stale.resolve().is_relative_to(out.resolve()) and stale.is_file():
            stale.unlink()
    return dict(counts)


def _read_doc(store: StoreReader, folder: Path) -> dict[str, Any]:
    """The checkpoint's ``checkpoint.json``, checked against ``store`` before anything is written."""
    try:
        doc = json.loads((folder / "checkpoint.json").read_text())
    except (OSError, ValueError) as e:
        raise MethodsError(f"{folder}: not a study checkpoint ({e})") from None
    if doc.get("format") != CHECKPOINT_FORMAT:
        raise MethodsError(
            f"{folder}: checkpoint format {doc.get('format')!r}, this code reads {CHECKPOINT_FORMAT}"
        )
    want, have = doc["model"].get("weight_hash"), store.manifest.model.get("weight_hash")
    if want != have:
        raise MethodsError(
            f"{store.url}: its model ({store.manifest.model.get('name')}) has other weights than "
            f"the checkpoint's ({doc['model'].get('name')})"
        )
    known = {n for names in CHECKPOINT_TABLES.values() for n in names} | {"runs"}
    for rel in doc.get("files", []):
        name, _, file = str(rel).partition("/")
        if name not in known or not re.fullmatch(r"[A-Za-z0-9_-]+\.parquet", file):
            raise MethodsError(
                f"{folder}: checkpoint.json names a file {rel!r} that is not TABLE/RUN_ID.parquet"
            )
    present = set(store.sql("SELECT run_id FROM runs").column("run_id").to_pylist())
    if clash := sorted({r for _, r in study_runs(doc["state"])} & present):
        raise MethodsError(f"{store.url}: already holds run {clash[0]} of the checkpoint")
    facts = pq.read_table(folder / "facts.parquet")
    fps = fact_fingerprints(store, [int(i) for i in facts.column("example_id").to_pylist()])
    for i, fp in zip(
        facts.column("example_id").to_pylist(), facts.column("fingerprint").to_pylist(), strict=True
    ):
        if fps.get(int(i)) != fp:
            raise MethodsError(
                f"{store.url}: fact {i} is not the checkpoint's fact {i} (other prompt, subject or "
                "object token, or missing): restore into a store ingested from the same data"
            )
    return dict(doc)


def restore_checkpoint(store: StoreReader, folder: Path) -> dict[str, Any]:
    """Write the runs of the checkpoint ``folder`` into ``store`` (which must hold the same facts
    and model weights, and none of the runs), the text columns read from the store; return the
    state, without the metric runs (they are not in a checkpoint)."""
    doc = _read_doc(store, folder)
    con = duckdb.connect()
    con.register("src_tokens", store.sql("SELECT example_id, position, token FROM tokens"))
    con.register("src_examples", store.sql("SELECT example_id, relation_id, subject, object FROM examples"))
    out: dict[str, pa.Table] = {}  # every file is made before the first is written
    for rel in doc["files"]:
        name = rel.split("/")[0]
        t = pq.read_table(folder / rel)
        if name != "runs":
            t = t.append_column("_row", pa.array(range(t.num_rows), pa.int64()))
            con.register("ck", t)
            joins, exprs = [], {c: f'ck."{c}"' for c in t.column_names}
            for j, (col, (src, src_col, keys)) in enumerate(DERIVED.get(name, {}).items()):
                on = " AND ".join(f'ck."{a}" = d{j}."{b}"' for a, b in keys)
                joins.append(f"LEFT JOIN src_{src} d{j} ON {on}")
                exprs[col] = f'd{j}."{src_col}"'
            sel = ", ".join(f'{exprs[c]} AS "{c}"' for c in doc["columns"][name])
            t = con.sql(f"SELECT {sel} FROM ck {' '.join(joins)} ORDER BY ck._row").to_arrow_table()
            con.unregister("ck")
            for col in DERIVED.get(name, {}):
                if t.column(col).null_count:
                    raise MethodsError(
                        f"{store.url}: {t.column(col).null_count} rows of {rel} find no {col} in the store"
                    )
        out[rel] = t
    for rel, t in sorted(out.items(), key=lambda kv: kv[0].startswith("runs/")):  # a run's row last
        name, rid = rel.split("/")[0], rel.split("/")[1].removesuffix(".parquet")
        if name == "runs":  # the original record (write_run would make a new one)
            store.location.write_bytes_atomic(f"tables/{rel}", to_parquet_bytes(t))
        else:
            write_result_table(store, name, rid, t)
    store.refresh()
    return {k: v for k, v in doc["state"].items() if not k.startswith("metrics_")}


def checkpoint_study(store: StoreReader, cfg: StudyCheckpointConfig) -> dict[str, int]:
    """The runs of the state ``cfg.state`` into the checkpoint folder ``cfg.out``; rows per table."""
    state = load_state(Path(cfg.state))
    if not study_runs(state):
        raise MethodsError(
            f"{cfg.state}: no runs to checkpoint (no state file, or a study that has traced nothing)"
        )
    return write_checkpoint(store, state, Path(cfg.out))


def restore_study(store: StoreReader, cfg: StudyRestoreConfig) -> dict[str, Any]:
    """The checkpoint ``cfg.checkpoint`` into ``store`` and its state into the new file ``cfg.state``."""
    state_path = Path(cfg.state)
    if state_path.exists():
        raise MethodsError(f"{state_path} exists; restore writes a new state file")
    state = restore_checkpoint(store, Path(cfg.checkpoint))
    save_state(state_path, state)
    return state
