"""A training process that tests/test_crash.py kills with SIGKILL and resumes.

    python tests/crash_worker.py CKPT --steps N [--snapshots DIR] [--die-at STEP:WHERE]

It trains a small converted model (the demo's transformer ``Block`` and a
dropout under non-reentrant ``torch.utils.checkpoint``, then an FP8 head) with
``DelayedScaling`` on the emulation backend, 2 microbatches per step, AdamW,
and after every step saves model, optimizer, manager state, the torch RNG
state, the step and every loss so far to CKPT with ``atomic_save``, the
recipe of docs/checkpointing.md. If CKPT exists it resumes from it.

Output, one flushed line each: ``ready <first step>`` once built (and
resumed), ``begin <step>`` before each step, ``done`` at the end.

``--snapshots DIR``: also keep each step's checkpoint as ``DIR/step<k>.pt``
(``k`` = its ``step`` entry), for the test to compare with.
``--die-at K:write`` / ``K:rename``: SIGKILL this process while it saves
the checkpoint whose ``step`` is K: half-way through writing its bytes (a torn
temporary file), or just before the rename (the temporary file complete and
synced).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import Any, BinaryIO

import torch
import torch.utils.checkpoint as tcp
from torch import Tensor, nn

import scalestate as ss
from scalestate.atomic import atomic_save
from scalestate.testing import Block

DIM = 16
MICROBATCHES = 2
#: Bytes written before a ``--die-at K:write`` kill; a checkpoint here is about 65 kB.
HALF_A_CHECKPOINT = 32_000


class Net(nn.Module):
    """Block and dropout, checkpointed; then a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.block = Block(DIM, n_heads=2)
        self.drop = nn.Dropout(0.1)  # draws from the torch RNG: resume must restore it
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x: Tensor) -> Tensor:
        x = tcp.checkpoint(self._body, x, use_reentrant=False)
        out: Tensor = self.head(x)
        return out

    def _body(self, x: Tensor) -> Tensor:
        out: Tensor = self.drop(self.block(x))
        return out


def batch(step: int) -> list[Tensor]:
    """The step's microbatches: a function of the step alone (the data position is the step)."""
    gen = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(2, 8, DIM, generator=gen) * (1 + step) * (1 + 0.5 * mb) for mb in range(MICROBATCHES)]


class _DyingFile:
    """A file that kills the process once it has written ``limit`` bytes: a crash mid-write."""

    def __init__(self, f: BinaryIO, limit: int) -> None:
        self.f, self.limit, self.written = f, limit, 0

    def write(self, data: bytes) -> int:
        room = self.limit - self.written
        if len(data) >= room:
            self.f.write(bytes(data)[:room])
            self.f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        self.written += len(data)
        return self.f.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.f, name)

    def __enter__(self) -> _DyingFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.f.close()


def _die(where: str) -> None:
    """SIGKILL this process in the middle of the next save: half-way through its bytes, or before its rename."""
    if where == "write":
        real_fdopen = os.fdopen

        def fdopen(fd: int, *args: Any, **kwargs: Any) -> Any:
            return _DyingFile(real_fdopen(fd, *args, **kwargs), limit=HALF_A_CHECKPOINT)

        os.fdopen = fdopen
    elif where == "rename":
        real_replace = os.replace

        def replace(src: Any, dst: Any) -> None:
            os.kill(os.getpid(), signal.SIGKILL)
            real_replace(src, dst)

        os.replace = replace
    else:
        raise SystemExit(f"--die-at: expected STEP:write or STEP:rename; got {where!r}")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("ckpt", type=Path)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--snapshots", type=Path)
    parser.add_argument("--die-at", default="")
    args = parser.parse_args(argv)
    die_step, _, die_where = args.die_at.partition(":")

    torch.set_num_threads(1)
    torch.manual_seed(0)
    manager = ss.ScalingStateManager(ss.DelayedScaling(history_len=4), backend="emulation")
    model = ss.nn.convert(Net(), manager)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)

    start, losses = 0, []
    if args.ckpt.exists():
        ckpt = torch.load(args.ckpt, weights_only=True)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        manager.load_state_dict(ckpt["fp8"])
        torch.set_rng_state(ckpt["rng"])
        start, losses = ckpt["step"], list(ckpt["losses"])
    print(f"ready {start}", flush=True)

    for step in range(start, args.steps):
        print(f"begin {step}", flush=True)
        step_losses = []
        for x in batch(step):
            with manager.forward():
                loss = model(x).square().mean() / MICROBATCHES
            with manager.backward():
                loss.backward()
            step_losses.append(loss.detach())
        opt.step()
        opt.zero_grad()
        manager.step()
        losses.append(torch.stack(step_losses))
        ckpt = {
            "model": model.state_dict(),
            "opt": opt.state_dict(),
            "fp8": manager.state_dict(),
            "rng": torch.get_rng_state(),
            "step": step + 1,
            "losses": torch.stack(losses),
        }
        if die_step and int(die_step) == step + 1:
            _die(die_where)
        atomic_save(ckpt, args.ckpt)
        if args.snapshots is not None:
            atomic_save(ckpt, args.snapshots / f"step{step + 1}.pt")
    print("done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
