"""scalestate.math: pure scale math against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from scalestate.math import (
    FLOAT32_MAX,
    FLOAT32_TINY,
    ScaleRule,
    abs_max,
    amax_from_history,
    pow2_floor,
    roll_history,
    scale_from_amax,
    update_scales,
)

INF, NAN = float("inf"), float("nan")
POW2 = ScaleRule(power_of_2=True)


class TestRollHistory:
    def test_appends_newest_last_and_drops_oldest(self):
        """A usable amax is appended at the end; the oldest entry falls off."""
        h = torch.tensor([[1.0, 2.0, 3.0]])
        assert roll_history(h, torch.tensor([4.0])).tolist() == [[2.0, 3.0, 4.0]]

    @pytest.mark.parametrize("bad", [0.0, INF, -INF, NAN, -1.0])
    def test_unusable_amax_leaves_history(self, bad):
        """Zero, negative or non-finite amaxes never enter a history."""
        h = torch.tensor([[1.0, 2.0, 3.0]])
        assert roll_history(h, torch.tensor([bad])).tolist() == [[1.0, 2.0, 3.0]]

    def test_rows_are_independent(self):
        """Each row rolls only on its own amax."""
        h = torch.tensor([[1.0, 2.0], [5.0, 6.0]])
        out = roll_history(h, torch.tensor([0.0, 7.0]))
        assert out.tolist() == [[1.0, 2.0], [6.0, 7.0]]

    def test_does_not_modify_input(self):
        """Pure: the input history is unchanged."""
        h = torch.tensor([[1.0, 2.0]])
        roll_history(h, torch.tensor([3.0]))
        assert h.tolist() == [[1.0, 2.0]]


class TestAmaxFromHistory:
    def test_max(self):
        """'max' takes the largest entry."""
        assert amax_from_history(torch.tensor([[3.0, 9.0, 2.0]]), "max").tolist() == [9.0]

    def test_most_recent(self):
        """'most_recent' takes the newest (last) entry."""
        assert amax_from_history(torch.tensor([[3.0, 9.0, 2.0]]), "most_recent").tolist() == [2.0]


class TestScaleFromAmax:
    def test_e4m3(self):
        """448 / 2 = 224."""
        assert scale_from_amax(torch.tensor(2.0), 448.0).item() == 224.0

    def test_e5m2(self):
        """57344 / 8 = 7168."""
        assert scale_from_amax(torch.tensor(8.0), 57344.0).item() == 7168.0

    def test_margin(self):
        """448 / 2 / 2**3 = 28."""
        assert scale_from_amax(torch.tensor(2.0), 448.0, ScaleRule(margin=3)).item() == 28.0

    def test_power_of_2_rounds_down(self):
        """448 / 3 = 149.33 -> 128; 448 / 0.5 = 896 -> 512."""
        out = scale_from_amax(torch.tensor([3.0, 0.5]), 448.0, POW2)
        assert out.tolist() == [128.0, 512.0]

    def test_power_of_2_keeps_exact_powers(self):
        """A scale that is already a power of two stays: 448 / 1.75 = 256."""
        assert scale_from_amax(torch.tensor(1.75), 448.0, POW2).item() == 256.0

    @pytest.mark.parametrize("bad", [0.0, INF, -INF, NAN])
    def test_unusable_amax_keeps_previous(self, bad):
        """Zero or non-finite amax: the previous scale is kept."""
        out = scale_from_amax(torch.tensor(bad), 448.0, previous=torch.tensor(3.5))
        assert out.item() == 3.5

    def test_overflow_becomes_float32_max(self):
        """A tiny amax overflows the division: the scale is the float32 max, not inf."""
        out = scale_from_amax(torch.tensor(1e-40), 448.0)
        assert out.item() == FLOAT32_MAX
        assert math.isfinite(out.item())

    def test_overflow_with_power_of_2(self):
        """Overflow then rounding: 2**127."""
        assert scale_from_amax(torch.tensor(1e-40), 448.0, POW2).item() == 2.0**127

    @pytest.mark.parametrize("power_of_2", [False, True])
    def test_never_zero(self, power_of_2):
        """A huge amax with a large margin yields the smallest normal float32, never zero
        (rounding to a power of two keeps it: it is one)."""
        out = scale_from_amax(torch.tensor(FLOAT32_MAX), 448.0, ScaleRule(margin=64, power_of_2=power_of_2))
        assert out.item() == FLOAT32_TINY

    def test_true_division(self):
        """fp8_max / amax is a float32 division, not reciprocal(amax) * fp8_max (they differ here)."""
        amax = torch.tensor(1.0049480199813843)
        assert scale_from_amax(amax, 448.0).item() == torch.div(448.0, amax).item()
        assert scale_from_amax(amax, 448.0).item() != (torch.reciprocal(amax) * 448.0).item()

    def test_out_writes_in_place(self):
        """out= writes the result into a given tensor (which may be previous itself)."""
        previous = torch.tensor([3.5, 3.5])
        ptr = previous.data_ptr()
        scale_from_amax(torch.tensor([2.0, 0.0]), 448.0, previous=previous, out=previous)
        assert previous.tolist() == [224.0, 3.5] and previous.data_ptr() == ptr

    def test_tensor_fp8_max_broadcasts(self):
        """Per-slot fp8_max: [448, 57344] / [2, 2]."""
        out = scale_from_amax(torch.tensor([2.0, 2.0]), torch.tensor([448.0, 57344.0]))
        assert out.tolist() == [224.0, 28672.0]


class TestPow2Floor:
    def test_values(self):
        """Exact rounding down to powers of two."""
        x = torch.tensor([1.0, 1.5, 3.0, 1023.0, 1024.0, 0.3])
        assert pow2_floor(x).tolist() == [1.0, 1.0, 2.0, 512.0, 1024.0, 0.25]

    def test_matches_frexp_over_the_normal_range(self):
        """Bitwise the frexp definition for normal float32 values, the extremes included."""
        x = torch.cat([
            torch.logspace(-37.9, 38.5, 20001),
            torch.tensor([FLOAT32_TINY, FLOAT32_MAX, 1.0, 2.0**-126, 2.0**127]),
        ]).clamp(FLOAT32_TINY, FLOAT32_MAX)
        _, exponent = torch.frexp(x)
        assert torch.equal(pow2_floor(x), torch.ldexp(torch.ones_like(x), exponent - 1))


class TestUpdateScales:
    def test_full_step(self):
        """Roll, take max, derive; unrun slots keep history and scale."""
        history = torch.tensor([[0.0, 4.0], [0.0, 0.0], [1.0, 2.0]])
        scales = torch.tensor([112.0, 1.0, 224.0])
        step_amax = torch.tensor([2.0, 0.0, NAN])
        fp8_max = torch.tensor([448.0, 448.0, 57344.0])
        h, s = update_scales(history, scales, step_amax, fp8_max, ScaleRule())
        assert h.tolist() == [[4.0, 2.0], [0.0, 0.0], [1.0, 2.0]]
        assert s.tolist() == [112.0, 1.0, 28672.0]
        assert history.tolist() == [[0.0, 4.0], [0.0, 0.0], [1.0, 2.0]]  # pure by default

    def test_in_place(self):
        """in_place=True writes into the given history and scales, keeping their storage."""
        history, scales = torch.tensor([[0.0, 4.0]]), torch.tensor([112.0])
        ptrs = (history.data_ptr(), scales.data_ptr())
        h, s = update_scales(history, scales, torch.tensor([2.0]), torch.tensor([448.0]), ScaleRule(), in_place=True)
        assert h is history and s is scales and (history.data_ptr(), scales.data_ptr()) == ptrs
        assert history.tolist() == [[4.0, 2.0]] and scales.tolist() == [112.0]

    def test_most_recent(self):
        """most_recent derives from the just-rolled amax."""
        h, s = update_scales(
            torch.tensor([[8.0, 8.0]]), torch.tensor([56.0]), torch.tensor([2.0]),
            torch.tensor([448.0]), ScaleRule(amax_compute="most_recent"),
        )
        assert h.tolist() == [[8.0, 2.0]] and s.tolist() == [224.0]


#: torchao's amax floor, and the float32 the scale math makes of it (just below 1e-12).
FLOOR = ScaleRule(amax_floor=1e-12)
F32_FLOOR = torch.tensor(1e-12)
#: Amaxes below the floor: tiny normal ones, a subnormal one, the smallest subnormal, and the float32
#: just below the floor's own.
BELOW_FLOOR = [1e-13, 1e-30, 1e-40, 2.0**-149, torch.nextafter(F32_FLOOR, torch.tensor(0.0)).item()]


class TestAmaxFloor:
    """ScaleRule.amax_floor: amaxes below it scale as the floor; zero and non-finite ones keep the previous scale."""

    @pytest.mark.parametrize("amax", BELOW_FLOOR, ids=lambda a: f"{a:.9g}")
    @pytest.mark.parametrize("fp8_max", [448.0, 57344.0])
    def test_below_the_floor(self, amax, fp8_max):
        """fp8_max / float32(1e-12): 4.48e14 for E4M3, 5.734e16 for E5M2, whatever the amax under it."""
        out = scale_from_amax(torch.tensor(amax), fp8_max, FLOOR)
        assert torch.equal(out, torch.div(fp8_max, F32_FLOOR))
        assert out.item() == {448.0: 447999985582080.0, 57344.0: 5.734399815450624e16}[fp8_max]

    def test_without_floor_the_scale_follows(self):
        """No floor (the default): 1e-13 gives ten times the floor's scale, 1e-30 5.7e34, 1e-40 the float32 max."""
        amax = torch.tensor([1e-13, 1e-30, 1e-40])
        out = scale_from_amax(amax, 57344.0)
        assert torch.equal(out[:2], torch.div(57344.0, amax[:2])) and out[2].item() == FLOAT32_MAX
        assert out[0].item() == pytest.approx(5.7344e17, rel=1e-6)

    def test_above_the_floor_unchanged(self):
        """The next float32 above the floor, and ordinary amaxes, divide as without a floor."""
        amax = torch.tensor([torch.nextafter(torch.tensor(1e-12), torch.tensor(1.0)).item(), 1e-5, 2.0, 3e30])
        assert torch.equal(scale_from_amax(amax, 448.0, FLOOR), scale_from_amax(amax, 448.0))

    @pytest.mark.parametrize("bad", [0.0, INF, NAN])
    def test_unusable_amax_keeps_previous(self, bad):
        """Zero (no cast) and non-finite amaxes keep the previous scale, floor or not."""
        out = scale_from_amax(torch.tensor(bad), 448.0, FLOOR, previous=torch.tensor(3.5))
        assert out.item() == 3.5

    def test_with_margin_and_power_of_2(self):
        """The floor comes first: 448 / float32(1e-12) / 2**2, then rounded down to 2**46."""
        rule = ScaleRule(margin=2, power_of_2=True, amax_floor=1e-12)
        out = scale_from_amax(torch.tensor(1e-20), 448.0, rule)
        assert out.item() == 2.0**46 and 2.0**46 <= 448 / 1e-12 / 4 < 2.0**47

    def test_update_scales(self):
        """A step's tiny amax enters the history as it is; the scale derived from it is the floor's."""
        h, s = update_scales(torch.zeros(1, 2), torch.ones(1), torch.tensor([1e-30]), torch.tensor([448.0]), FLOOR)
        assert h.tolist() == [[0.0, pytest.approx(1e-30)]] and torch.equal(h[0, 1], torch.tensor(1e-30))
        assert torch.equal(s[0], torch.div(448.0, F32_FLOOR))


