"""Multi-process test harness: run a function on N gloo ranks, each run under a timeout.

``run_ranks(fn, world_size, *args)`` spawns ``world_size`` processes, makes a
gloo process group in each (through a file store), calls
``fn(rank, world_size, *args)`` and returns the ranks' return values in rank
order. A rank that raises fails the call with that rank's traceback; a run
that does not finish within ``timeout`` seconds is killed and fails, so a
hang costs seconds, not the CI run. ``fn`` must be a module-level function
(spawned processes import it by name) and its arguments and result picklable.
"""

from __future__ import annotations

import datetime
import io
import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

__all__ = ["collectives", "run_ranks"]

#: How long a collective waits for a missing peer before gloo gives up (seconds).
PG_TIMEOUT = 20.0


def _worker(
    rank: int,
    world_size: int,
    store: str,
    pg_timeout: float,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    results: Any,
) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout),
        )
        try:
            out = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        buffer = io.BytesIO()  # tensors go by value: a queue would share them through the dying process
        torch.save(out, buffer)
        results.put((rank, True, buffer.getvalue()))
    except BaseException:  # report everything, SystemExit included
        results.put((rank, False, traceback.format_exc()))


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 90.0,
    pg_timeout: float = PG_TIMEOUT,
    allow_failures: bool = False,
) -> list[Any]:
    """``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; their results in rank order.

    With ``allow_failures`` a failing rank's entry is the ``str`` of its
    traceback (or of its exit code, for a rank that died) instead of an
    error, for tests of failures; a timeout always fails.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    fd, store = tempfile.mkstemp(prefix="scalestate-store-")
    os.close(fd)
    os.unlink(store)
    procs = [
        ctx.Process(target=_worker, args=(rank, world_size, store, pg_timeout, fn, args, results), daemon=True)
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    got: dict[int, tuple[bool, Any]] = {}
    deadline = timeout
    start = time.monotonic()
    try:
        while len(got) < world_size:
            left = deadline - (time.monotonic() - start)
            if left <= 0:
                missing = sorted(set(range(world_size)) - set(got))
                raise TimeoutError(
                    f"{fn.__name__} on {world_size} ranks did not finish within {timeout:.0f} s; "
                    f"ranks {missing} never reported (a hang?). Finished: {_summary(got)}"
                )
            try:
                rank, ok, out = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in got]
                if dead and allow_failures:
                    got.update({i: (False, f"died with exit code {procs[i].exitcode}") for i in dead})
                elif dead:
                    raise RuntimeError(
                        f"ranks {dead} of {fn.__name__} died (exit codes "
                        f"{[procs[i].exitcode for i in dead]}). Finished: {_summary(got)}"
                    ) from None
                continue
            got[rank] = (ok, _load(out) if ok else out)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        if os.path.exists(store):
            os.unlink(store)
    failed = {rank: out for rank, (ok, out) in got.items() if not ok}
    if failed and not allow_failures:
        text = "\n".join(f"--- rank {rank} ---\n{tb}" for rank, tb in sorted(failed.items()))
        raise AssertionError(f"{fn.__name__} failed on ranks {sorted(failed)}:\n{text}")
    return [got[rank][1] for rank in range(world_size)]


def _load(data: bytes) -> Any:
    import torch

    return torch.load(io.BytesIO(data), weights_only=False)


def _summary(got: dict[int, tuple[bool, Any]]) -> str:
    return ", ".join(f"rank {r}: {'ok' if ok else 'error'}" for r, (ok, _) in sorted(got.items())) or "none"


def collectives(fn: Callable[[], Any]) -> tuple[Any, list[str]]:
    """Run ``fn()`` and name every gloo collective it issued, in order (from torch's profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = fn()
    return out, [e.name for e in prof.events() if e.name.startswith("gloo:")]
