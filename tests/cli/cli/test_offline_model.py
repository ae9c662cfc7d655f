"""A hub name (owner/name) that is not in the local hub cache fails at once where the hub cannot be
reached: with ``ACTSTORE_OFFLINE`` or ``HF_HUB_OFFLINE`` set (read when the name is resolved), or where
the hub's host does not resolve or answer (one try, no retries), naming actstore's aliases."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from actstore.cli import main
from actstore.core.model_names import OFFLINE_ENV, hub_offline


@pytest.mark.parametrize("var", OFFLINE_ENV)
def test_a_hub_name_offline_fails_at_once_naming_the_aliases(
    var: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for v in OFFLINE_ENV:
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv(var, "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))  # an empty cache: the name is in none
    r = CliRunner().invoke(
        main,
        ["ingest", "--model", "some-owner/no-such-model", "--dataset", "demo", "--out", str(tmp_path / "s")],
    )
    lines = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.exit_code == 1 and len(lines) == 1, r.output
    assert (
        "unknown model 'some-owner/no-such-model': not an alias (smollm2-135m, gemma3-270m, tiny-llama"
        in lines[0]
    )
    assert f"{var} is set" in lines[0] and "Retrying" not in r.stderr
    assert not (tmp_path / "s").exists()


def test_the_offline_switch_reads_the_environment_now(monkeypatch: pytest.MonkeyPatch) -> None:
    for v in OFFLINE_ENV:
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv("ACTSTORE_OFFLINE", "0")  # 0 is off: the answer then comes from the network
    assert hub_offline() != "ACTSTORE_OFFLINE is set"
    monkeypatch.setenv("ACTSTORE_OFFLINE", "yes")
    assert hub_offline() == "ACTSTORE_OFFLINE is set"
    monkeypatch.delenv("ACTSTORE_OFFLINE")
    from huggingface_hub import constants

    for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # the discard port: nothing listens
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    reason = hub_offline()
    assert reason is not None and reason.startswith("http://127.0.0.1:9 cannot be reached")


@pytest.mark.parametrize("model", ["nosuchmodel", "some-owner/no-such-model", "./no/such/folder"])
def test_the_model_name_is_checked_before_the_data_set_is_read(
    model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A data set that does not exist is not what the one line names: the model is refused first."""
    monkeypatch.setenv("ACTSTORE_OFFLINE", "1")
    missing = tmp_path / "nowhere.jsonl"
    r = CliRunner().invoke(
        main, ["ingest", "--model", model, "--dataset", f"jsonl:{missing}", "--out", str(tmp_path / "s")]
    )
    lines = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.exit_code in (1, 2) and len(lines) == 1, r.output
    assert f"unknown model {model!r}" in lines[0] and "nowhere.jsonl" not in r.output
    assert not (tmp_path / "s").exists()
