"""Selective activation checkpointing (SAC): the field's reports as plain tests, and scalestate.sac itself.

Every comparison is bitwise (``torch.equal``) against the same training without
checkpointing: losses, input and parameter gradients, parameters and
``manager.state_dict()`` after each of 3 steps of 2 microbatches (see
``sac_programs``). The randomized version of all of this is
``test_sac_property.py``.
"""

from __future__ import annotations

import functools
from typing import ClassVar

import pytest
import torch
import torch.utils.checkpoint as tcp

import scalestate as ss
from sac_programs import BACKENDS, RECIPES, Event, Policy, Program, Region, differences, run
from scalestate.sac import hidden_from_sac, sac_active
from scalestate.testing import OpLog

aten = torch.ops.aten

#: Ops a policy may name that the casts themselves dispatch, and the products.
POLICY_OPS = {
    "norm": "aten.linalg_vector_norm.default",
    "div": "aten.div.Tensor",
    "mul": "aten.mul.Tensor",
    "abs": "aten.abs.default",
    "amax": "aten.amax.default",
    "aminmax": "aten.aminmax.default",
    "clamp": "aten.clamp.default",
    "view": "aten.view.default",
    "to_copy": "aten._to_copy.default",
    "mm": "aten.mm.default",
    "scaled_mm": "aten._scaled_mm.default",
    "scaled_mm_v2": "aten._scaled_mm_v2.default",
}


#: Every recipe on both CPU backends.
every_recipe_and_backend = pytest.mark.parametrize(
    ("recipe", "backend"), [(r, b) for r in sorted(RECIPES) for b in BACKENDS]
)


def _program(recipe: str, backend: str, policy: Policy, *, kind: str = "relu", events=()) -> Program:
    """Two selective regions of ``kind`` blocks, both with ``policy``."""
    region = Region("sac", policy)
    return Program(recipe, backend, ((kind, region), (kind, region)), events=tuple(events))


def _assert_like_plain(program):
    found = differences(run(program), run(program.plain()))
    assert not found, f"differs from the program without checkpointing in: {', '.join(found[:8])}"


@every_recipe_and_backend
class TestAnyPolicy:
    @pytest.mark.parametrize("op", sorted(POLICY_OPS))
    def test_saving_an_op_the_casts_use(self, recipe, backend, op):
        """Two FP8 layers with ReLUs, one op saved (the casts' own norm, div, mul, ... or a product): bitwise."""
        _assert_like_plain(_program(recipe, backend, Policy(frozenset({POLICY_OPS[op]}))))

    @pytest.mark.parametrize(
        "policy", [Policy(), Policy(frozenset()), Policy(prefer=True)], ids=["all", "none", "all_prefer"]
    )
    def test_saving_everything_or_nothing(self, recipe, backend, policy):
        """Every op saved (no cached tensor is modified afterwards), or none: bitwise."""
        _assert_like_plain(_program(recipe, backend, policy))

    def test_norms_of_the_model_beside_the_casts(self, recipe, backend):
        """An RMS norm (linalg_vector_norm, div, mul) before each FP8 layer, those ops saved: bitwise."""
        ops = frozenset({POLICY_OPS["norm"], POLICY_OPS["div"], POLICY_OPS["mul"]})
        _assert_like_plain(_program(recipe, backend, Policy(ops), kind="mlp"))


@every_recipe_and_backend
class TestCastsChangedBetweenForwardAndBackward:
    """Whatever happens to the cached weight casts between a forward and its backward, the recompute matches."""

    EVENTS: ClassVar[dict[str, Event]] = {
        "eval_copy": Event((1, 0, "between"), "eval", "copy"),
        "eval_copy_thread": Event((1, 0, "between"), "eval", "copy", thread=True),
        "eval_model": Event((1, 0, "between"), "eval", "model"),
        "handle_invalidate": Event((1, 0, "between"), "invalidate", 0),
        "manager_invalidate": Event((1, 0, "between"), "invalidate", "manager"),
    }

    @pytest.mark.parametrize("event", sorted(EVENTS))
    @pytest.mark.parametrize("saved", ["mm", "all"])
    def test_recompute_sees_what_its_forward_saw(self, recipe, backend, event, saved):
        """An evaluation of a copy sharing the manager (here or in a thread), of the model, or dropped casts."""
        policy = Policy(frozenset({POLICY_OPS["mm"]})) if saved == "mm" else Policy()
        _assert_like_plain(_program(recipe, backend, policy, kind="tied", events=[self.EVENTS[event]]))


