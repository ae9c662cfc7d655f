"""Crash safety: SIGKILL ``actstore ingest`` at random moments, resume, compare with an uninterrupted run.

Each trial (its own seed) starts the real CLI in a subprocess and kills it with SIGKILL at a
random moment.  By default (``--anchor commits``) the moment is drawn as "k commit markers
exist, then a random fraction of one segment's time more", k uniform in 0..n_segments, so
kills spread over store creation, capture, segment writes, commits and the final run record
whatever the machine's load; ``--anchor time`` instead draws a delay uniform over the
reference run's duration (data set loaded -> store written).  The harness then checks
what a reader sees in the killed store (only whole committed segments, every committed byte
intact), sometimes kills the resumed ingest once more, resumes to the end and compares the
result file by file with the uninterrupted store: every byte of the manifest, weights, segment
arrays, table shards and commit markers must be equal (only ``tables/runs/``, which records
when each run happened, differs by design).

    python benchmarks/crash_safety.py                    # 20 trials, seeds 0..19
    python benchmarks/crash_safety.py --trials 50 --json result.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO

INGEST = [
    "--model",
    "tiny-llama",
    "--dataset",
    "demo",
    "--batch-size",
    "4",
    "--segment-size",
    "8",
    "--dtype",
    "float16",
]


@dataclass
class Trial:
    seed: int
    kill_after_s: float  # after the data set was loaded, or after `after_commits` markers existed
    after_commits: int = 0
    phase: str = ""  # what the kill interrupted: startup | creation | capture | finished
    committed_at_kill: int = 0
    second_kill: bool = False
    ok: bool = False
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0


def cli(out: Path, limit: int, resume: bool = False) -> list[str]:
    return [
        sys.executable,
        "-m",
        "actstore.cli",
        "ingest",
        *INGEST,
        "--limit-per-relation",
        str(limit),
        "--out",
        str(out),
        *(["--resume"] if resume else []),
    ]


class Ingest:
    """An ``actstore ingest`` subprocess whose output is drained by threads, noting when the data
    set is loaded (its first stderr line) and when it reports the finished store (stdout)."""

    def __init__(self, cmd: list[str]) -> None:
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env()
        )
        self.loaded = threading.Event()
        self.wrote = threading.Event()
        self.output: list[str] = []
        threading.Thread(
            target=self._drain, args=(self.proc.stderr, self.loaded, "dataset "), daemon=True
        ).start()
        threading.Thread(
            target=self._drain, args=(self.proc.stdout, self.wrote, "wrote "), daemon=True
        ).start()

    def _drain(self, stream: IO[str] | None, event: threading.Event, marker: str) -> None:
        assert stream is not None
        tail = ""
        for chunk in iter(lambda: stream.read(64), ""):
            self.output.append(chunk)
            tail = (tail + chunk)[-256:]
            if marker in tail:
                event.set()
        event.set()  # the stream closed: the process is gone

    def kill_after_load(self, delay: float, commits: Path | None = None, after_commits: int = 0) -> bool:
        """SIGKILL ``delay`` seconds after the data set was loaded (and, with ``commits``, after
        ``after_commits`` markers exist there); False if the process had already exited."""
        self.loaded.wait()
        while commits is not None and self.proc.poll() is None and _count(commits) < after_commits:
            time.sleep(0.002)
        deadline = time.monotonic() + delay
        while time.monotonic() < deadline and self.proc.poll() is None:
            time.sleep(0.005)
        alive = self.proc.poll() is None
        if alive:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        return alive


def run_and_kill(cmd: list[str], delay: float, commits: Path | None = None, after_commits: int = 0) -> bool:
    """Start ``cmd``; once it has loaded its data set (and ``after_commits`` segments are
    committed), wait ``delay`` s and SIGKILL it.  Returns False when it finished before the kill."""
    return Ingest(cmd).kill_after_load(delay, commits, after_commits)


def _count(commits: Path) -> int:
    try:
        return sum(1 for n in os.listdir(commits) if n.endswith(".json"))
    except FileNotFoundError:
        return 0


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def files(root: Path) -> dict[str, bytes]:
    """Every file of a store except the per-run records and leftover temp files of killed writes."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_file() and not rel.startswith("tables/runs/") and ".tmp-" not in p.name:
            out[rel] = p.read_bytes()
    return out


def check_partial(out: Path, trial: Trial) -> None:
    """What a reader sees right after the kill: whole committed segments only, all intact."""
    import actstore
    from actstore.core.verify import verify_store

    if not (out / "manifest.json").exists():
        trial.phase = "startup" if not out.exists() else "creation"
        return
    s = actstore.open(out)
    trial.committed_at_kill = len(s.commits)
    trial.phase = "finished" if s.complete else "capture"
    n = s.sql("SELECT (SELECT count(*) FROM targets) AS t, (SELECT count(*) FROM examples) AS e").to_pylist()[
        0
    ]
    if not n["t"] == n["e"] == s.n_rows:
        trial.problems.append(f"partial store shows {n} rows, commits hold {s.n_rows}")
    segs = set(s.sql("SELECT DISTINCT segment FROM targets").column("segment").to_pylist())
    if segs != set(s.commits):
        trial.problems.append(f"uncommitted segments visible: {sorted(segs - set(s.commits))}")
    report = verify_store(s)
    if not report.ok:
        trial.problems.extend(f"partial: {p}" for p in report.problems)


