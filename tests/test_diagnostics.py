"""manager.stats(), collect_stats and the flat view: values against numbers computed here from the data fed in."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import scalestate as ss
from helpers import backend_for
from scalestate.testing import OpLog

E4M3_MAX = 448.0
#: Half of E4M3's smallest subnormal (2**-9): anything smaller in magnitude rounds to zero.
E4M3_FLUSH = 2.0**-10
TINY = 2.0**-20
#: A clip to 1 - 2**-4 of a value (E4M3's largest relative rounding error) in bits: what the flags allow.
E4M3_ROUNDING_BITS = -math.log2(1 - 2.0**-4)


def _manager(recipe: ss.Recipe | None = None, **kwargs: object) -> ss.ScalingStateManager:
    return ss.ScalingStateManager(recipe or ss.DelayedScaling(history_len=4), backend="emulation", **kwargs)


def _record(manager: ss.ScalingStateManager, handle: ss.ScalingHandle, *xs: torch.Tensor, transpose: bool = False):
    """One training step casting each x for INPUT; returns the casts."""
    with manager.forward():
        qs = [handle.quantize(x, ss.Role.INPUT, transpose=transpose) for x in xs]
    manager.step()
    return qs


class TestSlotValues:
    def test_amaxes_scale_headroom_against_the_data(self):
        """amax is the newest step's max |x|, amax_max the history's, headroom log2(fp8_max / (amax * scale))."""
        m = _manager()
        h = m.register("fc", roles=(ss.Role.INPUT,))
        peaks = [3.0, 10.0, 5.0]
        for peak in peaks:
            _record(m, h, torch.tensor([0.5, -peak, 1.0]))
        s = m.stats()["fc"][ss.Role.INPUT]
        scale = torch.tensor(E4M3_MAX) / torch.tensor(10.0)  # float32, as the step computes it
        assert s.amax == 5.0 and s.amax_max == 10.0 and s.scale == scale.item()
        assert s.amax_history == (0.0, 3.0, 10.0, 5.0)
        assert s.headroom_bits == math.log2(E4M3_MAX / (5.0 * scale.item()))
        assert s.fp8_max == E4M3_MAX and s.nonfinite_steps == 0
        assert m.stats().iteration == 3

    def test_no_amax_yet_is_infinite_headroom(self):
        """Before any amax is recorded, amax is 0 and the headroom +inf (nothing can saturate yet)."""
        m = _manager()
        m.register("fc", roles=(ss.Role.INPUT,))
        s = m.stats()["fc"][ss.Role.INPUT]
        assert s.amax == 0.0 and s.amax_max == 0.0 and s.headroom_bits == math.inf and s.scale == 1.0
        assert s.flags == ()  # no step yet: nothing to flag

    def test_nonfinite_steps_counted(self):
        """A step whose amax is infinite counts, and keeps the newest finite amax."""
        m = _manager()
        h = m.register("fc", roles=(ss.Role.INPUT,))
        _record(m, h, torch.tensor([2.0]))
        _record(m, h, torch.tensor([float("inf")]))
        s = m.stats()["fc"][ss.Role.INPUT]
        assert s.nonfinite_steps == 1 == m.nonfinite_counts()["fc"][ss.Role.INPUT]
        assert s.amax == 2.0 and ss.RiskFlag.NONFINITE in s.flags

    def test_mapping_in_registration_order(self):
        """stats() maps names (registration order) to roles to SlotStats."""
        m = _manager()
        m.register("b", roles=(ss.Role.WEIGHT, ss.Role.INPUT))
        m.register("a")
        stats = m.stats()
        assert list(stats) == ["b", "a"] and len(stats) == 2
        assert list(stats["b"]) == [ss.Role.WEIGHT, ss.Role.INPUT]
        assert [(s.name, s.role) for s in stats.slots()] == list(m.slots)


class TestFlags:
    def test_an_amax_its_history_covers_is_not_flagged(self):
        """margin 0: a slot scaled from its newest amax has 0 bits of headroom, and is no risk: not flagged."""
        m = _manager(ss.DelayedScaling(history_len=4))
        h = m.register("fc", roles=(ss.Role.INPUT,))
        for peak in (4.0, 4.0, 3.5, 4.0, 3.8):
            _record(m, h, torch.tensor([peak]))
            s = m.stats()["fc"][ss.Role.INPUT]
            assert s.flags == () and s.uncovered_bits == 0.0
        _record(m, h, torch.tensor([4.0]))
        assert m.stats()["fc"][ss.Role.INPUT].headroom_bits == pytest.approx(0.0, abs=1e-6)

    def test_a_jump_past_the_history_is_flagged_then_covered(self):
        """An amax 4x its history's: 2 bits less E4M3's rounding uncovered, flagged (saturated too, with
        statistics); the next step's scale covers it and the flags go."""
        m = _manager(ss.DelayedScaling(history_len=4), collect_stats=True)
        h = m.register("fc", roles=(ss.Role.INPUT,))
        _record(m, h, torch.tensor([1.0, 0.5]))
        _record(m, h, torch.tensor([4.0, 0.5]))
        s = m.stats()["fc"][ss.Role.INPUT]
        assert s.uncovered_bits == pytest.approx(2.0 - E4M3_ROUNDING_BITS)
        assert s.flags == (ss.RiskFlag.LOW_HEADROOM, ss.RiskFlag.SATURATED) and s.saturated_fraction == 0.5
        _record(m, h, torch.tensor([4.0, 0.5]))
        assert m.stats()["fc"][ss.Role.INPUT].flags == ()

    def test_growth_the_history_does_not_follow_is_flagged(self):
        """1.5x per step: each step clips by log2(1.5) bits; the excesses over rounding add up, and the
        third such step passes 1 bit. A jump within one doubling is not flagged on its own."""
        m = _manager(ss.DelayedScaling(history_len=8))
        h = m.register("fc", roles=(ss.Role.INPUT,))
        _record(m, h, torch.tensor([1.0]))
        for k in range(1, 5):
            _record(m, h, torch.tensor([1.5**k]))
            s = m.stats()["fc"][ss.Role.INPUT]
            assert s.uncovered_bits == pytest.approx(k * (math.log2(1.5) - E4M3_ROUNDING_BITS), rel=1e-6)
            assert (ss.RiskFlag.LOW_HEADROOM in s.flags) is (k >= 3)

    def test_margin_and_slow_growth_are_covered(self):
        """margin 1 covers a growth of 1.5x per step; 5% per step (a clip within E4M3's rounding) needs no margin."""
        for margin, factor in ((1, 1.5), (0, 1.05)):
            m = _manager(ss.DelayedScaling(history_len=16, margin=margin))
            h = m.register("fc", roles=(ss.Role.INPUT,))
            for k in range(20):
                _record(m, h, torch.tensor([factor**k]))
                s = m.stats()["fc"][ss.Role.INPUT]
                assert s.flags == () and s.uncovered_bits == 0.0, (margin, factor, k)

    def test_e5m2_gradients_have_their_own_rounding(self):
        """A gradient slot (E5M2 under HYBRID) allows 0.193 bits: a 3x jump leaves log2(3) - 0.193 uncovered."""
        m = _manager(ss.DelayedScaling(history_len=4))
        h = m.register("fc", roles=(ss.Role.GRAD_OUTPUT,))
        _record_grad = [torch.tensor([1.0]), torch.tensor([3.0])]
        for g in _record_grad:
            h.quantize(g, ss.Role.GRAD_OUTPUT)
            m.step()
        s = m.stats()["fc"][ss.Role.GRAD_OUTPUT]
        assert s.uncovered_bits == pytest.approx(math.log2(3.0) + math.log2(1 - 2.0**-3))
        assert s.flags == (ss.RiskFlag.LOW_HEADROOM,)

    def test_no_amax_after_a_step(self):
        """A slot that only ran in evaluation has no amax after a step: flagged no-amax."""
        m = _manager()
        h = m.register("fc", roles=(ss.Role.INPUT,))
        with torch.no_grad():
            h.quantize(torch.ones(4), ss.Role.INPUT)  # evaluation: records nothing
        m.step()
        assert m.stats()["fc"][ss.Role.INPUT].flags == (ss.RiskFlag.NO_AMAX,)

    def test_constant_history(self):
        """The same amax over the whole window is flagged constant; a window not yet full is not."""
        m = _manager()
        h = m.register("fc", roles=(ss.Role.INPUT,))
        for step in range(4):
            _record(m, h, torch.tensor([2.0, -1.0]))
            assert (ss.RiskFlag.CONSTANT in m.stats()["fc"][ss.Role.INPUT].flags) is (step == 3)

    def test_just_in_time_recipes_not_flagged_for_headroom(self):
        """Current scaling scales every cast from itself: 0 bits of headroom is no risk."""
        m = _manager(ss.CurrentScaling())
        h = m.register("fc", roles=(ss.Role.INPUT,))
        _record(m, h, torch.tensor([4.0]))
        s = m.stats()["fc"][ss.Role.INPUT]
        assert s.headroom_bits == pytest.approx(0.0, abs=1e-6) and s.flags == ()


