"""scalestate.backends.emulation: the reference cast and step update."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import scalestate as ss
from scalestate.backends import CastRequest, CastSpec, StepUpdate
from scalestate.backends.emulation import EmulationBackend
from scalestate.backends.scaled_mm import ScaledMMBackend
from scalestate.math import ScaleRule, update_scales
from scalestate.quantized import Quantized
from scalestate.testing import OpLog, assert_same

E4M3 = CastSpec(torch.float8_e4m3fn, 448.0)
E5M2 = CastSpec(torch.float8_e5m2, 57344.0)
NAN, INF = float("nan"), float("inf")


def cast(x, scale=1.0, spec=E4M3, jit=False, record=None, transpose=False) -> Quantized:
    s = scale if isinstance(scale, torch.Tensor) else torch.tensor(scale)
    return EmulationBackend().cast(CastRequest(x, spec, s, jit, record, transpose))


class TestCast:
    def test_exact_values_roundtrip(self):
        """Values representable in E4M3 survive a cast with scale 1 exactly."""
        x = torch.tensor([0.0, 1.0, -2.0, 448.0, 0.015625])
        assert torch.equal(cast(x).dequantize(), x)

    def test_saturates(self):
        """Values beyond the range saturate to +-fp8_max instead of becoming NaN."""
        q = cast(torch.tensor([1000.0, -1e6, INF]))
        assert q.dequantize().tolist() == [448.0, -448.0, 448.0]
        q = cast(torch.tensor([1e6, -INF]), spec=E5M2)
        assert q.dequantize().tolist() == [57344.0, -57344.0]

    def test_rounds_to_nearest_even(self):
        """Between 1 and 1.125 (E4M3 spacing 0.125), ties go to the even mantissa."""
        q = cast(torch.tensor([1.0625, 1.1875, 1.07]))
        assert q.dequantize().tolist() == [1.0, 1.25, 1.125]

    def test_scale_applied_and_both_scales_carried(self):
        """data = x * scale; scale is the multiplier, scale_inv its reciprocal."""
        q = cast(torch.tensor([1.0, 0.5]), scale=4.0)
        assert q.data.float().tolist() == [4.0, 2.0]
        assert q.scale.item() == 4.0 and q.scale_inv.item() == 0.25

    def test_scales_are_fresh_tensors(self):
        """The Quantized's scales never alias the request's (the slot's scale changes at a step)."""
        slot_scale = torch.tensor([4.0])
        q = cast(torch.tensor([1.0]), scale=slot_scale[0])
        slot_scale.fill_(8.0)
        assert q.scale.item() == 4.0 and q.scale_inv.item() == 0.25

    def test_jit_scales_from_own_amax(self):
        """jit=True: the amax maps onto fp8_max, whatever scale was passed."""
        q = cast(torch.tensor([2.0, -1.0]), jit=True)
        assert q.data.float().tolist() == [448.0, -224.0] and q.scale.item() == 224.0

    def test_jit_follows_the_rule(self):
        """Just-in-time scales take the spec's margin and power-of-two rounding."""
        spec = CastSpec(torch.float8_e4m3fn, 448.0, ScaleRule(margin=1, power_of_2=True))
        assert cast(torch.tensor([3.0]), spec=spec, jit=True).scale.item() == 64.0  # 448/3/2 = 74.7 -> 64

    def test_jit_tensor_decides_on_device(self):
        """A 0-d bool tensor chooses between own and given scale."""
        x = torch.tensor([2.0])
        assert cast(x, jit=torch.tensor(True)).data.float().item() == 448.0
        assert cast(x, jit=torch.tensor(False)).data.float().item() == 2.0

    @pytest.mark.parametrize("bad", [0.0, NAN, INF])
    def test_jit_with_unusable_amax_keeps_the_given_scale(self, bad):
        """A zero or non-finite amax scales with the given scale, never an infinite or zero one."""
        assert cast(torch.tensor([bad, 0.0]), scale=3.0, jit=True).scale.item() == 3.0

    def test_bfloat16_input_computed_in_float32(self):
        """A bf16 input is cast through float32: the same bits as casting its float32 copy."""
        x = torch.randn(64, dtype=torch.bfloat16) * 30
        assert torch.equal(cast(x, jit=True).data.view(torch.uint8), cast(x.float(), jit=True).data.view(torch.uint8))

    def test_empty_tensor(self):
        """An empty tensor casts to an empty tensor and records amax 0."""
        acc = torch.zeros(())
        q = cast(torch.zeros(0, 4), jit=True, record=acc)
        assert q.shape == (0, 4) and acc.item() == 0.0


class TestRecord:
    def test_maxes_into_the_accumulator_in_place(self):
        """The amax is max-reduced into the record view, in place; other rows are untouched."""
        buffer = torch.tensor([0.0, 5.0, 0.0])
        ptr = buffer.data_ptr()
        cast(torch.tensor([3.0, -7.0]), record=buffer[1])
        cast(torch.tensor([6.0]), record=buffer[1])
        assert buffer.tolist() == [0.0, 7.0, 0.0] and buffer.data_ptr() == ptr

    def test_nan_propagates(self):
        """A NaN in the tensor makes the accumulator NaN (for the manager's non-finite policy)."""
        acc = torch.tensor(5.0)
        cast(torch.tensor([1.0, NAN]), record=acc)
        assert torch.isnan(acc)

    def test_no_record_writes_nothing(self):
        """record=None leaves every tensor but the result alone."""
        x, scale = torch.tensor([3.0]), torch.tensor(2.0)
        cast(x, scale=scale, jit=True)
        assert x.tolist() == [3.0] and scale.item() == 2.0


class TestTransposed:
    @pytest.mark.parametrize("spec", [E4M3, E5M2], ids=["e4m3", "e5m2"])
    def test_same_pass_copy(self, spec):
        """transpose=True adds data.t() laid out contiguously, bitwise; t() then uses it."""
        x = torch.randn(5, 7) * 100
        q = cast(x, spec=spec, jit=True, transpose=True)
        assert q.transposed is not None and q.transposed.is_contiguous() and q.transposed.shape == (7, 5)
        assert torch.equal(q.transposed.view(torch.uint8), q.data.t().contiguous().view(torch.uint8))
        assert q.t().data is q.transposed

    def test_not_made_unless_asked(self):
        """Without transpose=True there is no copy."""
        assert cast(torch.randn(3, 4)).transposed is None


class TestProducts:
    def test_scaled_mm_is_the_product_of_dequantized_operands(self):
        """(a * sa) @ (b * sb) + bias in float32, bitwise."""
        a, b = cast(torch.randn(8, 16), jit=True), cast(torch.randn(4, 16), jit=True)
        bias = torch.randn(4)
        got = EmulationBackend().scaled_mm(a, b.t(), out_dtype=torch.float32, bias=bias)
        assert torch.equal(got, a.dequantize() @ b.dequantize().t() + bias)

    @pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
    def test_dequantize_table_matches_torch_cast_bitwise(self, dtype):
        """The CPU table path (large E4M3 operands) gives torch's own cast, plain and transposed."""
        codes = torch.arange(256, dtype=torch.uint8).view(dtype).reshape(16, 16).repeat(8, 8)
        scale_inv = torch.tensor(0.37)
        for data in (codes, codes.t()):
            got = EmulationBackend().dequantize(Quantized(data, scale_inv=scale_inv))
            want = data.float() * scale_inv
            assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0))
            assert torch.equal(torch.isnan(got), torch.isnan(want))


