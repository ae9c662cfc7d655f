"""Several ingest processes writing one store: ranks from ``torchrun``, a gloo process group.

Each rank takes the segments ``s % world_size == rank`` (see :func:`actstore.ingest.pipeline.ingest_prompts`),
so ranks write disjoint row ranges and never the same file.  Rank 0 alone creates the store
(weights, heads table, manifest); the other ranks wait for it.  With a process group (what
``torchrun`` sets up through :func:`join_process_group`) rank 0 broadcasts the outcome, so a
failed creation fails every rank at once; without one (ranks started with ``RANK`` and
``WORLD_SIZE`` under a launcher's lock), the others poll for ``manifest.json``.

One writer per store (:mod:`actstore.core.lock`): under ``actstore ingest --procs N`` the launcher
takes the store's writer lock before it starts torchrun and holds it until torchrun has exited;
the ranks check its token (``ACTSTORE_WRITER_LOCK``) and run under it.  Under a bare torchrun,
rank 0 takes the lock, broadcasts the outcome, and lets it go only after every rank finished
(:func:`ranks_writer_lock`).  Ranks without a process group and without a launcher cannot share
a lock and are refused.

The ranks, and torchrun itself, start without the current directory on ``sys.path``
(:func:`safe_python`): a user's ``ingest.py`` or ``torch.py`` there is never imported.

Bitwise equality with a single-process ingest holds because a segment's bytes depend only on
its prompts, the settings and the arithmetic; keep the number of intra-op threads the same
(``OMP_NUM_THREADS``; ``torchrun`` sets 1 per rank) as CPU kernels may sum in another order.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import TextIO, TypeVar

import torch.distributed as dist

from actstore.core.errors import RankError
from actstore.core.lock import LOCK_ENV, held_by_peer, under_launcher, writer_lock
from actstore.core.storage.base import StoreLocation

T = TypeVar("T")

WAIT_SECONDS = float(os.environ.get("ACTSTORE_RANK_WAIT", "1800"))  # how long ranks wait for rank 0's store


def ranks_from_env() -> tuple[int, int]:
    """``(RANK, WORLD_SIZE)`` as torchrun sets them; ``(0, 1)`` when absent."""
    try:
        rank = int(os.environ.get("RANK", "0"))
        world = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise RankError("RANK and WORLD_SIZE must be integers") from None
    if world < 1 or not 0 <= rank < world:
        raise RankError(f"RANK={rank} is not in 0..WORLD_SIZE-1 (WORLD_SIZE={world})")
    return rank, world


def rank_device(device: str, world: int) -> str:
    """``device`` for this rank: under ranks on one node, ``cuda`` becomes ``cuda:LOCAL_RANK`` (modulo the
    GPUs there: ranks share them when there are fewer); anything else as it is."""
    if device == "cuda" and world > 1 and os.environ.get("LOCAL_RANK", "").isdigit():
        import torch

        return f"cuda:{int(os.environ['LOCAL_RANK']) % max(1, torch.cuda.device_count())}"
    return device


def join_process_group(rank: int, world: int) -> bool:
    """Join the gloo group torchrun describes (``MASTER_ADDR``/``MASTER_PORT``); False without one."""
    if world == 1 or not dist.is_available() or "MASTER_ADDR" not in os.environ:
        return False
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=WAIT_SECONDS))
    return True


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def leave_process_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def compact_after_ranks(loc: StoreLocation, rank: int, grouped: bool) -> None:
    """Once every rank of a group has written its segments, rank 0 alone writes one snapshot of them all
    (nothing without a group: ranks under a launcher's lock with no process group compact nothing)."""
    if not grouped:
        return
    barrier()
    if rank == 0:
        from actstore.core.compact import compact_held, compacted_fully

        if not compacted_fully(loc):
            compact_held(loc, full=True)


def rank_zero_first(
    create: Callable[[], T], open_existing: Callable[[], T], rank: int, world: int, loc: StoreLocation
) -> T:
    """Rank 0 runs ``create``; the others wait until it succeeded, then run ``open_existing``."""
    if world == 1:
        return create()
    grouped = dist.is_available() and dist.is_initialized()
    if rank == 0:
        try:
            result = create()
        except BaseException as e:
            if grouped:
                dist.broadcast_object_list([f"{type(e).__name__}: {e}"], src=0)
            raise
        if grouped:
            dist.broadcast_object_list([None], src=0)
        return result
    if grouped:
        box: list[object] = [None]
        dist.broadcast_object_list(box, src=0)
        if box[0] is not None:
            raise RankError(f"rank 0 could not create {loc.url}: {box[0]}")
    else:
        _wait_for_manifest(loc)
    return open_existing()


@contextlib.contextmanager
def ranks_writer_lock(
    loc: StoreLocation,
    rank: int,
    world: int,
    grouped: bool,
    log: Callable[[str], None],
    command: str = "actstore ingest",
) -> Iterator[None]:
    """Hold the store's writer lock for this ingest: taken here (one process), checked (ranks under
    ``--procs``, whose launcher holds it), or taken by rank 0 for every rank (bare torchrun)."""
    token = os.environ.get(LOCK_ENV)
    if token:
        with under_launcher(loc, token):
            yield
        return
    if world == 1:
        with writer_lock(loc, command=command, log=log):
            yield
        return
    if not grouped:
        raise RankError(
            "ranks started by hand (RANK and WORLD_SIZE without MASTER_ADDR) cannot share the store's "
            "writer lock: use actstore ingest --procs N, or torchrun"
        )
    with contextlib.ExitStack() as stack:
        if rank == 0:
            try:
                stack.enter_context(writer_lock(loc, command=command, log=log))
            except BaseException as e:
                dist.broadcast_object_list([" ".join(str(e).split()) or type(e).__name__], src=0)
                raise
            dist.broadcast_object_list([None], src=0)
        else:
            box: list[object] = [None]
            dist.broadcast_object_list(box, src=0)
            if box[0] is not None:
                raise RankError(f"rank 0: {box[0]}")
            stack.enter_context(held_by_peer(loc))
        yield
        barrier()  # every rank has written its segments before rank 0 lets the lock go


def _wait_for_manifest(loc: StoreLocation) -> None:
    deadline = time.monotonic() + WAIT_SECONDS
    while not loc.exists("manifest.json"):
        if time.monotonic() > deadline:
            raise RankError(
                f"rank 0 did not create {loc.url} within {WAIT_SECONDS:.0f}s (ACTSTORE_RANK_WAIT)"
            )
        time.sleep(0.5)


# --------------------------------------------------------------------------------------- --procs

_RANK_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
)
# torchrun's own lines (its logger: "E0101 12:00:00.123000 4242 torch/distributed/...") and the
# traceback it prints after a rank failed; the ranks' own "error: ..." lines say what went wrong.
_LAUNCHER_LINE = re.compile(r"^(\[[^\]]*\]:)?[EWI]\d{4} \d\d:\d\d:\d\d")
# A rank's C++ log line (glog format, e.g. "[E1201 09:31:07.04 ProcessGroupGloo.cpp:67] ..."): once a rank
# has reported an error, the others' complaints that it went away are noise.
_NATIVE_LOG_LINE = re.compile(r"^\[[EWIF]\d{4} \d\d:\d\d:\d\d")


