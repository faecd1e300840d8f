"""Invariant 11 (the non-finite policies and their counters) and recovery from a refused step."""

from __future__ import annotations

import pytest
import torch

import scalestate as ss
from scalestate.errors import NonFiniteAmaxError, PhaseError, ScaleStateError
from scalestate.math import scale_from_amax

I, W, G = ss.Role.INPUT, ss.Role.WEIGHT, ss.Role.GRAD_OUTPUT
NONFINITE = [float("nan"), float("inf"), float("-inf")]


def _manager(policy: ss.NonFinitePolicy | str) -> tuple[ss.ScalingStateManager, ss.ScalingHandle, ss.ScalingHandle]:
    m = ss.ScalingStateManager(ss.DelayedScaling(history_len=4), backend="emulation", on_nonfinite=policy)
    a = m.register("a", roles=(I, G))
    b = m.register("b", roles=(I,))
    return m, a, b


def _cast(m: ss.ScalingStateManager, a: ss.ScalingHandle, b: ss.ScalingHandle, bad: float | None) -> None:
    """One step's casts: ``a`` INPUT sees ``bad`` (if given), everything else finite values."""
    with m.forward():
        a.quantize(torch.tensor([1.0, 2.0, bad if bad is not None else 3.0]), I)
        b.quantize(torch.tensor([4.0, -5.0]), I)
    a.quantize(torch.tensor([0.5, -0.25]), G)


def _snapshot(m: ss.ScalingStateManager) -> dict[str, object]:
    return m.state_dict()


def _assert_same(x: dict[str, object], y: dict[str, object]) -> None:
    assert x.keys() == y.keys()
    for key in x:
        if isinstance(x[key], torch.Tensor):  # bit patterns: NaN == NaN
            assert torch.equal(x[key].view(torch.int32), y[key].view(torch.int32)), key  # type: ignore[union-attr]
        else:
            assert x[key] == y[key], key


class TestPolicyArgument:
    def test_unknown_policy_lists_the_choices(self):
        with pytest.raises(ScaleStateError, match="'skip', 'raise', 'fallback'; got 'ignore'"):
            ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation", on_nonfinite="ignore")  # type: ignore[arg-type]

    @pytest.mark.parametrize("policy", list(ss.NonFinitePolicy))
    def test_string_is_held_as_the_enum(self, policy):
        """The string value and the member make the same manager; it holds the member, equal to the string."""
        by_string = ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation", on_nonfinite=policy.value)
        by_member = ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation", on_nonfinite=policy)
        assert by_string.on_nonfinite is policy and by_member.on_nonfinite is policy
        assert by_string.on_nonfinite == policy.value and str(by_string.on_nonfinite) == policy.value

    @pytest.mark.parametrize("policy", list(ss.NonFinitePolicy))
    def test_member_behaves_as_its_string(self, policy):
        """A step under the member does bitwise what it does under the string (raise included)."""
        states = []
        for value in (policy, policy.value):
            m, a, b = _manager(value)
            _cast(m, a, b, None)
            m.step()
            _cast(m, a, b, float("nan"))
            if policy is ss.NonFinitePolicy.RAISE:
                with pytest.raises(NonFiniteAmaxError):
                    m.step()
            else:
                m.step()
            states.append(_snapshot(m))
        _assert_same(*states)

    def test_non_string_is_refused(self):
        with pytest.raises(ScaleStateError, match="got 3"):
            ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation", on_nonfinite=3)  # type: ignore[arg-type]


class TestSkip:
    @pytest.mark.parametrize("bad", NONFINITE)
    def test_offending_slot_keeps_history_and_scale_others_update(self, bad):
        m, a, b = _manager("skip")
        _cast(m, a, b, None)
        m.step()
        history, scale = a.amax_history(I), a.scale(I)
        _cast(m, a, b, bad)
        m.step()
        assert torch.equal(a.amax_history(I), history) and torch.equal(a.scale(I), scale)
        assert b.amax_history(I).tolist() == [0.0, 0.0, 5.0, 5.0]  # the others rolled
        assert torch.isfinite(a.scale(I)) and a.scale(I) > 0
        assert m.nonfinite_counts() == {"a": {I: 1, G: 0}, "b": {I: 0}}

    def test_counts_accumulate_per_step_and_start_at_zero(self):
        m, a, b = _manager("skip")
        assert m.nonfinite_counts() == {"a": {I: 0, G: 0}, "b": {I: 0}}
        for bad in (float("nan"), None, float("inf")):
            _cast(m, a, b, bad)
            a.quantize(torch.tensor([float("nan")]), G)
            m.step()
        assert m.nonfinite_counts() == {"a": {I: 2, G: 3}, "b": {I: 0}}

    def test_a_microbatch_nan_poisons_the_step_not_later_ones(self):
        """NaN in one microbatch makes the step's amax NaN (max propagates it); the next step is clean."""
        m, a, b = _manager("skip")
        _cast(m, a, b, None)
        _cast(m, a, b, float("nan"))
        m.step()
        assert a.amax_history(I).tolist() == [0.0, 0.0, 0.0, 0.0]
        _cast(m, a, b, None)
        m.step()
        assert a.amax_history(I).tolist() == [0.0, 0.0, 0.0, 3.0]