class TestCastStatistics:
    def _input(self, n_sat: int, n_tiny: int, n_zero: int, n_normal: int, peak: float) -> torch.Tensor:
        """Elements above 2 * peak (saturate at scale 448 / peak), tiny ones (flush), zeros, and normal ones."""
        parts = [torch.full((n_sat,), -3 * peak), torch.full((n_tiny,), peak * TINY), torch.zeros(n_zero),
                 torch.full((n_normal,), peak / 2)]
        return torch.cat(parts)[torch.randperm(n_sat + n_tiny + n_zero + n_normal)]

    def test_saturated_and_flushed_fractions(self):
        """Known numbers of elements above fp8_max / scale and below E4M3's smallest subnormal / scale."""
        m = _manager(collect_stats=True)
        h = m.register("fc", roles=(ss.Role.INPUT,))
        _record(m, h, torch.tensor([8.0]))  # history: scale = 448 / 8 = 56
        x = self._input(n_sat=5, n_tiny=7, n_zero=3, n_normal=25, peak=8.0)
        (q,) = _record(m, h, x)
        assert q.scale.item() == 56.0
        assert (x.abs() * 56 > E4M3_MAX).sum() == 5 and (x.abs() * 56 < E4M3_FLUSH).sum() == 7 + 3  # the data
        s = m.stats()["fc"][ss.Role.INPUT]
        assert s.cast_elements == 40
        assert s.saturated_fraction == 5 / 40
        assert s.underflow_fraction == 7 / 37  # of the 37 non-zero elements
        assert ss.RiskFlag.SATURATED in s.flags

    def test_sums_over_the_steps_casts(self):
        """Every recorded cast of the step counts (microbatches add up)."""
        m = _manager(collect_stats=True)
        h = m.register("fc", roles=(ss.Role.INPUT,))
        _record(m, h, torch.tensor([8.0]))
        _record(m, h, self._input(2, 0, 0, 8, 8.0), self._input(0, 4, 0, 6, 8.0))
        s = m.stats()["fc"][ss.Role.INPUT]
        assert (s.cast_elements, s.saturated_fraction, s.underflow_fraction) == (20, 2 / 20, 4 / 20)

    def test_recompute_and_evaluation_do_not_count(self):
        """Only the training cast counts: a recompute and an evaluation cast of saturating data add nothing."""
        m = _manager(collect_stats=True)
        h = m.register("fc", roles=(ss.Role.INPUT,))
        _record(m, h, torch.tensor([8.0]))
        with m.forward():
            h.quantize(self._input(0, 1, 0, 9, 8.0), ss.Role.INPUT)
        with m.recompute():
            h.quantize(self._input(10, 0, 0, 0, 8.0), ss.Role.INPUT)
        with torch.no_grad():
            h.quantize(self._input(10, 10, 0, 0, 8.0), ss.Role.INPUT)
        m.step()
        s = m.stats()["fc"][ss.Role.INPUT]
        assert (s.cast_elements, s.saturated_fraction, s.underflow_fraction) == (10, 0.0, 1 / 10)

    def test_a_slot_without_casts_in_the_last_step_has_none(self):
        """Fractions describe the last completed step: a slot that did not run in it has None."""
        m = _manager(collect_stats=True)
        h = m.register("fc", roles=(ss.Role.INPUT,))
        _record(m, h, torch.ones(4))
        assert m.stats()["fc"][ss.Role.INPUT].saturated_fraction == 0.0
        m.step()
        s = m.stats()["fc"][ss.Role.INPUT]
        assert s.cast_elements == 0 and s.saturated_fraction is None and s.underflow_fraction is None

    def test_pending_counts_are_not_shown_and_discard_drops_them(self):
        """Counts of the step in progress show only after step(); discard_step() drops them."""
        m = _manager(collect_stats=True)
        h = m.register("fc", roles=(ss.Role.INPUT,))
        _record(m, h, torch.ones(4))
        with m.forward():
            h.quantize(torch.ones(6), ss.Role.INPUT)
        assert m.stats()["fc"][ss.Role.INPUT].cast_elements == 4
        m.discard_step()
        with m.forward():
            h.quantize(torch.ones(3), ss.Role.INPUT)
        m.step()
        assert m.stats()["fc"][ss.Role.INPUT].cast_elements == 3

    def test_weight_cast_counts_at_every_training_use(self):
        """A cached weight cast counts once per recording use, also when an evaluation pass made it."""
        m = _manager(collect_stats=True)
        layer = ss.nn.Linear(8, 4, manager=m)
        with torch.no_grad():
            layer(torch.randn(2, 8))  # evaluation: caches the weight cast, counts nothing
        for _ in range(3):  # three microbatches hit that cast
            with m.forward():
                loss = layer(torch.randn(2, 8)).sum()
            with m.backward():
                loss.backward()
        m.step()
        s = m.stats()["linear"]
        assert s[ss.Role.WEIGHT].cast_elements == 3 * 32
        assert s[ss.Role.INPUT].cast_elements == 3 * 16 and s[ss.Role.GRAD_OUTPUT].cast_elements == 3 * 8

    def test_off_by_default(self):
        """Without collect_stats the fractions are None and the flat view leaves them out."""
        m = _manager()
        h = m.register("fc", roles=(ss.Role.INPUT,))
        _record(m, h, torch.ones(4))
        s = m.stats()
        assert not m.collect_stats and not s.collect_stats
        assert s["fc"][ss.Role.INPUT].saturated_fraction is None and s["fc"][ss.Role.INPUT].cast_elements is None
        assert not any(k.endswith("_fraction") for k in s.flat())

    def test_bad_flag(self):
        with pytest.raises(ss.errors.ScaleStateError, match="collect_stats must be True or False; got 1"):
            _manager(collect_stats=1)


