"""A store on S3 at scale, with the HTTP requests each query makes counted: a local store uploaded to a
moto server (``python -m moto.server``, in its own process on 127.0.0.1), then each figure in a fresh
process, timed, with the requests the server saw during it, by type (GET of an object, HEAD, LIST, other).

    python -m benchmarks.bench_scale_s3 /work/big/tiny-100k --rounds 3 --json out.json

Figures (the Python ones with imports done before the clock starts; the commands end to end):

- ``open``: ``actstore.open(url)``; ``first_query``: then ``SELECT count(*) FROM examples``;
- ``point_sql``: ``SELECT * FROM examples WHERE example_id = ?`` on the open store, then
  ``point_resid``: that row's ``resid`` layer 1 (``select("example_id = n").features``);
- ``rel64``: 64 rows of one relation, ``resid`` layer 1; ``rel64_layer2``: the same rows, layer 2 (the
  same shards: their indexes are kept per open array, so one GET a row); each of the three again with
  other values (``*_again``: what a query costs once the store's tables are read);
- ``info``, ``verify_quick``: ``actstore info`` and ``actstore verify --quick`` in fresh processes.

The requests are counted from the server's own log (one line per request, written after its
response), read before and after each figure; a LIST is a GET of the bucket with a ``prefix``/``list-type``
query.  moto keeps the objects in memory: the store's bytes must fit in RAM.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import emit

BUCKET = "bench"
_LINE = re.compile(r"(GET|HEAD|PUT|POST|DELETE) (\S+) HTTP/[\d.]+")  # (werkzeug colours some lines)


def classify(log_text: str) -> dict[str, int]:
    """Requests in a slice of moto's log, by type: ``GET`` (an object), ``HEAD``, ``LIST``, ``other``."""
    out = {"GET": 0, "HEAD": 0, "LIST": 0, "other": 0}
    for method, target in _LINE.findall(log_text):
        path, _, query = target.partition("?")
        if method == "GET" and ("list-type" in query or "prefix=" in query or "delimiter" in query):
            out["LIST"] += 1
        elif method == "GET" and path.strip("/").count("/") == 0:  # the bucket itself: a list
            out["LIST"] += 1
        elif method in ("GET", "HEAD"):
            out[method] += 1
        else:
            out["other"] += 1
    return out


class Moto:
    """A moto server in a subprocess, its log in a file; :meth:`mark` and :meth:`since` slice the log."""

    def __init__(self, log: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = int(s.getsockname()[1])
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.log = log
        self._f = log.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=self._f,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    break
            except OSError:
                time.sleep(0.2)
        else:
            raise SystemExit("moto server did not start")
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("AWS_")},
            "AWS_ACCESS_KEY_ID": "bench",
            "AWS_SECRET_ACCESS_KEY": "bench",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def mark(self) -> int:
        time.sleep(0.3)  # the server writes a request's line after its response
        return self.log.stat().st_size

    def since(self, mark: int) -> dict[str, int]:
        end = self.mark()
        with self.log.open("rb") as f:
            f.seek(mark)
            return classify(f.read(end - mark).decode("utf-8", "replace"))

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self._f.close()


def upload(moto: Moto, store: Path, url: str) -> dict[str, Any]:
    import s3fs

    fs = s3fs.S3FileSystem(
        key="bench", secret="bench", client_kwargs={"endpoint_url": moto.endpoint}, use_listings_cache=False
    )
    fs.mkdir(BUCKET)
    files = [p for p in store.rglob("*") if p.is_file()]
    t0 = time.perf_counter()
    fs.put([str(p) for p in files], [f"{url}/{p.relative_to(store)}" for p in files], batch_size=64)
    return {"files": len(files), "bytes": sum(p.stat().st_size for p in files), "s": time.perf_counter() - t0}