class TestRaise:
    @pytest.mark.parametrize("bad", NONFINITE)
    def test_raises_naming_slots_roles_and_step_and_changes_nothing(self, bad):
        m, a, b = _manager("raise")
        _cast(m, a, b, None)
        m.step()
        _cast(m, a, b, bad)
        a.quantize(torch.tensor([float("inf")]), G)
        before = _snapshot(m)
        with pytest.raises(NonFiniteAmaxError) as info:
            m.step()
        text = str(info.value)
        assert text.startswith("step 1: non-finite amax recorded for 2 slot(s): 'a' INPUT")
        assert "'a' GRAD_OUTPUT (inf)" in text and "'b'" not in text and "discard_step()" in text
        _assert_same(before, _snapshot(m))
        assert m.iteration == 1
        assert m.nonfinite_counts() == {"a": {I: 0, G: 0}, "b": {I: 0}}  # a refused step counts nothing
        assert isinstance(info.value, FloatingPointError)

    def test_discard_then_continue(self):
        m, a, b = _manager("raise")
        _cast(m, a, b, None)
        m.step()
        good = _snapshot(m)
        _cast(m, a, b, float("nan"))
        with pytest.raises(NonFiniteAmaxError):
            m.step()
        m.discard_step()
        _assert_same(good, _snapshot(m))
        _cast(m, a, b, None)
        m.step()
        assert m.iteration == 2 and a.amax_history(I).tolist() == [0.0, 0.0, 3.0, 3.0]

    def test_load_last_good_after_a_refused_step(self):
        m, a, b = _manager("raise")
        _cast(m, a, b, None)
        m.step()
        good = _snapshot(m)
        _cast(m, a, b, None)
        m.step()
        _cast(m, a, b, float("inf"))
        with pytest.raises(NonFiniteAmaxError):
            m.step()
        m.load_state_dict(good)
        _assert_same(good, _snapshot(m))
        _cast(m, a, b, None)
        m.step()
        assert m.iteration == 2


class TestFallback:
    def test_offending_slot_forgets_history_scales_just_in_time_then_recovers(self):
        m, a, b = _manager("fallback")
        for _ in range(2):
            _cast(m, a, b, None)
            m.step()
        x = torch.tensor([1.0, 2.0, 3.0])
        with m.forward():
            assert torch.equal(a.quantize(x, I).scale, a.scale(I))  # delayed: the slot's scale
        m.discard_step()
        _cast(m, a, b, float("nan"))
        m.step()
        assert a.amax_history(I).tolist() == [0.0] * 4
        assert torch.isfinite(a.scale(I)) and a.scale(I) > 0
        assert b.amax_history(I)[-1].item() == 5.0
        y = torch.tensor([7.0, -2.0])
        with m.forward():
            q = a.quantize(y, I)  # no history: just in time, from y's own amax
        assert torch.equal(q.scale, scale_from_amax(torch.tensor(7.0), 448.0))
        m.step()  # a finite step gives it history again
        assert a.amax_history(I).tolist() == [0.0, 0.0, 0.0, 7.0]
        with m.forward():
            assert torch.equal(a.quantize(x, I).scale, a.scale(I))
        assert m.nonfinite_counts()["a"] == {I: 1, G: 0}


class TestRecovery:
    def test_refused_phase_step_recovers_by_discard(self, delayed):
        """A step refused by a PhaseError stays refused until the step is discarded."""
        h = delayed.register("fc", roles=(I, G))
        with torch.no_grad():
            h.quantize(torch.ones(4), I)  # evaluation: not recorded
        h.quantize(torch.ones(4), G)  # but a gradient cast was
        for _ in range(2):
            with pytest.raises(PhaseError, match="GRAD_OUTPUT"):
                delayed.step()
        delayed.discard_step()
        assert delayed.buffers()["step_amax"].tolist() == [0.0, 0.0]
        with delayed.forward():
            h.quantize(torch.ones(4), I)
        h.quantize(torch.ones(4), G)
        delayed.step()
        assert delayed.iteration == 1

    def test_refused_phase_step_allows_loading(self, delayed):
        h = delayed.register("fc", roles=(I, G))
        good = delayed.state_dict()
        h.quantize(torch.ones(4), G)
        with pytest.raises(PhaseError):
            delayed.step()
        delayed.load_state_dict(good)
        delayed.step()  # the loaded state has nothing pending
        assert delayed.iteration == 1

    def test_loading_mid_step_still_refused_unless_a_step_was(self, delayed):
        h = delayed.register("fc", roles=(I,))
        good = delayed.state_dict()
        with delayed.forward():
            h.quantize(torch.ones(4), I)
        with pytest.raises(PhaseError, match="discard_step"):
            delayed.load_state_dict(good)
        delayed.discard_step()
        delayed.load_state_dict(good)


class TestDiscardStep:
    def test_drops_what_was_recorded_and_resets_the_phase(self, delayed):
        h = delayed.register("fc", roles=(I,))
        with delayed.forward():
            h.quantize(torch.full((4,), 9.0), I)
        delayed.begin_backward()
        delayed.discard_step()
        assert delayed.phase is ss.Phase.IDLE
        assert delayed.buffers()["step_amax"].tolist() == [0.0]
        delayed.step()
        assert h.amax_history(I).tolist() == [0.0] * 4

    def test_a_weight_cast_cached_before_the_discard_is_recorded_again(self, delayed):
        layer = ss.nn.Linear(4, 4, manager=delayed, name="fc")
        x = torch.randn(2, 4)
        with delayed.forward():
            layer(x)
        delayed.discard_step()
        with delayed.forward():
            layer(x)
        w_row = delayed.slots.index(("fc", W))
        assert delayed.buffers()["step_amax"][w_row].item() == layer.weight.abs().max().item()

    def test_not_inside_a_block(self, delayed):
        with delayed.forward(), pytest.raises(PhaseError, match="discard_step"):
            delayed.discard_step()
