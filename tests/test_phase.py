"""scalestate.phase: how the code being run is recognised."""

from __future__ import annotations

import torch
import torch.utils.checkpoint as tcp

from scalestate import phase


class TestMarkers:
    def test_nest_and_reset(self):
        """Region markers nest and reset on exit."""
        assert not phase.in_marked_recompute()
        with phase.recompute_region():
            with phase.recompute_region():
                assert phase.in_marked_recompute()
            assert phase.in_marked_recompute()
        assert not phase.in_marked_recompute()
        with phase.training_forward_region():
            assert phase.in_marked_training_forward()
        assert not phase.in_marked_training_forward()


class TestDetection:
    def test_autograd_backward(self):
        """True only while autograd runs a backward."""
        seen = []

        class Probe(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                seen.append(phase.in_autograd_backward())
                return x.clone()

            @staticmethod
            def backward(ctx, g):
                seen.append(phase.in_autograd_backward())
                return g

        Probe.apply(torch.ones(1, requires_grad=True)).sum().backward()
        assert seen == [False, True]

    def test_reentrant_checkpoint_forward(self):
        """Recognised inside torch's reentrant checkpoint forward, not elsewhere."""
        seen = []

        def fn(x):
            seen.append(phase.in_reentrant_checkpoint_forward())
            return x.sin()

        x = torch.ones(2, requires_grad=True)
        tcp.checkpoint(fn, x, use_reentrant=True).sum().backward()
        tcp.checkpoint(fn, x, use_reentrant=False).sum().backward()
        assert seen == [True, False, False, False]
        assert not phase.in_reentrant_checkpoint_forward()


class TestSSCheckpointMarks:
    def test_marks_forward_and_recompute(self):
        """ss.checkpoint marks its recompute (both modes) and the reentrant forward, independently of autograd."""
        import scalestate as ss

        for reentrant in (False, True):
            seen = []

            def fn(x, seen=seen):
                seen.append((phase.in_marked_training_forward(), phase.in_marked_recompute()))
                return x.sin()

            x = torch.ones(2, requires_grad=True)
            ss.checkpoint(fn, x, use_reentrant=reentrant).sum().backward()
            assert seen == [(reentrant, False), (False, True)]
        assert not phase.in_marked_recompute() and not phase.in_marked_training_forward()
