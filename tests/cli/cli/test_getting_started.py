"""docs/getting-started.md runs as written, with the substitutions the page states: tiny-llama for
smollm2-135m, the FewRel fixture for the real validation split, layer 1 for layer 6."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from click.testing import CliRunner

from actstore.cli import main

REPO = Path(__file__).resolve().parents[3]
PAGE = (REPO / "docs" / "getting-started.md").read_text()
FIXTURE = REPO / "tests" / "data" / "fewrel" / "val_wiki.json"

pytestmark = pytest.mark.usefixtures("one_thread")


def _page_command(start: str) -> str:
    line = next(x for x in PAGE.splitlines() if x.startswith(start))
    return line.split("#")[0].strip()


def _substitute(cmd: str, store: Path) -> list[str]:
    cmd = cmd.replace("--model smollm2-135m", "--model tiny-llama").replace(
        "--dataset fewrel", f"--dataset fewrel:{FIXTURE}"
    )
    args = re.findall(r'"[^"]*"|\S+', cmd)[1:]  # without "actstore"
    return [str(store) if a == "/tmp/s" else a.strip('"') for a in args]


def _run(args: list[str]) -> str:
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, (args, r.output)
    return r.output


def test_getting_started_runs(tmp_path: Path) -> None:
    store = tmp_path / "s"
    out = _run(_substitute(_page_command("actstore ingest"), store))
    assert "96 prompts in 8 relations" in out and f"wrote {store}: 96 examples" in out

    out = _run(_substitute(_page_command("actstore sql"), store))
    assert out.split("\n")[0].split() == ["relation_id", "n"] and "P177  12" in out

    out = _run(_substitute(_page_command("actstore probe"), store))
    assert "attn_head 5-way 5-shot: accuracy" in out and "over 20 episodes (20 x 1 seeds)" in out
    run_id = re.search(r"run (probe-\S+)", out).group(1)  # type: ignore[union-attr]
    out = _run(
        [a if a != "RUN_ID" else run_id for a in _substitute(_page_command("actstore headscore"), store)]
    )
    assert "mean HeadScore over" in out

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    args = [*_substitute(_page_command("actstore serve"), store), "--port", str(port)]
    proc = subprocess.Popen(
        [sys.executable, "-c", "from actstore.cli import main; main()", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5) as resp:
                    assert resp.status == 200
                    assert "<title>Store s" in resp.read().decode()
                break
            except OSError:
                assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
                time.sleep(0.5)
        else:
            pytest.fail("the explorer did not answer within 60 s")
    finally:
        proc.terminate()
        out = proc.communicate(timeout=30)[0]
    assert f"serving s on http://127.0.0.1:{port}/" in out

    code = PAGE.split("```python\n", 1)[1].split("```", 1)[0]
    code = code.replace('"/tmp/s"', repr(str(store))).replace("layers=[6]", "layers=[1]")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "torch.Size([32, 1, 64])"
