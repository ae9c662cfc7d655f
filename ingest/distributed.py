"""Several ingest processes writing one store: ranks from ``torchrun``, a gloo process group.

Each rank takes the segments ``s % world_size == rank`` (see :func:`ingest.pipeline.run_ingest`),
so ranks write disjoint row ranges and never the same file.  Rank 0 alone creates the store
(weights, heads table, manifest); the other ranks wait for it.  With a process group (what
``torchrun`` sets up through :func:`join_process_group`) rank 0 broadcasts the outcome, so a
failed creation fails every rank at once; without one (ranks started by hand with ``RANK`` and
``WORLD_SIZE``), the others poll for ``manifest.json``.

Bitwise equality with a single-process ingest holds because a segment's bytes depend only on
its prompts, the settings and the arithmetic; keep the number of intra-op threads the same
(``OMP_NUM_THREADS``; ``torchrun`` sets 1 per rank) as CPU kernels may sum in another order.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

import torch.distributed as dist

from actstore.errors import ActstoreError
from actstore.fs import locate

T = TypeVar("T")

WAIT_SECONDS = float(os.environ.get("ACTSTORE_RANK_WAIT", "1800"))  # how long ranks wait for rank 0's store


class RankError(ActstoreError, RuntimeError):
    """Another rank failed, or the ranks' settings are inconsistent."""


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


def rank_zero_first(create: Callable[[], T], open_existing: Callable[[], T], rank: int, world: int,
                    out: str) -> T:
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
            raise RankError(f"rank 0 could not create {out}: {box[0]}")
    else:
        _wait_for_manifest(out)
    return open_existing()


def _wait_for_manifest(out: str) -> None:
    loc = locate(out)
    deadline = time.monotonic() + WAIT_SECONDS
    while not loc.exists("manifest.json"):
        if time.monotonic() > deadline:
            raise RankError(f"rank 0 did not create {out} within {WAIT_SECONDS:.0f}s (ACTSTORE_RANK_WAIT)")
        time.sleep(0.5)