class TestEveryRecipe:
    """Per recipe: flushing is against the scale of each element's own tile, and both orientations count."""

    def _tensor(self) -> torch.Tensor:
        # each row: a peak of 64, one tiny value, one zero, the rest 1.0: the tiny value shares its
        # row, tile, block and MX block with 1.0 or 64, so it flushes in every granularity; down a
        # column (the other orientation) it is alone with its like, so it does not
        x = torch.ones(4, 32)
        x[:, 0], x[:, 1], x[:, 2] = 64.0, TINY, 0.0
        return x

    @pytest.mark.parametrize("transpose", [False, True])
    def test_counts(self, recipe, backend, transpose):
        m = ss.ScalingStateManager(recipe, backend=backend, collect_stats=True)
        h = m.register("fc", roles=(ss.Role.INPUT,))
        _record(m, h, self._tensor(), transpose=transpose)
        s = m.stats()["fc"][ss.Role.INPUT]
        # per-tensor scales serve both orientations (one count); an INPUT under every fine-grained
        # recipe is scaled along rows (1 x B tiles for BlockScaling), so its columns are a second,
        # separately scaled quantization, and count too
        fine = isinstance(recipe, (ss.RowwiseScaling, ss.BlockScaling, ss.MXFP8Scaling, ss.NVFP4Scaling))
        orientations = 2 if transpose and fine else 1
        assert s.cast_elements == 128 * orientations
        assert s.saturated_fraction == 0.0  # just in time (first step): every tile scales from its own max
        if isinstance(recipe, ss.NVFP4Scaling):
            # E2M1's smallest step is 1/12 of a block's max: a row's 13 ones (in 64's block) flush with the
            # tiny value; down the columns, the tiny values' block scale itself flushes to zero
            assert s.underflow_fraction == (56 + 4 * (orientations - 1)) / (124 * orientations)
        else:
            assert s.underflow_fraction == 4 / (124 * orientations)
        assert s.amax == 64.0

    def test_flat_keys(self, recipe, backend):
        """The flat view: scalestate/<name>/<role>/<stat> for every slot, floats only."""
        m = ss.ScalingStateManager(recipe, backend=backend_for(recipe, "emulation"), collect_stats=True)
        layer = ss.nn.Linear(32, 32, manager=m)
        with m.forward():
            loss = layer(torch.randn(4, 32)).sum()
        with m.backward():
            loss.backward()
        m.step()
        flat = m.stats().flat()
        stats = ("scale", "amax", "amax_max", "headroom_bits", "nonfinite_steps", "uncovered_bits",
                 "saturated_fraction", "underflow_fraction")
        assert set(flat) == {f"scalestate/linear/{r.value}/{k}" for r in ss.Role for k in stats}
        assert all(type(v) is float for v in flat.values())
        assert set(m.stats().flat(prefix="fp8")) == {k.replace("scalestate/", "fp8/", 1) for k in flat}


