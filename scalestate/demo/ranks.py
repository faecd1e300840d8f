"""Processes for ``scalestate demo --ranks N``: one gloo process group on this machine."""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["join_group", "launch"]

#: How long a collective waits for a missing rank before failing (a hang becomes an error).
TIMEOUT = datetime.timedelta(minutes=5)


@contextlib.contextmanager
def join_group() -> Iterator[None]:
    """Join the gloo group ``torchrun`` describes in the environment; leave it on exit."""
    dist.init_process_group("gloo", timeout=TIMEOUT)
    done = False
    try:
        yield
        done = True
    finally:
        _leave_group(done)


def launch(ranks: int, fn: Callable[[Any], int], arg: Any) -> int:
    """Run ``fn(arg)`` on ``ranks`` new processes in one gloo group; rank 0's exit status.

    The CPU's threads are shared out between the ranks.
    """
    fd, store = tempfile.mkstemp(prefix="scalestate-demo-")
    os.close(fd)
    os.unlink(store)
    threads = max(1, torch.get_num_threads() // ranks)
    ctx = mp.get_context("spawn")
    status = ctx.SimpleQueue()
    procs = [ctx.Process(target=_rank, args=(r, ranks, store, threads, fn, arg, status)) for r in range(ranks)]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join()
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        if os.path.exists(store):
            os.unlink(store)
    failed = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0]
    if failed:
        print(f"scalestate demo: ranks failed (rank, exit code): {failed}; see their errors above", file=sys.stderr)
        return 1
    code: int = status.get()
    return code


def _rank(rank: int, ranks: int, store: str, threads: int, fn: Callable[[Any], int], arg: Any, status: Any) -> None:
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=ranks, timeout=TIMEOUT)
    code = None
    try:
        code = fn(arg)
    finally:
        _leave_group(code is not None)
    if rank == 0:
        status.put(code)


def _leave_group(finished: bool) -> None:
    """Leave the group; a rank that finished first waits for every other one (a barrier), so that no
    rank tears down its gloo connections while a peer still uses them (seen as a rank aborting at exit,
    "terminate called without an active exception", after a successful run). A rank that failed leaves
    at once: waiting for the others could hang."""
    if finished:
        dist.barrier()
    dist.destroy_process_group()
