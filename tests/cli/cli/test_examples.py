"""The scripts in examples/ run as documented (tiny model, temp dir)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def test_quickstart_runs() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    res = subprocess.run(
        [sys.executable, str(REPO / "examples" / "quickstart.py")],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=REPO,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout
    assert "<actstore.Store" in out and "<Selection of" in out
    assert "attn_head (" in out and "streamed z for" in out and "report: " in out
    err = float(out.split("max |difference| = ")[1].split()[0])
    assert err < 1e-4