class TestInvariants:
    def test_state_dict_unchanged_and_load_clears_counts(self):
        """collect_stats saves nothing more; a load starts the counts afresh."""
        plain, counted = _manager(), _manager(collect_stats=True)
        for m in (plain, counted):
            h = m.register("fc", roles=(ss.Role.INPUT,))
            _record(m, h, torch.tensor([3.0, 1.0]))
        a, b = plain.state_dict(), counted.state_dict()
        assert a.keys() == b.keys() and all(
            torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a
        )
        counted.load_state_dict(a)
        s = counted.stats()["fc"][ss.Role.INPUT]
        assert s.cast_elements == 0 and s.saturated_fraction is None and s.amax == 3.0

    def test_no_extra_host_reads(self):
        """collect_stats adds no operation that reads a value back to the host in forward or backward."""
        host_reads = {"_local_scalar_dense", "is_nonzero", "item", "equal", "nonzero"}

        def reads(collect: bool) -> list[str]:
            torch.manual_seed(0)
            m = _manager(collect_stats=collect)
            layer = ss.nn.Linear(8, 8, manager=m)
            for _ in range(2):
                with OpLog() as ops:
                    with m.forward():
                        loss = layer(torch.randn(4, 8)).sum()
                    with m.backward():
                        loss.backward()
                m.step()
            return [name for name in (op.split(".")[1] for op in ops.ops) if name in host_reads]

        assert reads(True) == reads(False)

    def test_compiled_counts_equal_eager(self):
        """Under torch.compile (fullgraph) the counts are those of eager training."""

        def run(compiled: bool) -> list[tuple]:
            torch.manual_seed(0)
            m = _manager(collect_stats=True)
            layer = ss.nn.Linear(16, 16, manager=m)
            f = torch.compile(layer, backend="aot_eager", fullgraph=True) if compiled else layer
            for step in range(3):
                with m.forward():
                    loss = f(torch.randn(4, 16) * 4**step).square().sum()
                with m.backward():
                    loss.backward()
                m.step()
            return [(s.cast_elements, s.saturated_fraction, s.underflow_fraction) for s in m.stats().slots()]

        eager = run(False)
        assert eager[0][1] > 0  # the growing input saturated: the comparison is not vacuous
        assert run(True) == eager

    def test_two_managers_do_not_interact(self):
        """Each manager counts its own casts only."""
        a, b = _manager(collect_stats=True), _manager(collect_stats=True)
        ha, hb = a.register("fc", roles=(ss.Role.INPUT,)), b.register("fc", roles=(ss.Role.INPUT,))
        _record(a, ha, torch.ones(5))
        _record(b, hb, torch.ones(2))
        assert a.stats()["fc"][ss.Role.INPUT].cast_elements == 5 and b.stats()["fc"][ss.Role.INPUT].cast_elements == 2