# ``python -c`` puts '' (the current directory) first on sys.path, as ``-m`` does; this removes it
# before anything is imported (``sys`` is built in), then runs the module named by the first argument as ``-m`` would.
# (``-P`` does the same from Python 3.11 on; this works on 3.10 too.)
_BOOTSTRAP = (
    "import sys; sys.path[:] = [p for p in sys.path if p != '']; sys.argv[:] = sys.argv[1:]; "
    "import runpy; runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)"
)


def safe_python(module: str, *, unbuffered: bool = False) -> list[str]:
    """``python -m MODULE`` without the current directory on ``sys.path``."""
    return [sys.executable, *(["-u"] if unbuffered else []), "-c", _BOOTSTRAP, module]


def torchrun_command(procs: int, args: Sequence[str], command: str = "ingest") -> list[str]:
    """``torchrun --standalone --nproc_per_node N --no-python python -m actstore.cli ingest ...`` (or
    ``import``), both Pythons started by :func:`safe_python` (torchrun's own ``-m`` would put the cwd
    on sys.path)."""
    return [
        *safe_python("torch.distributed.run"),
        "--standalone",
        "--nproc_per_node",
        str(procs),
        "--no-python",
        *safe_python("actstore.cli", unbuffered=True),
        command,
        *args,
    ]