def _sac(fn, x, policy):
    ctx = functools.partial(tcp.create_selective_checkpoint_contexts, policy)
    return tcp.checkpoint(fn, x, use_reentrant=False, context_fn=ctx)


class TestHiddenFromSac:
    def test_policy_is_never_asked_about_a_cast(self):
        """The policy sees the FP8 product, not the cast's operations or its record."""
        m = ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation")
        layer = ss.nn.Linear(16, 16, bias=False, manager=m)
        asked: list[str] = []

        def policy(ctx, op, *args, **kwargs):
            asked.append(str(op))
            return tcp.CheckpointPolicy.PREFER_RECOMPUTE

        x = torch.randn(4, 16, requires_grad=True)
        _sac(layer, x, policy).sum().backward()
        assert "aten.mm.default" in asked
        cast_only = {
            "aten.abs.default", "aten.amax.default", "aten.aminmax.default", "aten.clamp_.default",
            "aten.maximum.out", "aten.reciprocal.default",
        }
        assert not cast_only & set(asked), sorted(cast_only & set(asked))

    def test_other_modes_still_see_the_casts(self):
        """A mode outside the region (a FLOP counter, a profiler) sees the casts' operations."""
        m = ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation")
        layer = ss.nn.Linear(16, 16, bias=False, manager=m)
        log = OpLog()
        with log:
            _sac(layer, torch.randn(4, 16, requires_grad=True), [aten.mm.default])
        assert "aten.aminmax.default" in log.ops and "aten.maximum.out" in log.ops

    def test_a_saved_product_is_not_recomputed(self):
        """Saving the product (the usual reason for SAC) still works: the recompute takes it from storage."""
        m = ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation")
        layer = ss.nn.Linear(16, 16, bias=False, manager=m)

        def backward_mms(policy):
            y = _sac(layer, torch.randn(4, 16, requires_grad=True), policy)
            log = OpLog()
            with log:
                y.sum().backward()
            return log.ops.count("aten.mm.default")

        # recomputed: the forward product again, then the two gradient products
        assert backward_mms([]) == 3
        assert backward_mms([aten.mm.default]) == 2

    def test_stack_restored_with_a_mode_above(self):
        """A user's mode pushed inside the region keeps seeing the casts, and stays on top afterwards."""
        m = ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation")
        layer = ss.nn.Linear(16, 16, bias=False, manager=m)
        inner = OpLog()
        stacks = []

        def region(x):
            with inner:
                from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

                before = list(_get_current_dispatch_mode_stack())
                y = layer(x)
                stacks.append((before, list(_get_current_dispatch_mode_stack())))
            return y

        with tcp.set_checkpoint_early_stop(False):  # the recompute runs to the region's end
            y = _sac(region, torch.randn(4, 16, requires_grad=True), [aten.mm.default])
        y.sum().backward()
        assert len(stacks) == 2  # forward and recompute
        for before, after in stacks:
            assert [id(x) for x in before] == [id(x) for x in after] and before[-1] is inner
        assert "aten.aminmax.default" in inner.ops

    def test_stack_restored_after_an_error(self):
        """An error inside the block leaves the mode stack as it was."""
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

        seen = []

        def region(x):
            before = list(_get_current_dispatch_mode_stack())

            def fails() -> None:
                with hidden_from_sac():
                    assert not sac_active()
                    raise RuntimeError("inside")

            with pytest.raises(RuntimeError, match="inside"):
                fails()
            seen.append(before == list(_get_current_dispatch_mode_stack()) and sac_active())
            return x.sin()

        _sac(region, torch.randn(3, requires_grad=True), [aten.sin.default]).sum().backward()
        assert seen == [True, True]

    def test_active_only_under_sac(self):
        """sac_active() is True in the forward and the recompute of a selective region only."""
        seen = []

        def region(x):
            seen.append(sac_active())
            return x.sin()

        assert not sac_active()
        x = torch.randn(3, requires_grad=True)
        tcp.checkpoint(region, x, use_reentrant=False).sum().backward()
        _sac(region, x, [aten.sin.default]).sum().backward()
        assert seen == [False, False, True, True]


class TestCachedCastAsAskedFor:
    def test_hit_without_transpose_has_one_orientation(self):
        """A cast served from the cache has the orientations asked for, whatever the cached cast held."""
        m = ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation")
        h = m.register("w", roles=(ss.Role.WEIGHT,))
        w = torch.randn(8, 4)
        with m.forward():
            both = h.quantize(w, ss.Role.WEIGHT, transpose=True)
            one = h.quantize(w, ss.Role.WEIGHT)
        assert both.transposed is not None and one.transposed is None
        assert one.data is both.data and torch.equal(one.scale, both.scale)