class TestStateDictStats:
    def test_matches_the_managers_own(self):
        """stats_from_state_dict gives the manager's stats() (less the cast counts)."""
        m = _manager(collect_stats=True)
        h = m.register("fc", roles=(ss.Role.INPUT, ss.Role.GRAD_OUTPUT))
        _record(m, h, torch.tensor([2.0, -7.0]))
        saved = ss.stats_from_state_dict(m.state_dict())
        live = m.stats()
        for s in live.slots():
            other = saved[s.name][s.role]
            assert other.amax_history == s.amax_history and other.scale == s.scale and other.flags == s.flags
            assert other.saturated_fraction is None
        assert saved.recipe == m.recipe and saved.iteration == 1

    def test_rejects_what_is_not_a_state(self):
        with pytest.raises(ss.errors.StateDictError, match="expected a state dict made by"):
            ss.stats_from_state_dict({"model": 1})


class TestNoSlots:
    def test_stats_of_a_manager_without_slots(self):
        """A manager with nothing registered has empty statistics, not an error."""
        stats = _manager().stats()
        assert len(stats) == 0 and stats.slots() == () and stats.at_risk() == () and stats.flat() == {}
        assert stats.iteration == 0


def _steps_without_step(manager: ss.ScalingStateManager, layer: torch.nn.Module, opt: torch.optim.Optimizer,
                        steps: int, microbatches: int = 1, *, step: bool = False) -> None:
    """Training steps of ``microbatches`` passes each, the optimizer stepping after each; manager.step() if ``step``."""
    for _ in range(steps):
        for _ in range(microbatches):
            with manager.forward():
                loss = layer(torch.randn(2, 8)).square().mean()
            with manager.backward():
                loss.backward()
        opt.step()
        opt.zero_grad()
        if step:
            manager.step()