class TestAbsMax:
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
    @pytest.mark.parametrize(
        "values",
        [
            [1.5, -3.0, 2.0], [-1.0, -7.0], [0.25, 4.0], [-0.0, -0.0], [0.0, -0.0], [INF, 1.0], [-INF, 1.0],
            [NAN, 1.0], [1.0, -NAN, -5.0], [FLOAT32_TINY / 4, -FLOAT32_TINY / 8],
        ],
    )
    def test_equals_the_max_of_abs_bitwise(self, values, dtype):
        """max|x| bit for bit as x.abs().amax() gives it, NaN kept, an all -0.0 tensor's +0.0 included."""
        x = torch.tensor(values, dtype=dtype)
        got, want = abs_max(x), x.abs().amax()
        assert got.dtype == dtype and got.dim() == 0
        assert torch.equal(got.view(torch.int16 if dtype != torch.float32 else torch.int32),
                           want.view(torch.int16 if dtype != torch.float32 else torch.int32))

    def test_random_tensors_and_the_empty_one(self):
        torch.manual_seed(0)
        for shape in [(1,), (7, 5), (64, 130), (3, 4, 5)]:
            x = torch.randn(shape) * 100
            assert torch.equal(abs_max(x), x.abs().amax())
            assert torch.equal(abs_max(x.t() if x.dim() == 2 else x), x.abs().amax())
        assert torch.equal(abs_max(torch.empty(0, 3)), torch.tensor(0.0))

    def test_compiled_gives_the_same_value(self):
        x = torch.randn(33, 17)
        x[3, 4] = -1e30
        assert torch.equal(torch.compile(abs_max, backend="aot_eager", fullgraph=True)(x), abs_max(x))
