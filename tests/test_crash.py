"""Crash-safe checkpoints: ``kill -9`` a training process anywhere, resume, match a run never stopped.

The training process is tests/crash_worker.py; it saves model, optimizer,
manager state, RNG state, step and losses with ``scalestate.atomic.atomic_save``
after every step. A reference run is never stopped and keeps every step's
checkpoint. The tests kill workers with SIGKILL at seeded random points (and
at two fixed points inside the save), check after each kill that the file on
disk loads with ``weights_only=True`` and is exactly one of the reference's
checkpoints, resume in a fresh process, and require the final checkpoint
(parameters, optimizer state, amax histories, scales, RNG state, every
step's losses) to be bitwise the reference's.
"""

from __future__ import annotations

import itertools
import os
import queue
import random
import re
import shutil
import signal
import stat
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from scalestate import testing
from scalestate.atomic import atomic_save

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("crash_worker.py")
STEPS = 12
SEED = 20240611
#: Seconds a worker may take to start, or to reach a line it should print (busy CI machines).
PATIENCE = 120.0
TEMP = re.compile(r"\.ckpt\.pt\.[0-9a-f]{12}\.tmp")


class Worker:
    """One training process; its stdout lines arrive on a queue as it prints them."""

    def __init__(self, ckpt: Path, *args: str) -> None:
        self.stderr = ckpt.with_name(f"stderr-{time.monotonic_ns()}.txt")
        with self.stderr.open("w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, str(WORKER), str(ckpt), "--steps", str(STEPS), *args],
                stdout=subprocess.PIPE, stderr=err, text=True,
            )
        self.lines: queue.Queue[tuple[float, str | None]] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put((time.monotonic(), line.strip()))
        self.lines.put((time.monotonic(), None))

    def wait_for(self, prefix: str) -> tuple[float, str]:
        """The first line starting with ``prefix`` and when it arrived."""
        deadline = time.monotonic() + PATIENCE
        while True:
            try:
                at, line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.proc.kill()
                raise AssertionError(f"worker printed no {prefix!r} within {PATIENCE} s") from None
            if line is None:
                code = self.proc.wait()
                raise AssertionError(
                    f"worker exited with {code} before printing {prefix!r}:\n{self.stderr.read_text()}"
                )
            if line.startswith(prefix):
                return at, line

    def kill(self) -> int:
        self.proc.send_signal(signal.SIGKILL)
        return self.proc.wait(PATIENCE)

    def finish(self) -> None:
        self.wait_for("done")
        code = self.proc.wait(PATIENCE)
        assert code == 0, f"worker exited with {code}:\n{self.stderr.read_text()}"


def assert_same(a: object, b: object, where: str = "checkpoint") -> None:
    """Nested dicts, lists and tuples equal, tensors bitwise (:func:`scalestate.testing.assert_same`)."""
    testing.assert_same(a, b, name=where)


def load(path: Path) -> dict:
    ckpt = torch.load(path, weights_only=True)
    assert isinstance(ckpt, dict)
    return ckpt


def temp_files(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir() if TEMP.fullmatch(p.name)}


class Reference:
    """A run never stopped: every step's checkpoint, and how long a step takes."""

    def __init__(self, directory: Path) -> None:
        self.snapshots = directory / "snapshots"
        self.snapshots.mkdir()
        self.ckpt = directory / "ckpt.pt"
        worker = Worker(self.ckpt, "--snapshots", str(self.snapshots))
        begins = [worker.wait_for(f"begin {step}")[0] for step in range(STEPS)]
        worker.finish()
        self.step_time = statistics.median(b - a for a, b in itertools.pairwise(begins))
        self.final = load(self.ckpt)
        self.directory = directory

    def at(self, step: int) -> dict:
        return load(self.snapshots / f"step{step}.pt")


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    return Reference(tmp_path_factory.mktemp("reference"))


def check_on_disk(ckpt: Path, reference: Reference, at_least: int) -> int:
    """The file on disk after a kill: loads with weights_only, and is one whole reference checkpoint."""
    on_disk = load(ckpt)
    step = on_disk["step"]
    assert step >= at_least, f"the checkpoint went back from step {at_least} to {step}"
    assert_same(on_disk, reference.at(step), f"checkpoint of step {step} after a kill")
    return int(step)