def launch_ranks(
    procs: int,
    args: Sequence[str],
    *,
    out: str | None = None,
    stderr: TextIO | None = None,
    log: Callable[[str], None] | None = None,
    precheck: Callable[[], None] | None = None,
    command: str = "ingest",
    after: Callable[[int], None] | None = None,
) -> tuple[int, str | None]:
    """Run the ingest (or ``command``: ``import``) as ``procs`` ranks under torchrun on this machine and
    wait for it.

    With ``out``, the store's writer lock is taken first and held until torchrun has exited
    (its token goes to the ranks in ``ACTSTORE_WRITER_LOCK``; locally the locked file stays
    open in torchrun too, so the lock outlives a killed launcher while ranks still write).
    Ranks get ``OMP_NUM_THREADS=1`` unless it is set (torchrun's default too, and what makes
    a rank's arithmetic that of a one-thread single-process ingest).  The ranks' output passes
    through (progress on stderr, one summary line per rank on stdout), except their ``error:``
    lines and torchrun's own report of a failed rank.  Returns (exit status, the first error
    line of a rank, without ``error: ``; one naming what went wrong before an internal error, which
    is what the other ranks say when the failed one went away).  An exception here (Ctrl-C, SIGTERM)
    stops torchrun and its ranks before the lock is let go.  ``after(status)`` runs once torchrun has
    exited, still under the lock (an import removes the store its ranks created when one failed).
    """
    if procs < 1:
        raise RankError(f"--procs must be at least 1, not {procs}")
    if os.environ.get("WORLD_SIZE") not in (None, "", "1") or "LOCAL_RANK" in os.environ:
        raise RankError(
            "--procs starts the ranks itself: run it without torchrun (or torchrun without --procs)"
        )
    err = stderr or sys.stderr
    env = {k: v for k, v in os.environ.items() if k not in _RANK_VARS and k != LOCK_ENV}
    env.setdefault("OMP_NUM_THREADS", "1")
    if out is None:
        return _run_torchrun(procs, args, env, err, (), command)
    with writer_lock(out, command=f"actstore {command} --procs {procs}", log=log or (lambda m: None)) as lock:
        if lock is None:
            raise RankError(f"this process already writes {out}")
        if precheck is not None:  # e.g. refuse an existing store with one line before any rank starts
            precheck()
        env[LOCK_ENV] = lock.token
        rc, error = _run_torchrun(procs, args, env, err, lock.inheritable_fds(), command)
        if after is not None:
            after(rc)
        return rc, error


def _run_torchrun(
    procs: int,
    args: Sequence[str],
    env: dict[str, str],
    err: TextIO,
    fds: tuple[int, ...],
    command: str = "ingest",
) -> tuple[int, str | None]:
    proc = subprocess.Popen(
        torchrun_command(procs, args, command), env=env, stderr=subprocess.PIPE, pass_fds=fds
    )
    try:
        return _follow(proc, err)
    except BaseException:
        proc.terminate()  # torchrun passes SIGTERM on to the ranks
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        raise


def _follow(proc: subprocess.Popen[bytes], err: TextIO) -> tuple[int, str | None]:
    assert proc.stderr is not None
    errors: list[str] = []
    quiet = False  # set once torchrun starts reporting a failure: what follows is its traceback

    def handle(piece: bytes) -> None:
        nonlocal quiet
        text = piece.decode("utf-8", "replace")
        launcher = _LAUNCHER_LINE.match(text)
        if text.startswith("error: "):
            errors.append(text.strip()[len("error: ") :])
        elif errors and _NATIVE_LOG_LINE.match(text):
            pass
        elif launcher:  # torchrun's log: drop it; its first error line starts the failure report
            quiet = quiet or text[len(launcher.group(1) or "") :].startswith("E")
        elif not quiet:
            err.write(text)
            err.flush()

    buf = b""
    while True:
        chunk = proc.stderr.read1(65536) if hasattr(proc.stderr, "read1") else proc.stderr.read(65536)
        if not chunk:
            break
        buf += chunk
        *pieces, buf = re.split(rb"(?<=[\r\n])", buf)  # whole lines, and progress-bar updates ending in \r
        for p in pieces:
            handle(p)
    if buf:
        handle(buf)
    rc = proc.wait()
    # a rank's own error before the others' "internal error" (a peer that went away while they waited)
    named = [e for e in errors if not e.startswith("internal error: ")]
    return rc, (named or errors)[0] if errors else None