def run_trial(
    seed: int,
    workdir: Path,
    reference: dict[str, bytes],
    window: float,
    limit: int,
    n_segments: int,
    anchor: str,
) -> Trial:
    rng = random.Random(seed)
    out = workdir / f"trial-{seed}"
    if anchor == "commits":
        after = rng.randint(0, n_segments)
        trial = Trial(seed, round(rng.uniform(0.0, window / n_segments), 3), after_commits=after)
    else:
        trial = Trial(seed, round(rng.uniform(0.0, window), 3))
    t0 = time.monotonic()
    try:
        killed = run_and_kill(
            cli(out, limit),
            trial.kill_after_s,
            out / "commits" if anchor == "commits" else None,
            trial.after_commits,
        )
        check_partial(out, trial)
        if not killed:
            trial.phase = "finished"
        resume = (out / "manifest.json").exists() or (out / ".creating").exists()
        if rng.random() < 0.25:  # kill the resumed ingest too
            trial.second_kill = True
            if anchor == "commits":
                run_and_kill(
                    cli(out, limit, resume=resume),
                    rng.uniform(0.0, window / n_segments),
                    out / "commits",
                    rng.randint(_count(out / "commits"), n_segments),
                )
            else:
                run_and_kill(cli(out, limit, resume=resume), rng.uniform(0.0, window))
            resume = (out / "manifest.json").exists() or (out / ".creating").exists()
        done = subprocess.run(
            cli(out, limit, resume=resume) + ["--quiet"],
            capture_output=True,
            text=True,
            env=_env(),
            timeout=900,
        )
        if done.returncode != 0:
            trial.problems.append(f"resume failed: {done.stderr.strip()[-300:]}")
        else:
            got = files(out)
            missing, extra = sorted(set(reference) - set(got)), sorted(set(got) - set(reference))
            differ = sorted(k for k in set(reference) & set(got) if reference[k] != got[k])
            for what, names in (("missing", missing), ("unexpected", extra), ("different", differ)):
                if names:
                    trial.problems.append(f"{len(names)} {what} files, e.g. {names[:3]}")
    except Exception as e:  # a crash of the harness is a failed trial, not a crashed benchmark
        trial.problems.append(f"{type(e).__name__}: {e}")
    trial.ok = not trial.problems
    trial.seconds = round(time.monotonic() - t0, 1)
    shutil.rmtree(out, ignore_errors=True)
    return trial


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0, help="first seed; trial i uses seed + i")
    ap.add_argument("--limit-per-relation", type=int, default=30, help="corpus size (demo: 6 relations)")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None, help="write the trials and summary here")
    ap.add_argument(
        "--anchor",
        choices=["commits", "time"],
        default="commits",
        help="draw the kill moment after k commits (default) or over the reference run's duration",
    )
    args = ap.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="actstore-crash-"))
    workdir.mkdir(parents=True, exist_ok=True)
    ref = workdir / "reference"
    shutil.rmtree(ref, ignore_errors=True)
    t0 = time.monotonic()
    run = Ingest(cli(ref, args.limit_per_relation))
    run.loaded.wait()
    t_data = time.monotonic()
    run.wrote.wait()
    window = time.monotonic() - t_data  # data set loaded -> store reported written: where the kills land
    if run.proc.wait() != 0:
        print("reference ingest failed:", "".join(run.output)[-500:], file=sys.stderr)
        return 2
    reference = files(ref)
    n_segments = len([k for k in reference if k.startswith("commits/")])
    print(
        f"reference: {len(reference)} files, {sum(map(len, reference.values())) / 1e6:.1f} MB, "
        f"kill window {window:.1f}s (startup {t_data - t0:.1f}s)",
        flush=True,
    )
    trials = []
    for i in range(args.trials):
        t = run_trial(
            args.seed + i, workdir, reference, window * 1.05, args.limit_per_relation, n_segments, args.anchor
        )
        trials.append(t)
        status = "ok  " if t.ok else "FAIL"
        print(
            f"{status} seed={t.seed:<3} kill@{t.after_commits:>2}+{t.kill_after_s:5.2f}s phase={t.phase:<8} "
            f"committed={t.committed_at_kill:<3} second_kill={t.second_kill!s:<5} {t.seconds:5.1f}s "
            f"{'; '.join(t.problems)}",
            flush=True,
        )
    phases = {p: sum(t.phase == p for t in trials) for p in ("startup", "creation", "capture", "finished")}
    summary = {
        "trials": len(trials),
        "passed": sum(t.ok for t in trials),
        "failed": sum(not t.ok for t in trials),
        "second_kills": sum(t.second_kill for t in trials),
        "phases_at_kill": phases,
        "segments_per_store": n_segments,
        "anchor": args.anchor,
        "seconds": round(time.monotonic() - t0, 1),
    }
    print(json.dumps(summary))
    if args.json:
        args.json.write_text(
            json.dumps({"summary": summary, "trials": [asdict(t) for t in trials]}, indent=2)
        )
    if not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0 if summary["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