class TestMissingStep:
    """A loop that never calls manager.step() is flagged and warned about; long accumulation is not."""

    def _layer(self) -> tuple[ss.ScalingStateManager, torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        m = _manager()
        layer = ss.nn.Linear(8, 8, manager=m)
        return m, layer, torch.optim.SGD(layer.parameters(), lr=0.1)

    def test_flagged_until_the_first_step(self):
        """Recorded casts and iteration 0: no-step, with the pending amax; gone after step()."""
        m = _manager()
        h = m.register("fc", roles=(ss.Role.INPUT, ss.Role.WEIGHT))
        with m.forward():
            h.quantize(torch.tensor([1.0, -3.0]), ss.Role.INPUT)
        s = m.stats()["fc"]
        assert s[ss.Role.INPUT].flags == (ss.RiskFlag.NO_STEP,) and s[ss.Role.INPUT].step_amax == 3.0
        assert s[ss.Role.WEIGHT].flags == () and s[ss.Role.WEIGHT].step_amax == 0.0  # never cast: nothing pending
        m.step()
        s = m.stats()["fc"][ss.Role.INPUT]
        assert ss.RiskFlag.NO_STEP not in s.flags and s.step_amax == 0.0 and s.amax == 3.0

    def test_optimizer_steps_without_manager_step_warn_once(self):
        """The third in-place weight update within one step warns, once, and flags the slots."""
        m, layer, opt = self._layer()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _steps_without_step(m, layer, opt, 3)  # the weight cast finds the weight updated twice
            assert not [w for w in caught if issubclass(w.category, ss.errors.MissingStepWarning)]
            _steps_without_step(m, layer, opt, 5)
        missing = [w for w in caught if issubclass(w.category, ss.errors.MissingStepWarning)]
        assert len(missing) == 1 and "modified in place 3 times" in str(missing[0].message)
        assert "manager.step()" in str(missing[0].message)
        assert all(ss.RiskFlag.NO_STEP in s.flags for s in m.stats().slots())

    def test_flagged_after_earlier_steps_once_overdue(self):
        """A loop that stops calling step() after some steps is flagged once the signs are seen."""
        m, layer, opt = self._layer()
        _steps_without_step(m, layer, opt, 2, step=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ss.errors.MissingStepWarning)
            _steps_without_step(m, layer, opt, 2)
            assert not any(ss.RiskFlag.NO_STEP in s.flags for s in m.stats().slots())  # 1 update: no sign yet
            _steps_without_step(m, layer, opt, 2)
        assert m.iteration == 2 and all(ss.RiskFlag.NO_STEP in s.flags for s in m.stats().slots())

    def test_long_gradient_accumulation_is_silent(self):
        """Many microbatches per step, the optimizer and the manager stepping once per step: no warning, no flag."""
        m, layer, opt = self._layer()
        with warnings.catch_warnings():
            warnings.simplefilter("error", ss.errors.MissingStepWarning)
            _steps_without_step(m, layer, opt, 3, microbatches=64, step=True)
        assert m.iteration == 3 and not any(ss.RiskFlag.NO_STEP in s.flags for s in m.stats().slots())

    def test_ten_thousand_passes_without_a_step_warn(self):
        """Phase blocks: the 10,000th training pass since the last step() warns, not the 9,999th."""
        m = _manager()
        h = m.register("fc", roles=(ss.Role.INPUT,))
        with warnings.catch_warnings():
            warnings.simplefilter("error", ss.errors.MissingStepWarning)
            for _ in range(9_999):
                with m.forward():
                    h.quantize(torch.ones(2), ss.Role.INPUT)
                with m.backward():
                    pass
        with pytest.warns(ss.errors.MissingStepWarning, match="10,000 training passes"), m.forward():
            pass

    def test_step_starts_the_count_again(self):
        """9,998 passes and a 9,999th that casts, step(), the same again: no warning, no no-step flag."""
        m = _manager()
        h = m.register("fc", roles=(ss.Role.INPUT,))
        with warnings.catch_warnings():
            warnings.simplefilter("error", ss.errors.MissingStepWarning)
            for _ in range(2):
                for _ in range(9_998):
                    with m.forward():
                        pass
                    with m.backward():
                        pass
                with m.forward():
                    h.quantize(torch.ones(2), ss.Role.INPUT)
                m.step()
        assert m.iteration == 2 and ss.RiskFlag.NO_STEP not in m.stats()["fc"][ss.Role.INPUT].flags

    def test_passes_without_phases_are_counted(self):
        """No phase blocks: a pass begins at a recorded forward cast after a recorded backward cast."""
        m = _manager()
        h = m.register("fc", roles=(ss.Role.INPUT, ss.Role.GRAD_OUTPUT))
        x = torch.ones(1)
        with warnings.catch_warnings():
            warnings.simplefilter("error", ss.errors.MissingStepWarning)
            for _ in range(9_999):
                h.quantize(x, ss.Role.INPUT)  # grad enabled, no phase: a training forward
                h.quantize(x, ss.Role.INPUT)  # the same pass
                h.quantize(x, ss.Role.GRAD_OUTPUT)
        with pytest.warns(ss.errors.MissingStepWarning, match="10,000 training passes"):
            h.quantize(x, ss.Role.INPUT)
