"""The command line as a whole: one package, shared option names, aliases of old spellings, errors
(one line, or one JSON object under --json), --debug, exit codes, a help that does not load torch,
--model defaulting to the store's model, and the run records every command writes."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import click
import pyarrow as pa
import pytest
from click.testing import CliRunner

import actstore
from actstore.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")

# the commands that make a store rather than read one, or read files and no store
NO_STORE = {"ingest", "import", "demo", "study data", "study tables", "study summary"}


def invoke(*args: str) -> click.testing.Result:
    return CliRunner().invoke(main, list(args))


# ----------------------------------------------------------------------------------- startup and help


# The torch-free modules of settings the command line builds its options from.
SETTINGS_MODULES = {
    "actstore.query.analyses",
    "actstore.query.analyses.lens_methods",
    "actstore.query.analyses.probe_config",
    "actstore.query.maps",
    "actstore.query.maps.defaults",
    "actstore.query.maps.settings",
    "actstore.ingest.settings",
    "actstore.query.methods",
    "actstore.query.methods.defaults",
    "actstore.jobs.settings",
    "actstore.jobs.study_settings",
    "actstore.interventions",
    "actstore.interventions.settings",
}


def test_help_does_not_import_torch_or_the_analysis_packages() -> None:
    code = (
        f"import sys\nfrom actstore.cli import main\nSETTINGS = {sorted(SETTINGS_MODULES)!r}\n"
        "for args in (['--help'], *([c, '--help'] for c in ('trace', 'patch', 'ablate', 'agree', 'maps', 'probe'))):\n"
        "    try:\n        main(args)\n    except SystemExit as e:\n        assert e.code == 0, (args, e.code)\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'matplotlib')"
        " or m.startswith(('actstore.ingest.', 'actstore.query.', 'actstore.jobs.', 'actstore.interventions.')) and m not in SETTINGS)\n"
        "print('HEAVY', heavy, file=sys.stderr)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "HEAVY []" in out.stderr, out.stderr
    assert "Commands:" in out.stdout and "trace" in out.stdout


def test_every_command_reads_its_store_first_and_documents_every_option() -> None:
    ctx = click.Context(main, info_name="actstore")
    assert set(main.list_commands(ctx)) >= {
        "info",
        "sql",
        "features",
        "verify",
        "ingest",
        "probe",
        "headscore",
        "tokenscore",
        "correlate",
        "shortcuts",
        "maps",
        "maps-dynamic",
        "trace",
        "patch",
        "ablate",
        "lens",
        "agree",
        "report",
        "demo",
    }
    commands: list[tuple[str, click.Command | None]] = []
    for name in main.list_commands(ctx):
        cmd = main.get_command(ctx, name)
        commands.append((name, cmd))
        if isinstance(cmd, click.Group):  # a group's commands are commands too (`study run`)
            sub = click.Context(cmd, info_name=name, parent=ctx)
            commands += [(f"{name} {n}", cmd.get_command(sub, n)) for n in cmd.list_commands(sub)]
    for name, cmd in commands:
        assert cmd is not None
        visible = [p for p in cmd.params if not getattr(p, "hidden", False)]
        if name not in NO_STORE and not isinstance(cmd, click.Group):
            first = visible[0]
            assert isinstance(first, click.Argument) and first.name == "store", name  # STORE comes first
        for p in visible:
            if isinstance(p, click.Option):
                assert p.help, (name, p.opts)  # every option says what it does
        assert cmd.epilog and f"actstore {name}" in cmd.epilog, name  # every command an example
        assert not [p for p in cmd.params if getattr(p, "hidden", False)], name  # one spelling, all shown


# ----------------------------------------------------------------------------------- spellings


@pytest.mark.parametrize(
    ("command", "old"),
    [
        ("lens", "--no-write"),
        ("lens", "--store"),
        ("probe", "--features"),
        ("agree", "--trace-run"),
        ("maps", "--heatmaps"),
    ],
)
def test_an_old_spelling_is_a_usage_error(tiny_store: Path, command: str, old: str) -> None:
    r = invoke(command, str(tiny_store), old, "x")
    assert r.exit_code == 2 and "No such option" in r.stderr and old in r.stderr, r.output


def test_sql_json_equals_format_json(tiny_store: Path) -> None:
    q = "SELECT relation_id, count(*) AS n FROM examples GROUP BY 1 ORDER BY 1"
    a, b = invoke("sql", str(tiny_store), q, "--json"), invoke("sql", str(tiny_store), q, "--format", "json")
    assert a.exit_code == b.exit_code == 0 and a.stdout == b.stdout
    rows = json.loads(a.stdout)
    direct = actstore.open(tiny_store).sql(q).to_pylist()
    assert [(r["relation_id"], r["n"]) for r in rows] == [(r["relation_id"], r["n"]) for r in direct]


def test_store_argument_is_required(tiny_store: Path) -> None:
    r = invoke("trace", "--limit", "1")
    assert r.exit_code == 2 and r.stderr.startswith("error: Missing argument 'STORE'")


def test_where_is_a_predicate_over_the_examples_table(tiny_store: Path) -> None:
    ok = invoke(
        "lens",
        str(tiny_store),
        "--no-tuned",
        "--no-save",
        "--json",
        "--where",
        "relation_id = 'country_capital'",
    )
    assert ok.exit_code == 0, ok.output
    n = (
        actstore.open(tiny_store)
        .sql(
            "SELECT count(*) AS n FROM examples e JOIN targets t USING (example_id) "
            "WHERE relation_id = 'country_capital' AND t.object_token_id >= 0"
        )
        .column("n")[0]
        .as_py()
    )
    assert json.loads(ok.stdout)["n_eval"] == n
    bad = invoke(
        "lens", str(tiny_store), "--no-tuned", "--no-save", "--where", "object_rank = 0"
    )  # a targets column
    assert bad.exit_code == 2 and "--where" in bad.stderr and "examples table" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1


# ----------------------------------------------------------------------------------- errors and exit codes


def test_json_errors_are_one_object_on_stdout(tiny_store: Path) -> None:
    r = invoke("sql", str(tiny_store), "SELEC nope", "--json")
    assert r.exit_code == 1 and r.stderr == ""
    err = json.loads(r.stdout)
    assert err["type"] == "QueryError" and err["exit_code"] == 1 and "syntax error" in err["error"]
    u = invoke("info", str(tiny_store), "--no-such-option", "--json")
    assert u.exit_code == 2 and json.loads(u.stdout)["type"] == "UsageError"
    missing = invoke("info", str(tiny_store.parent / "nowhere"), "--json")
    assert missing.exit_code == 1 and json.loads(missing.stdout)["type"] == "StoreNotFoundError"


def test_debug_shows_the_traceback_and_keeps_the_exit_code(tiny_store: Path) -> None:
    plain = invoke("sql", str(tiny_store), "SELEC nope")
    debug = invoke("--debug", "sql", str(tiny_store), "SELEC nope")
    assert plain.exit_code == debug.exit_code == 1
    assert "Traceback" not in plain.stderr and len(plain.stderr.strip().splitlines()) == 1
    assert debug.stderr.startswith("Traceback (most recent call last):")
    assert (
        "actstore/core/sql.py" in debug.stderr
        and debug.stderr.strip().splitlines()[-1] == plain.stderr.strip()
    )


def test_exit_codes(tiny_store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert invoke("info", str(tiny_store)).exit_code == 0
    assert invoke("info", str(tiny_store), "--bogus").exit_code == 2  # usage
    assert invoke("info", str(tmp_path / "nowhere")).exit_code == 1  # error
    damaged = tmp_path / "damaged"
    shutil.copytree(tiny_store, damaged)
    chunk = next(p for p in sorted((damaged / "segments").rglob("c.*")) if p.is_file())
    chunk.unlink()
    v = invoke("verify", str(damaged))
    assert v.exit_code == 3 and v.stdout.startswith("CORRUPT")  # verify found damage
    assert invoke("verify", str(tiny_store)).exit_code == 0

    import actstore.cli.store as store_commands

    def interrupted(path: str) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(store_commands, "open_store_arg", interrupted)
    r = invoke("info", str(tiny_store))
    assert r.exit_code == 130 and r.stderr.strip() == "error: interrupted"


def test_exit_codes_are_documented() -> None:
    doc = (Path(__file__).resolve().parents[3] / "docs" / "commands.md").read_text()
    for code, meaning in ((0, "success"), (1, "error"), (2, "usage"), (3, "verify"), (130, "interrupted")):
        assert re.search(rf"\|\s*{code}\s*\|[^\n]*{meaning}", doc, re.I), (code, meaning)


# ----------------------------------------------------------------------------------- --model


def test_model_defaults_to_the_stores_alias(tiny_store: Path, tmp_path: Path) -> None:
    from actstore.jobs.model import model_for_store

    s = actstore.open(tiny_store)
    assert s.manifest.model["name"] == "tiny-llama"
    assert model_for_store(s, None) == "tiny-llama" and model_for_store(s, "other") == "other"
    store = tmp_path / "s"
    shutil.copytree(tiny_store, store)
    r = invoke(
        "trace",
        str(store),
        "--all-facts",
        "--limit",
        "1",
        "--samples",
        "1",
        "--window",
        "1",
        "--quiet",
        "--json",
    )
    assert r.exit_code == 0, r.output
    run_id = json.loads(r.stdout)["run_id"]
    cfg = json.loads(
        actstore.open(store)
        .sql(f"SELECT config FROM runs WHERE run_id = '{run_id}'")
        .column("config")[0]
        .as_py()
    )
    assert cfg["model"] == "tiny-llama"


def test_a_store_model_that_is_no_alias_is_not_loaded_on_its_own(
    monkeypatch: pytest.MonkeyPatch, tiny_store: Path
) -> None:
    from actstore.core.errors import InvalidSetting
    from actstore.jobs.model import model_for_store

    fake = SimpleNamespace(url="mem://x", manifest=SimpleNamespace(model={"name": "/somewhere/else"}))
    with pytest.raises(InvalidSetting, match="never loaded from disk or the hub on its own") as e:
        model_for_store(fake, None)  # type: ignore[arg-type]
    assert e.value.setting == "model"
    import actstore.jobs.model as runs

    def refuse(store: object, model: str | None) -> str:
        raise InvalidSetting("model", "the store's model is not one of actstore's aliases")

    monkeypatch.setattr(runs, "model_for_store", refuse)
    r = invoke("trace", str(tiny_store), "--all-facts", "--limit", "1", "--window", "1")
    assert (  # a refused setting is a usage error (2; tests/cli/cli/test_exit_codes.py)
        r.exit_code == 2
        and r.stderr == "error: --model: the store's model is not one of actstore's aliases\n"
    )


# ----------------------------------------------------------------------------------- run records


def test_run_records_have_one_schema(tiny_store: Path, tmp_path: Path) -> None:
    from actstore.core.runs import RUNS_SCHEMA, code_version, new_run_id, run_record, with_run_id, write_run

    rid = new_run_id("maps-dynamic")
    assert re.fullmatch(r"maps-dynamic-\d{8}T\d{6}-[0-9a-f]{8}", rid)
    assert new_run_id("x") != new_run_id("x")
    with pytest.raises(ValueError):
        new_run_id("bad kind'")
    store = tmp_path / "s"
    shutil.copytree(tiny_store, store)
    s = actstore.open(store)
    path = write_run(s, rid, "maps-dynamic", 100.0, {"b": 1, "a": [1, 2]}, finished=160.0)
    assert path == f"tables/runs/{rid}.parquet"
    row = actstore.open(store).sql(f"SELECT * FROM runs WHERE run_id = '{rid}'").to_pylist()
    assert row == [
        {
            "run_id": rid,
            "kind": "maps-dynamic",
            "started": 100.0,
            "finished": 160.0,
            "segments_written": 0,
            "rank": 0,
            "world_size": 1,
            "config": '{"a": [1, 2], "b": 1}',
            "code_version": code_version(),
        }
    ]
    assert run_record(rid, "x", 0.0, "{}").schema == RUNS_SCHEMA
    from importlib.metadata import version

    assert code_version() == version("actstore")
    t = with_run_id(pa.table({"x": [1, 2]}), rid)
    assert t.column_names == ["run_id", "x"] and t.column("run_id").to_pylist() == [rid, rid]
    # the ingest's row and an analysis' row share the schema
    ingest_rows = actstore.open(store).sql("SELECT * FROM runs WHERE kind = 'ingest'")
    assert ingest_rows.num_rows >= 1 and ingest_rows.schema.names == RUNS_SCHEMA.names


def test_library_log_messages_reach_stderr_at_the_chosen_level() -> None:
    """INFO and up as ``actstore: MESSAGE`` by default, WARNING and up with --quiet, DEBUG with --debug;
    nothing on stdout, and repeated runs do not repeat a line (one handler)."""
    import logging

    @click.command("log-probe")
    @click.option("--quiet", is_flag=True)
    def log_probe(quiet: bool) -> None:
        for name, level in (
            ("actstore.ingest.models.cache", logging.DEBUG),
            ("actstore.query.report", logging.INFO),
            ("actstore.core.store", logging.WARNING),
        ):
            logging.getLogger(name).log(level, f"{logging.getLevelName(level).lower()} from {name}")

    main.add_command(log_probe)
    try:
        lines = {}
        for key, argv in (
            ("default", ["log-probe"]),
            ("again", ["log-probe"]),
            ("quiet", ["log-probe", "--quiet"]),
            ("debug", ["--debug", "log-probe"]),
        ):
            r = CliRunner().invoke(main, argv)
            assert r.exit_code == 0 and r.stdout == "", r.output
            lines[key] = r.stderr.splitlines()
    finally:
        del main.commands["log-probe"]
    assert (
        lines["default"]
        == lines["again"]
        == ["actstore: info from actstore.query.report", "actstore: warning from actstore.core.store"]
    )
    assert lines["quiet"] == ["actstore: warning from actstore.core.store"]
    assert lines["debug"] == ["actstore: debug from actstore.ingest.models.cache", *lines["default"]]


def test_patch_help_names_only_positions_the_patcher_accepts() -> None:
    from actstore.interventions.settings import POSITIONS

    cmd = main.get_command(click.Context(main), "patch")
    assert cmd is not None
    option = next(p for p in cmd.params if p.name == "positions")
    named = set(re.findall(r"\b(subject_\w+|last|first\w*)\b", str(getattr(option, "help", ""))))
    assert named and named <= set(POSITIONS), named
