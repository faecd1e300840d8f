"""scalestate.phase: the cast classifier, the signals it reads, per-thread phases."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.utils.checkpoint as tcp

import scalestate as ss
from scalestate import phase
from scalestate.phase import CastKind, Phase, Signals, classify
from scalestate.recipe import Direction

I = ss.Role.INPUT
F, B = Direction.FORWARD, Direction.BACKWARD


def _signals(p=Phase.IDLE, grad=True, backward=False, recompute=False, training=False) -> Signals:
    return Signals(phase=p, grad_enabled=grad, in_backward=backward, recompute_mark=recompute, training_mark=training)


class TestClassify:
    @pytest.mark.parametrize(
        ("signals", "kind"),
        [
            (_signals(), CastKind.RECORD),
            (_signals(grad=False), CastKind.EVALUATION),
            (_signals(Phase.FORWARD, grad=False), CastKind.RECORD),
            (_signals(Phase.RECOMPUTE), CastKind.RECOMPUTE),
            (_signals(Phase.FORWARD, backward=True), CastKind.RECOMPUTE),
            (_signals(Phase.FORWARD, recompute=True), CastKind.RECOMPUTE),
            (_signals(grad=False, training=True), CastKind.RECORD),
            (_signals(Phase.BACKWARD, backward=True), CastKind.RECOMPUTE),
            (_signals(Phase.BACKWARD, grad=False), CastKind.EVALUATION),
            (_signals(Phase.BACKWARD), CastKind.MISPLACED),
            (_signals(Phase.BACKWARD, backward=None), CastKind.RECOMPUTE),
        ],
        ids=[
            "idle-grad", "idle-no_grad", "forward-no_grad", "recompute", "forward-in-backward",
            "forward-marked-recompute", "marked-training", "backward-phase-in-backward",
            "backward-phase-no_grad", "backward-phase-outside-backward", "backward-phase-compiling",
        ],
    )
    def test_forward_casts(self, signals, kind):
        """The table of forward-cast verdicts, one row per combination that matters."""
        assert classify(F, signals) is kind

    def test_backward_casts_always_record(self):
        """GRAD_OUTPUT casts record whatever the signals say."""
        for signals in (_signals(Phase.RECOMPUTE), _signals(grad=False), _signals(Phase.BACKWARD)):
            assert classify(B, signals) is CastKind.RECORD

    def test_probe_asked_only_when_undecided(self):
        """The (slow) Function-forward probe is asked only for no_grad casts with nothing else to go by."""
        asked = []

        def probe():
            asked.append(True)
            return True

        assert classify(F, _signals(), probe) is CastKind.RECORD
        assert classify(F, _signals(Phase.FORWARD, grad=False), probe) is CastKind.RECORD
        assert not asked
        assert classify(F, _signals(grad=False), probe) is CastKind.RECORD
        assert asked == [True]
        assert classify(F, _signals(grad=False), None) is CastKind.EVALUATION


class TestSignals:
    def test_autograd_backward(self):
        """in_backward is True only while autograd runs a backward; None while compiling."""
        seen = []

        class Probe(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                seen.append(phase.read_signals(Phase.IDLE, compiling=False).in_backward)
                return x.clone()

            @staticmethod
            def backward(ctx, g):
                seen.append(phase.read_signals(Phase.IDLE, compiling=False).in_backward)
                return g

        Probe.apply(torch.ones(1, requires_grad=True)).sum().backward()
        assert seen == [False, True]
        assert phase.read_signals(Phase.IDLE, compiling=True).in_backward is None

    def test_markers_nest_and_reset(self):
        """Region markers nest and reset on exit, also on error."""
        assert not phase.read_signals(Phase.IDLE, compiling=False).recompute_mark
        with phase.recompute_region():
            with phase.recompute_region():
                assert phase.read_signals(Phase.IDLE, compiling=False).recompute_mark
            assert phase.read_signals(Phase.IDLE, compiling=False).recompute_mark
        assert not phase.read_signals(Phase.IDLE, compiling=False).recompute_mark
        with pytest.raises(KeyError), phase.training_forward_region():
            raise KeyError
        assert not phase.read_signals(Phase.IDLE, compiling=False).training_mark

    def test_markers_are_per_thread(self):
        """A region marked in one thread is not marked in another."""
        seen = []
        with phase.recompute_region():
            t = threading.Thread(target=lambda: seen.append(phase.read_signals(Phase.IDLE, compiling=False)))
            t.start()
            t.join()
        assert not seen[0].recompute_mark

    @pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")
    def test_training_function_forward(self):
        """Inside a reentrant checkpoint's forward: True when gradients will flow, False under
        no_grad even with inputs that require grad, and False outside any Function."""
        seen = []

        def fn(x):
            seen.append(phase.in_training_function_forward())
            return x.sin()

        x = torch.ones(2, requires_grad=True)
        tcp.checkpoint(fn, x, use_reentrant=True).sum().backward()  # forward, then recompute
        with torch.no_grad():
            tcp.checkpoint(fn, x, use_reentrant=True)
        tcp.checkpoint(fn, torch.ones(2), use_reentrant=True)  # no input needs grad
        fn(x)
        assert seen == [True, False, False, False, False]


class TestSSCheckpointMarks:
    def test_marks_forward_and_recompute(self):
        """ss.checkpoint marks its recompute (both modes) and the reentrant training forward."""
        for reentrant in (False, True):
            seen = []

            def fn(x, seen=seen):
                s = phase.read_signals(Phase.IDLE, compiling=False)
                seen.append((s.training_mark, s.recompute_mark))
                return x.sin()

            x = torch.ones(2, requires_grad=True)
            ss.checkpoint(fn, x, use_reentrant=reentrant).sum().backward()
            assert seen == [(reentrant, False), (False, True)]


class TestPerThreadPhases:
    def test_phase_of_one_thread_is_not_anothers(self, delayed):
        """A forward block open in one thread does not make a no_grad pass in another record."""
        layer = ss.nn.Linear(8, 8, manager=delayed, name="fc")
        opened, release = threading.Event(), threading.Event()

        def trainer():
            with delayed.forward():
                opened.set()
                release.wait(10)

        t = threading.Thread(target=trainer)
        t.start()
        try:
            assert opened.wait(10)
            assert delayed.phase is Phase.IDLE
            with torch.no_grad():
                layer(torch.randn(4, 8) * 100)
            assert delayed.state_dict()["step_amax"].tolist() == [0.0, 0.0, 0.0]
            delayed.step()  # a block open in another thread does not trip step() here
        finally:
            release.set()
            t.join()
        assert delayed.iteration == 1

    def test_begin_calls_are_per_thread(self, delayed):
        """begin_forward() in a worker thread leaves the main thread IDLE."""
        seen = []

        def worker():
            delayed.begin_forward()
            seen.append(delayed.phase)

        t = threading.Thread(target=worker)
        t.start()
        t.join()
        assert seen == [Phase.FORWARD] and delayed.phase is Phase.IDLE