QUERIES = r"""
import json, sys, time
import actstore, duckdb, pyarrow.dataset, actstore.query.select.selection, s3fs  # imports done
url, log, eid, eid2 = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
def mark():
    time.sleep(0.3)
    return open(log, "rb").seek(0, 2)
out = {}
def step(name, fn):
    m = mark()
    t = time.perf_counter()
    r = fn()
    out[name] = [round(1000 * (time.perf_counter() - t), 2), m]
    return r
s = step("open", lambda: actstore.open(url))
step("first_query", lambda: s.sql("SELECT count(*) AS n FROM examples"))
step("point_sql", lambda: s.sql("SELECT * FROM examples WHERE example_id = ?", [eid]))
step("point_resid", lambda: s.select(f"example_id = {eid}").features("resid", layers=[1]))
step("rel64", lambda: s.select("relation_id = 'R07'").limit(64).features("resid", layers=[1]))
step("rel64_layer2", lambda: s.select("relation_id = 'R07'").limit(64).features("resid", layers=[2]))
step("point_sql_again", lambda: s.sql("SELECT * FROM examples WHERE example_id = ?", [eid2]))
step("point_resid_again", lambda: s.select(f"example_id = {eid2}").features("resid", layers=[1]))
step("rel64_again", lambda: s.select("relation_id = 'R21'").limit(64).features("resid", layers=[1]))
out["end"] = [0, mark()]
print(json.dumps(out))
"""


def one_round(moto: Moto, url: str, n_rows: int, checkout: Path) -> dict[str, Any]:
    """Every figure once, each Python figure in one fresh process, the commands in their own."""
    py = str(checkout / ".venv" / "bin" / "python")
    env = {**moto.env, "PYTHONPATH": str(checkout), "OMP_NUM_THREADS": "1"}
    r = subprocess.run(
        [py, "-c", QUERIES, url, str(moto.log), str(n_rows // 2 + 7), str(n_rows // 3 + 11)],
        capture_output=True,
        text=True,
        env=env,
        cwd=checkout,
    )
    if r.returncode != 0:
        raise SystemExit(f"queries failed: {r.stderr.strip().splitlines()[-3:]}")
    got = json.loads(r.stdout.strip().splitlines()[-1])
    names = [k for k in got if k != "end"]
    marks = [got[k][1] for k in names] + [got["end"][1]]
    text = moto.log.read_bytes()
    out: dict[str, Any] = {}
    for i, name in enumerate(names):
        reqs = classify(text[marks[i] : marks[i + 1]].decode("utf-8", "replace"))
        out[name] = {"ms": got[name][0], **reqs}
    for name, cmd in (("info", ["info"]), ("verify_quick", ["verify", "--quick"])):
        m = moto.mark()
        t0 = time.perf_counter()
        c = subprocess.run(
            [py, "-m", "actstore.cli", *cmd, url], capture_output=True, text=True, env=env, cwd=checkout
        )
        ms = round(1000 * (time.perf_counter() - t0), 1)
        if c.returncode != 0:
            raise SystemExit(f"{cmd} failed: {c.stderr.strip().splitlines()[-1:]}")
        out[name] = {"ms": ms, **moto.since(m)}
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("store", type=Path, help="a local store (bench_scale.py build) to upload")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--checkout", type=Path, action="append", help="code to run (repeat); default: this one")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    import actstore

    n_rows = actstore.open(a.store).n_rows
    checkouts = a.checkout or [Path(__file__).resolve().parents[1]]
    with tempfile.TemporaryDirectory() as tmp:
        moto = Moto(Path(tmp) / "moto.log")
        try:
            url = f"s3://{BUCKET}/{a.store.name}"
            up = upload(moto, a.store, url)
            runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
            for _ in range(a.rounds):
                for co in checkouts:
                    for k, v in one_round(moto, url, n_rows, co).items():
                        runs.setdefault(str(co), {}).setdefault(k, []).append(v)
        finally:
            moto.close()
    result: dict[str, Any] = {"store": str(a.store), "rows": n_rows, "upload": up}
    for co, figs in runs.items():
        result[co] = {
            k: {
                "ms_median": round(statistics.median(r["ms"] for r in rs), 1),
                "ms_all": [r["ms"] for r in rs],
                **{t: rs[-1][t] for t in ("GET", "HEAD", "LIST", "other")},
                "requests_same_each_round": all(
                    [r[t] for t in ("GET", "HEAD", "LIST")] == [rs[0][t] for t in ("GET", "HEAD", "LIST")]
                    for r in rs
                ),
            }
            for k, rs in figs.items()
        }
    emit(result, a.json)


if __name__ == "__main__":
    main()
