"""The opt-in recompute divergence detector (debug=True)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.utils.checkpoint as tcp

import scalestate as ss
from helpers import assert_bitwise, train
from sac_programs import BACKENDS, Policy, Program, Region, differences, run
from sac_programs import RECIPES as PROGRAM_RECIPES
from scalestate.errors import RecomputeMismatchError
from scalestate.testing import OpLog

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

    @pytest.mark.parametrize("recipe", ["delayed", "current"])
    def test_off_by_default(self, recipe):
        """Without debug the same divergence is not checked: no error, and not one host read in
        forward or backward, where debug mode reads back every forward and recomputed amax."""
        make = {"delayed": ss.DelayedScaling, "current": ss.CurrentScaling}[recipe]

        def host_reads(debug: bool, preserve_rng_state: bool) -> int:
            m = ss.ScalingStateManager(make(), backend="emulation", **({"debug": True} if debug else {}))
            assert m.debug is debug
            model = _noisy_model(m)
            with OpLog() as log:
                with m.forward():
                    x = torch.randn(16, 32, requires_grad=True)
                    y = tcp.checkpoint(model, x, use_reentrant=False, preserve_rng_state=preserve_rng_state)
                torch.rand(100)  # without a preserved RNG state, the recompute's dropout differs
                with m.backward():
                    y.sum().backward()
            return log.count("aten._local_scalar_dense.default")

        assert host_reads(debug=False, preserve_rng_state=False) == 0
        assert host_reads(debug=True, preserve_rng_state=True) > 0  # what the log would have seen


class TestRecomputedMoreThanOnce:
    """A forward amax may be recomputed any number of times; only an amax no forward observed is an error."""

    @pytest.mark.parametrize("mechanism", ["non_reentrant", "selective", "ss"])
    def test_nested_regions(self, recipe, backend, mechanism):
        """Per-block regions inside one around the model recompute each block twice: no error, bitwise."""
        ref = train(recipe, backend)
        got = train(recipe, backend, mechanism=mechanism, granularity="nested", manager_kwargs={"debug": True})
        assert_bitwise(ref, got)

    def test_begin_recompute_of_a_stage_that_checkpoints_inside(self, recipe, backend):
        """A pipeline's no-grad forward, its begin_recompute() re-run, then autograd's recompute: no error."""
        ref = train(recipe, backend)
        got = train(
            recipe, backend, schedule="manual_recompute", granularity="block", manager_kwargs={"debug": True}
        )
        assert_bitwise(ref, got)

    def test_nested_regions_still_catch_a_mismatch(self):
        """Dropout without preserved RNG state inside nested regions still raises, naming the slot."""
        m = ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation", debug=True)
        model = _noisy_model(m)
        inner = functools.partial(tcp.checkpoint, use_reentrant=False, preserve_rng_state=False)

        def region(x):
            return inner(model, x)

        x = torch.randn(16, 32, requires_grad=True)
        with m.forward():
            y = tcp.checkpoint(region, x, use_reentrant=False, preserve_rng_state=False)
        torch.rand(100)
        with pytest.raises(RecomputeMismatchError, match="'fc2' \\(INPUT\\)"), m.backward():
            y.sum().backward()

    def test_begin_recompute_with_another_input_is_caught(self):
        """A re-run whose input differs from the forward's raises at the re-run, listing the forward's amax."""
        m = ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation", debug=True)
        layer = ss.nn.Linear(32, 32, manager=m, name="stage")
        x = torch.randn(4, 32)
        m.begin_forward()
        with torch.no_grad():
            layer(x)
        m.begin_recompute()
        with pytest.raises(RecomputeMismatchError, match="'stage' \\(INPUT\\) at step 0") as info:
            layer(x * 2)
        amax = torch.linalg.vector_norm(x, float("inf")).item()
        assert repr(amax) in str(info.value)

    @pytest.mark.parametrize("backend_name", BACKENDS)
    @pytest.mark.parametrize("recipe_name", sorted(PROGRAM_RECIPES))
    def test_selective_with_every_op_saved(self, recipe_name, backend_name):
        """Selective checkpointing that saves every op, in nested regions, with debug on: no error, bitwise."""
        program = Program(
            recipe_name, backend_name, (("mlp", Region("sac", Policy())), ("tied", Region("plain"))),
            outer=Region("sac", Policy()), debug=True,
        )
        assert not differences(run(program), run(program.plain()))
