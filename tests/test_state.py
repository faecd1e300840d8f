"""The manager's state buffers: they grow by doubling, then never move."""

from __future__ import annotations

import pytest
import torch

import scalestate as ss
from scalestate.errors import SlotError
from scalestate.testing import OpLog, assert_same

I, W, G = ss.Role.INPUT, ss.Role.WEIGHT, ss.Role.GRAD_OUTPUT


def _ptrs(manager):
    return {key: t.data_ptr() for key, t in manager.buffers().items()}


class TestGrowth:
    def test_capacity_doubles(self, delayed):
        """Capacity is a power-of-two multiple of the first allocation and never above twice the slots."""
        seen = set()
        for i in range(1000):
            delayed.register(f"l{i}", roles=(I,))
            seen.add(delayed.capacity)
            assert i + 1 <= delayed.capacity <= max(16, 2 * (i + 1))
        assert seen == {16 * 2**k for k in range(7)}

    def test_registration_is_amortized_constant(self):
        """300 registrations dispatch about the same tensor operations at 200 slots as at 10,000
        (a constant per slot, plus at most one doubling)."""
        counts = []
        for existing in (200, 10_000):
            m = ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation")
            for i in range(existing):
                m.register(f"old{i}", roles=(I,))
            with OpLog() as counter:
                for i in range(300):
                    m.register(f"new{i}", roles=(I,))
            counts.append(len(counter.ops))
        assert abs(counts[0] - counts[1]) <= 24  # one doubling: five buffers allocated and copied
        assert max(counts) <= 300 * 3 + 24

    def test_values_survive_growth(self, delayed):
        """Growing keeps every earlier slot's history, scale and pending amax."""
        source = ss.ScalingStateManager(ss.DelayedScaling(history_len=4), backend="emulation")
        for name in ("a", "b"):
            source.register(name, roles=(I, W))
        with source.forward():
            for h in source.handles.values():
                h.quantize(torch.full((4,), 2.0), I)
        source.step()  # a history and a scale of their own
        handles = [delayed.register(name, roles=(I, W)) for name in ("a", "b")]
        delayed.load_state_dict(source.state_dict())  # loading does not freeze the buffers
        with delayed.forward():
            handles[0].quantize(torch.full((4,), 5.0), I)  # pending: recorded, not yet stepped
            handles[1].quantize(torch.full((4, 4), 7.0), W)
        before, ptrs = delayed.state_dict(), _ptrs(delayed)
        delayed.reserve(100)
        assert delayed.capacity >= 100 and _ptrs(delayed) != ptrs  # the buffers really moved
        assert_same(delayed.state_dict(), before, name="state")
        with delayed.forward():
            handles[0].quantize(torch.full((4,), 3.0), I)  # less than what was pending
        delayed.step()
        assert handles[0].amax_history(I).tolist() == [0.0, 0.0, 2.0, 5.0]
        assert handles[1].amax_history(W).tolist() == [0.0, 0.0, 0.0, 7.0]


class TestStableAddresses:
    def test_buffers_never_move_after_the_first_step(self, delayed):
        """After the first step: steps, registrations within capacity and loads keep every address."""
        h = delayed.register("a")
        with delayed.forward():
            h.quantize(torch.ones(4), I)
        delayed.step()
        before = _ptrs(delayed)
        sd = delayed.state_dict()
        for i in range(delayed.capacity - 3):
            delayed.register(f"late{i}", roles=(I,))
        delayed.step()
        delayed.load_state_dict(delayed.state_dict())
        assert _ptrs(delayed) == before
        assert len(sd["slots"]) == 3

    def test_growth_after_the_first_step_is_refused(self, delayed):
        """A registration that would move the buffers after the first step raises, naming reserve()."""
        delayed.register("a", roles=(I,))
        delayed.step()
        for i in range(delayed.capacity - 1):
            delayed.register(f"b{i}", roles=(I,))
        before = _ptrs(delayed)
        with pytest.raises(SlotError, match=r"manager\.reserve\(17\)"):
            delayed.register("one_too_many", roles=(I,))
        assert "one_too_many" not in delayed.handles and _ptrs(delayed) == before

    def test_reserve_before_the_first_step(self, delayed):
        """reserve() makes room up front, so later registrations never move the buffers."""
        delayed.reserve(1000)
        delayed.register("a", roles=(I,))
        delayed.step()
        before = _ptrs(delayed)
        for i in range(900):
            delayed.register(f"b{i}", roles=(I,))
        assert _ptrs(delayed) == before and delayed.capacity >= 1000

    @pytest.mark.parametrize("bad", [-1, 2.5, True, "10"])
    def test_reserve_rejects_bad_counts(self, delayed, bad):
        """reserve() takes an int >= 0."""
        with pytest.raises(SlotError, match="reserve"):
            delayed.reserve(bad)

    def test_buffers_are_live_views(self, delayed):
        """buffers() shows the state itself: a step changes what an earlier view shows."""
        h = delayed.register("a", roles=(I,))
        view = delayed.buffers()["amax_history"]
        with delayed.forward():
            h.quantize(torch.full((2,), 7.0), I)
        delayed.step()
        assert view[0, -1].item() == 7.0
        assert set(delayed.buffers()) == {"amax_history", "scale", "step_amax"}