def check_final(ckpt: Path, reference: Reference) -> None:
    """Parameters, optimizer state, amax histories, scales, RNG and all losses: bitwise the reference's."""
    final = load(ckpt)
    assert final["step"] == STEPS
    for name, param in reference.final["model"].items():
        assert torch.equal(final["model"][name], param), f"parameter {name} differs from the run never stopped"
    for key in ("amax_history", "scale", "step_amax"):
        assert torch.equal(final["fp8"][key], reference.final["fp8"][key]), f"manager {key} differs"
    assert final["fp8"]["iteration"] == STEPS
    assert torch.equal(final["losses"], reference.final["losses"]), "per-step losses differ"
    assert_same(final, reference.final)


class TestKillAndResume:
    def test_reference_is_clean(self, reference):
        """A run never stopped leaves its checkpoints and no temporary file; its state really moved."""
        assert temp_files(reference.directory) == set() and temp_files(reference.snapshots) == set()
        assert sorted(p.name for p in reference.snapshots.iterdir()) == sorted(
            f"step{k}.pt" for k in range(1, STEPS + 1)
        )
        first, last = reference.at(1)["fp8"], reference.final["fp8"]
        assert not torch.equal(first["scale"], last["scale"])
        assert bool((last["amax_history"] > 0).all())

    def test_random_kills(self, reference, tmp_path):
        """SIGKILL at seeded random points of 4 runs, resume in fresh processes: bitwise the run never stopped."""
        rng = random.Random(SEED)
        ckpt = tmp_path / "ckpt.pt"
        targets = sorted(rng.sample(range(1, STEPS - 4), 4))  # each run is killed well before the end
        step, kills = 0, []
        for target in targets:
            worker = Worker(ckpt)
            start = int(worker.wait_for("ready")[1].split()[1])
            assert start == step
            target = max(target, start)
            worker.wait_for(f"begin {target}")
            delay = rng.uniform(0.0, reference.step_time)  # in that step or the next: anywhere in it
            time.sleep(delay)
            before = temp_files(tmp_path)
            code = worker.kill()
            assert code == -signal.SIGKILL, f"the worker was not killed (exit code {code})"
            step = check_on_disk(ckpt, reference, at_least=step)
            kills.append((target, round(delay * 1000, 1), step, len(temp_files(tmp_path) - before)))
        Worker(ckpt).finish()
        check_final(ckpt, reference)
        print(f"kills (begin step, ms after, checkpoint step, killed inside a save): {kills}")

    def test_kills_inside_the_save(self, reference, tmp_path):
        """Killed half-way through writing and just before the rename: the previous checkpoint stands, and
        resuming from it is bitwise the run never stopped."""
        ckpt = tmp_path / "ckpt.pt"
        shutil.copyfile(reference.snapshots / "step3.pt", ckpt)

        worker = Worker(ckpt, "--die-at", "6:write")
        assert worker.wait_for("ready")[1] == "ready 3"
        assert worker.proc.wait(PATIENCE) == -signal.SIGKILL
        assert check_on_disk(ckpt, reference, at_least=5) == 5
        (left,) = temp_files(tmp_path)  # torn: what torch.save(obj, path) would have left at path
        assert 0 < (tmp_path / left).stat().st_size < (tmp_path / "ckpt.pt").stat().st_size
        with pytest.raises((RuntimeError, OSError)):  # torch reports a truncated archive as either
            torch.load(tmp_path / left, weights_only=True)
        (tmp_path / left).unlink()

        worker = Worker(ckpt, "--die-at", f"{STEPS}:rename")
        assert worker.wait_for("ready")[1] == "ready 5"
        assert worker.proc.wait(PATIENCE) == -signal.SIGKILL
        assert check_on_disk(ckpt, reference, at_least=STEPS - 1) == STEPS - 1
        (left,) = temp_files(tmp_path)  # complete and synced, but never renamed
        assert_same(load(tmp_path / left), reference.final, "the unrenamed temporary file")

        Worker(ckpt).finish()
        check_final(ckpt, reference)


class _Unpicklable:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def __reduce__(self):
        raise self.exc