class TestUpdate:
    def test_in_place_and_clears(self):
        """update() applies update_scales into the given buffers and zeroes the accumulators."""
        history = torch.tensor([[0.0, 4.0], [1.0, 2.0]])
        scales, step_amax, fp8_max = torch.tensor([112.0, 224.0]), torch.tensor([2.0, NAN]), torch.tensor([448.0] * 2)
        want_h, want_s = update_scales(history, scales, step_amax, fp8_max, ScaleRule())
        ptrs = [t.data_ptr() for t in (history, scales, step_amax)]
        EmulationBackend().update(StepUpdate(history, scales, step_amax, fp8_max, ScaleRule()))
        assert torch.equal(history, want_h) and torch.equal(scales, want_s)
        assert step_amax.tolist() == [0.0, 0.0]
        assert [t.data_ptr() for t in (history, scales, step_amax)] == ptrs


class TestKeptDequantization:
    """keep_dequantized: an operand several products take is dequantized once while its data lives."""

    @pytest.mark.parametrize("spec", [E4M3, E5M2], ids=["e4m3", "e5m2"])
    def test_kept_values_are_the_computed_ones_and_cost_no_operation(self, spec):
        q = cast(torch.randn(64, 128) * 30, spec=spec, jit=True)  # 8192 elements: E4M3 takes the table path
        backend = EmulationBackend()
        plain, plain_t = backend.dequantize(q), backend.dequantize(q.t())
        backend.keep_dequantized(q)
        qt = q.t()
        with OpLog() as log:
            kept, kept_t = backend.dequantize(q), backend.dequantize(qt)
        assert log.ops == ["aten.t.default"], f"a kept operand was dequantized again: {log.ops}"  # the view only
        for got, want in ((kept, plain), (kept_t, plain_t)):
            assert torch.equal(got, want) and got.stride() == want.stride()

    def test_kept_copy_dies_with_the_data(self):
        backend = EmulationBackend()
        q = cast(torch.randn(64, 128), jit=True)
        backend.keep_dequantized(q)
        kept = weakref.ref(backend.dequantize(q))
        assert kept() is not None
        del q
        gc.collect()
        assert kept() is None, "the kept copy outlived the FP8 data it was made from"

    def test_other_scales_and_views_are_computed(self):
        """The same data with another scale_inv, or a slice of it, is dequantized afresh, correctly."""
        backend = EmulationBackend()
        q = cast(torch.randn(64, 128), jit=True)
        backend.keep_dequantized(q)
        other = Quantized(q.data, scale_inv=torch.tensor(0.5))
        assert torch.equal(backend.dequantize(other), q.data.float() * 0.5)
        part = Quantized(q.data[8:40], scale_inv=q.scale_inv)
        assert torch.equal(backend.dequantize(part), q.data[8:40].float() * q.scale_inv)

    def test_backends_that_multiply_otherwise_keep_nothing(self):
        backend = ScaledMMBackend(fallback="emulation")
        q = cast(torch.randn(64, 128), jit=True)
        backend.keep_dequantized(q)
        with OpLog() as log:
            backend.dequantize(q)
        assert len(log) > 0

    def test_a_linear_dequantizes_its_cached_weight_once_per_step_bitwise(self):
        """Later microbatches gather only the input's codes: once, in the forward, whose copy the backward
        takes (keep_saved); twice without saved copies; and training gives the bits of a backend that keeps
        nothing."""

        class KeepsNothing(EmulationBackend):
            def keep_dequantized(self, q: Quantized, *, brief: bool = False) -> None:
                pass

            def keep_saved(self, q: Quantized) -> None:
                pass

        def run(backend):
            torch.manual_seed(0)
            manager = ss.ScalingStateManager(ss.DelayedScaling(history_len=4), backend=backend)
            layer = ss.nn.Linear(128, 128, manager=manager, name="fc")
            gathers, out = [], []
            for _ in range(2):
                for _ in range(3):
                    x = torch.randn(64, 128, requires_grad=True)
                    with OpLog() as log:
                        with manager.forward():
                            y = layer(x)
                        with manager.backward():
                            y.square().sum().backward()
                    gathers.append(log.count("aten.index_select.default"))
                    out += [y.detach(), x.grad]
                manager.step()
            out += [layer.weight.grad, layer.bias.grad, *manager.buffers().values()]
            return gathers, out

        gathers, kept = run(EmulationBackend())
        gathers_unsaved, unsaved = run(EmulationBackend(saved_copy_bytes=0))
        gathers_plain, plain = run(KeepsNothing())
        assert gathers[1:3] == [1, 1], gathers  # the input's codes, in the forward only
        assert gathers_unsaved[1:3] == [2, 2], gathers_unsaved  # forward and backward
        assert gathers_plain[1:3] == [4, 4], gathers_plain
        assert_same(kept, plain)
        assert_same(unsaved, plain)


