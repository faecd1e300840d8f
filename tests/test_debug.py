"""The opt-in recompute divergence detector (debug=True)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.utils.checkpoint as tcp

import scalestate as ss
from helpers import assert_bitwise, train
from scalestate.errors import RecomputeMismatchError

#: Each fine-grained recipe on one backend here (see conftest.FINE_RECIPE_BACKEND).
FINE_RECIPES_ON_ONE_BACKEND = True


def _noisy_model(m):
    """A region whose recompute differs from its forward: dropout with its RNG state not preserved."""
    return torch.nn.Sequential(
        ss.nn.Linear(32, 32, manager=m, name="fc1"),
        torch.nn.Dropout(0.5),
        ss.nn.Linear(32, 32, manager=m, name="fc2"),
    )


class TestDetector:
    @pytest.mark.parametrize(
        "checkpoint",
        [
            functools.partial(tcp.checkpoint, use_reentrant=False, preserve_rng_state=False),
            functools.partial(tcp.checkpoint, use_reentrant=True, preserve_rng_state=False),
            functools.partial(ss.checkpoint, preserve_rng_state=False),
        ],
        ids=["non_reentrant", "reentrant", "ss"],
    )
    def test_non_deterministic_region_is_named(self, checkpoint):
        """The error names the slot, the step and both amax values."""
        m = ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation", debug=True)
        model = _noisy_model(m)
        x = torch.randn(16, 32, requires_grad=True)
        with m.forward():
            y = checkpoint(model, x)
        torch.rand(100)  # move the RNG on, as other work would
        with pytest.raises(RecomputeMismatchError) as info, m.backward():
            y.sum().backward()
        msg = str(info.value)
        assert "'fc2' (INPUT)" in msg and "at step 0" in msg and msg.count("amax") >= 2

    def test_deterministic_region_passes(self, recipe, backend):
        """With debug on, deterministic checkpointed training raises nothing and stays bitwise equal."""
        ref = train(recipe, backend)
        got = train(recipe, backend, mechanism="non_reentrant", granularity="block", manager_kwargs={"debug": True})
        assert got.manager.debug
        assert_bitwise(ref, got)

    def test_preserved_rng_passes(self):
        """Dropout with torch's default preserved RNG state reproduces: no error."""
        m = ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation", debug=True)
        model = _noisy_model(m)
        for _ in range(2):
            x = torch.randn(16, 32, requires_grad=True)
            with m.forward():
                y = tcp.checkpoint(model, x, use_reentrant=False)
            torch.rand(100)
            with m.backward():
                y.sum().backward()
            m.step()

    def test_off_by_default(self):
        """Without debug the same divergence is not checked (no host reads)."""
        m = ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation")
        model = _noisy_model(m)
        with m.forward():
            x = torch.randn(16, 32, requires_grad=True)
            y = tcp.checkpoint(model, x, use_reentrant=False, preserve_rng_state=False)
        torch.rand(100)
        with m.backward():
            y.sum().backward()
        assert not m.debug