class TestAtomicSave:
    def test_round_trip_leaves_only_the_file(self, tmp_path):
        """The saved object loads with weights_only; no temporary file is left; str and Path both work."""
        obj = {"w": torch.arange(6.0).reshape(2, 3), "step": 4, "nested": [torch.ones(2, dtype=torch.int8)]}
        atomic_save(obj, tmp_path / "a.pt")
        atomic_save(obj, str(tmp_path / "b.pt"))
        assert sorted(os.listdir(tmp_path)) == ["a.pt", "b.pt"]
        assert_same(load(tmp_path / "a.pt"), obj)
        assert_same(load(tmp_path / "b.pt"), obj)

    def test_replaces_an_existing_file(self, tmp_path):
        """Saving over a checkpoint replaces it whole."""
        path = tmp_path / "ckpt.pt"
        atomic_save({"step": 1, "w": torch.zeros(1000)}, path)
        atomic_save({"step": 2}, path)
        assert load(path) == {"step": 2} and os.listdir(tmp_path) == ["ckpt.pt"]

    def test_mode_as_torch_save(self, tmp_path):
        """A new checkpoint gets the permissions torch.save would give it (from the umask)."""
        torch.save({}, tmp_path / "plain.pt")
        atomic_save({}, tmp_path / "atomic.pt")
        mode = [stat.S_IMODE(os.stat(tmp_path / n).st_mode) for n in ("plain.pt", "atomic.pt")]
        assert mode[0] == mode[1]

    @pytest.mark.parametrize("exc", [RuntimeError("cannot pickle"), KeyboardInterrupt()], ids=["error", "interrupt"])
    def test_failure_keeps_the_previous_checkpoint(self, tmp_path, exc):
        """An exception from serialization propagates; the old file is intact byte for byte; nothing is left."""
        path = tmp_path / "ckpt.pt"
        atomic_save({"step": 1, "w": torch.randn(100)}, path)
        before = path.read_bytes()
        with pytest.raises(type(exc)):
            atomic_save({"step": 2, "bad": _Unpicklable(exc)}, path)
        assert path.read_bytes() == before
        assert os.listdir(tmp_path) == ["ckpt.pt"]

    def test_failure_without_a_previous_file(self, tmp_path):
        """A failed first save leaves no file at all."""
        with pytest.raises(RuntimeError):
            atomic_save({"bad": _Unpicklable(RuntimeError("no"))}, tmp_path / "ckpt.pt")
        assert os.listdir(tmp_path) == []

    def test_durability_order(self, tmp_path, monkeypatch):
        """The data is fsynced before the rename, and the directory after it."""
        events: list[str] = []
        real_fsync, real_replace = os.fsync, os.replace

        def fsync(fd):
            st = os.fstat(fd)
            events.append("fsync dir" if stat.S_ISDIR(st.st_mode) else f"fsync file {st.st_size}")
            real_fsync(fd)

        def replace(src, dst):
            events.append(f"replace {Path(dst).name} {os.path.getsize(src)}")
            real_replace(src, dst)

        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "replace", replace)
        atomic_save({"w": torch.ones(10)}, tmp_path / "ckpt.pt")
        size = os.path.getsize(tmp_path / "ckpt.pt")
        assert events == [f"fsync file {size}", f"replace ckpt.pt {size}", "fsync dir"]


    def test_docstring_example(self):
        """The module's docstring example runs and prints what it says."""
        import doctest

        import scalestate.atomic

        result = doctest.testmod(scalestate.atomic)
        assert result.attempted > 0 and result.failed == 0


class TestDocsRecipe:
    def test_interrupted_recipe_matches_uninterrupted(self, tmp_path, monkeypatch):
        """docs/checkpointing.md's recipe, stopped after 3 steps and rerun to 5, ends bitwise as a run of 5."""
        text = (ROOT / "docs" / "checkpointing.md").read_text()
        block = next(b for b in re.findall(r"```python\n(.*?)```", text, flags=re.S) if "atomic_save(" in b)

        class MyModel(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Dropout(0.2), torch.nn.Linear(32, 1))

            def forward(self, x):
                return torch.utils.checkpoint.checkpoint(self.net, x, use_reentrant=False).square().mean()

        def get_batch(step):
            return torch.randn(8, 16, generator=torch.Generator().manual_seed(step)) * (step + 1)

        def run(directory: Path, total_steps: int) -> None:
            directory.mkdir(exist_ok=True)
            monkeypatch.chdir(directory)
            namespace = {"MyModel": MyModel, "get_batch": get_batch, "total_steps": total_steps}
            exec(compile(block, "checkpointing.md", "exec"), namespace)

        run(tmp_path / "stopped", 3)
        assert load(tmp_path / "stopped" / "ckpt.pt")["step"] == 3
        run(tmp_path / "stopped", 5)
        run(tmp_path / "never", 5)
        resumed, never = load(tmp_path / "stopped" / "ckpt.pt"), load(tmp_path / "never" / "ckpt.pt")
        assert resumed["step"] == 5 and resumed["fp8"]["iteration"] == 5
        assert_same(resumed, never)