class TestSavedCopies:
    """keep_saved: a layer's input is dequantized once, in its forward, for its weight gradient too,
    within saved_copy_bytes."""

    @staticmethod
    def _model(backend, n=3, width=128):
        torch.manual_seed(0)
        manager = ss.ScalingStateManager(ss.DelayedScaling(history_len=4), backend=backend)
        layers = torch.nn.Sequential(*(ss.nn.Linear(width, width, manager=manager, name=f"l{i}") for i in range(n)))
        return manager, layers

    def test_the_newest_inputs_are_kept_within_the_limit_until_their_backward(self):
        copy = 64 * 128 * 4  # one input's float32 copy
        backend = EmulationBackend(saved_copy_bytes=2 * copy)
        manager, model = self._model(backend)
        weights = 3 * 128 * 128 * 4  # each cached weight cast's copy (keep_dequantized)
        log, gathers = OpLog(), []  # after each layer's backward (the last layer's first): the gathers so far
        for layer in model:
            layer.register_full_backward_hook(lambda *_: gathers.append(log.count("aten.index_select.default")))
        x = torch.randn(64, 128, requires_grad=True)
        with manager.forward():
            y = model(x)
        assert backend.kept_bytes() == weights + 2 * copy  # the first layer's copy was dropped for the third's
        with log, manager.backward():
            y.sum().backward()
        # Only the first layer's input (dropped) is dequantized again; the gradients' casts are E5M2 (no table).
        assert gathers == [0, 0, 1], gathers
        del y
        assert backend.kept_bytes() == weights  # the saved copies went with their inputs' FP8 data

    def test_no_copy_without_a_weight_gradient_or_beyond_the_limit(self):
        backend = EmulationBackend(saved_copy_bytes=64 * 128 * 4 - 1)  # one byte short of an input's copy
        manager, model = self._model(backend, n=1)
        x = torch.randn(64, 128, requires_grad=True)
        with manager.forward():
            y = model(x)
        assert backend.kept_bytes() == 128 * 128 * 4  # the weight's copy only
        backend.saved_copy_bytes = 1 << 20
        model[0].weight.requires_grad_(False)  # the backward then takes only the weight
        with manager.forward():
            y = model(x)
        assert backend.kept_bytes() == 128 * 128 * 4
        y.sum().backward()

    def test_training_gives_the_bits_of_no_saved_copies_with_checkpointing_and_microbatches(self):
        def run(backend):
            manager, model = self._model(backend)
            out = []
            for step in range(3):
                for _ in range(2):
                    x = torch.randn(64, 128, requires_grad=True)
                    with manager.forward():
                        y = torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False) if step else model(x)
                    with manager.backward():
                        y.square().sum().backward()
                    out += [y.detach(), x.grad]
                manager.step()
            return out + [p.grad for p in model.parameters()] + list(manager.buffers().values())

        assert_same(run(EmulationBackend()), run(EmulationBackend(saved_copy_bytes=0)))

    @pytest.mark.parametrize(
        ("value", "error"), [(-1, ss.errors.ArgumentValueError), ("64", ss.errors.ArgumentTypeError),
                             (True, ss.errors.ArgumentTypeError), (1.5, ss.errors.ArgumentTypeError)],
    )
    def test_bad_limits_are_refused(self, value, error):
        with pytest.raises(error, match="saved_copy_bytes"):
            EmulationBackend(saved_copy_bytes=value)

    def test_repr_names_a_limit_other_than_the_default(self):
        assert repr(EmulationBackend()) == "EmulationBackend()"
        assert repr(EmulationBackend(saved_copy_bytes=0)) == "EmulationBackend(saved_copy_bytes=0)"
