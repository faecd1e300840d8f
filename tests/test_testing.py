"""scalestate.testing: the helpers the test suite and integrators share, checked on known answers."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

import scalestate as ss
from helpers import assert_bitwise, train
from scalestate.backends.emulation import EmulationBackend
from scalestate.errors import UnknownBackendError
from scalestate.testing import (
    CastSpy,
    OpLog,
    assert_same,
    differences,
    registered_backend,
    snapshot,
    sqnr,
)

I, W = ss.Role.INPUT, ss.Role.WEIGHT


class TestDifferences:
    def test_equal_nested_values(self):
        """Nested mappings, lists and tuples of tensors and plain values that are equal: no difference."""
        value = {"a": [torch.arange(4.0), (1, "x")], "b": {"c": torch.zeros(2, dtype=torch.int64)}, "d": None}
        copy = {"a": [torch.arange(4.0), (1, "x")], "b": {"c": torch.zeros(2, dtype=torch.int64)}, "d": None}
        assert differences(value, copy) == []
        assert_same(value, copy)

    def test_tensor_values_name_the_first_element(self):
        """Differing elements are counted, and the first is named by index with both values."""
        a, b = torch.zeros(2, 3), torch.zeros(2, 3)
        b[1, 2], b[0, 1] = 5.0, -1.0
        assert differences(a, b, name="t") == ["t: 2 of 6 elements differ, the first at index (0, 1): 0.0 != -1.0"]

    @pytest.mark.parametrize(
        ("b", "what"),
        [
            (torch.zeros(2, 3, dtype=torch.float64), "dtype torch.float32 != torch.float64"),
            (torch.zeros(3, 2), "shape (2, 3) != (3, 2)"),
            (torch.zeros(2, 3, device="meta"), "device cpu != meta"),
        ],
        ids=["dtype", "shape", "device"],
    )
    def test_tensor_metadata(self, b, what):
        """dtype, shape and device must be the same before any value is compared."""
        assert differences(torch.zeros(2, 3), b, name="t") == [f"t: {what}"]

    def test_torch_equal_or_bits(self):
        """By default torch.equal's rule (-0.0 equals 0.0, NaN equals nothing); with bits=True, bytes."""
        nan = torch.tensor([float("nan")])
        assert differences(torch.tensor([0.0]), torch.tensor([-0.0])) == []
        assert len(differences(torch.tensor([0.0]), torch.tensor([-0.0]), bits=True)) == 1
        assert len(differences(nan, nan.clone())) == 1
        assert differences(nan, nan.clone(), bits=True) == []
        assert differences(float("nan"), float("nan"), bits=True) == []
        assert differences(0.0, -0.0, bits=True) == ["value: 0.0 != -0.0"]

    def test_fp8_and_zero_dim_tensors(self):
        """FP8 tensors (which torch.equal cannot take on CPU) and 0-d tensors compare in both modes."""
        a = torch.tensor([1.0, 2.0, 448.0]).to(torch.float8_e4m3fn)
        b = torch.tensor([1.0, 2.5, 448.0]).to(torch.float8_e4m3fn)
        for bits in (False, True):
            assert differences(a, a.clone(), bits=bits) == []
            assert differences(a, b, bits=bits) == [
                "value: 1 of 3 elements differ, the first at index (1,): 2.0 != 2.5"
            ]
            assert differences(torch.tensor(1.0), torch.tensor(2.0), bits=bits) == [
                "value: 1 of 1 elements differ, the first at index (): 1.0 != 2.0"
            ]

    def test_lengths_keys_and_types(self):
        """Unequal lengths, missing keys, reordered keys and other types are each reported by path."""
        assert differences([1, 2], [1, 2, 3], name="s") == ["s: length 2 != 3"]
        assert differences([1, 2, 3], [1, 2], name="s") == ["s: length 3 != 2"]
        assert differences({"a": 1, "b": 2}, {"a": 1, "c": 2}) == [
            "value: keys only in the first ['b'], only in the second ['c']"
        ]
        assert differences({"a": 1, "b": 2}, {"b": 2, "a": 1}) == [
            "value: the same keys in another order (['a', 'b'] != ['b', 'a'])"
        ]
        assert differences([1], (1,)) == ["value: list != tuple"]
        assert differences(1, 1.0) == ["value: int 1 != float 1.0"]
        assert differences(torch.ones(1), 1.0) == ["value: Tensor != float"]
        assert differences({"x": [torch.ones(2)]}, {"x": [torch.zeros(2)]}, name="sd") == [
            "sd['x'][0]: 2 of 2 elements differ, the first at index (0,): 1.0 != 0.0"
        ]

    def test_assert_same_lists_what_differs(self):
        """assert_same raises AssertionError with the count and the first ten differences."""
        with pytest.raises(AssertionError) as info:
            assert_same(list(range(12)), [-1] * 12, name="xs")
        message = str(info.value)
        assert message.startswith("12 differences:\n  xs[0]: 0 != -1")
        assert "xs[9]" in message and "xs[10]" not in message and "... and 2 more" in message


@pytest.fixture(scope="module")
def record():
    """A short training record of the parity harness (tests/helpers.py)."""
    return train(ss.DelayedScaling(history_len=4), "emulation", kind="linear", steps=3)


class TestAssertBitwise:
    """The parity suite's comparison of two training records (tests/helpers.py)."""

    def test_same_run_passes(self, record):
        """A record equals itself."""
        assert_bitwise(record, record)

    @pytest.mark.parametrize("series", ["outputs", "input_grads", "weight_grads", "params", "histories", "scales"])
    def test_a_shorter_series_differs(self, record, series):
        """A run that recorded one step less of any series is not the same run."""
        import attrs

        shorter = attrs.evolve(record, **{series: getattr(record, series)[:-1]})
        with pytest.raises(AssertionError, match="length"):
            assert_bitwise(record, shorter)
        with pytest.raises(AssertionError, match="length"):
            assert_bitwise(shorter, record)

    def test_a_changed_scale_differs(self, record):
        """One changed scale of one step is found, and named."""
        import attrs

        scales = [s.clone() for s in record.scales]
        scales[1][0] *= 2
        with pytest.raises(AssertionError, match=r"run\['scale'\]\[1\]: 1 of"):
            assert_bitwise(record, attrs.evolve(record, scales=scales))


class TestSnapshot:
    def _run(self, wrap):
        torch.manual_seed(0)
        m = ss.ScalingStateManager(ss.DelayedScaling(history_len=4), backend="emulation")
        model = torch.nn.Sequential(ss.nn.Linear(8, 8, manager=m, name="a"), ss.nn.Linear(8, 8, manager=m, name="b"))
        run = wrap(model)
        steps = []
        for step in range(3):
            x = torch.randn(4, 8, requires_grad=True) * (step + 1)
            with m.forward():
                y = run(x)
            with m.backward():
                y.square().mean().backward()
            m.step()
            steps.append(snapshot(run, m))
        return steps

    def test_checkpointed_runs_compare_layer_by_layer(self):
        """checkpoint_wrapper's name prefix is dropped: a wrapped run compares with a plain one, bitwise."""
        plain = self._run(lambda model: model)
        wrapped = self._run(lambda model: torch.nn.Sequential(*(checkpoint_wrapper(layer) for layer in model)))
        assert list(wrapped[0]["parameters"]) == ["0.weight", "0.bias", "1.weight", "1.bias"]
        assert_same(plain, wrapped, name="steps")

    def test_copies(self):
        """A snapshot holds copies: what happens to the model afterwards does not change it."""
        m = ss.ScalingStateManager(ss.DelayedScaling(history_len=4), backend="emulation")
        layer = ss.nn.Linear(4, 4, manager=m, name="fc")
        layer(torch.randn(2, 4)).sum().backward()
        m.step()
        snap = snapshot(layer, m)
        again = snapshot(layer, m)
        with torch.no_grad():
            layer.weight.add_(1.0)
        layer.weight.grad.zero_()
        assert_same(snap, again)
        assert differences(snap, snapshot(layer, m)) == [
            "value['parameters']['weight']: 16 of 16 elements differ, the first at index (0, 0): "
            f"{snap['parameters']['weight'][0, 0].item()!r} != {layer.weight[0, 0].item()!r}",
            "value['gradients']['weight']: 16 of 16 elements differ, the first at index (0, 0): "
            f"{snap['gradients']['weight'][0, 0].item()!r} != 0.0",
        ]

    def test_compiled_names(self):
        """torch.compile's wrapper adds no name either."""
        layer = torch.nn.Linear(2, 2)
        assert list(snapshot(torch.compile(layer))["parameters"]) == ["weight", "bias"]

    def test_without_a_manager(self):
        """Without a manager, parameters and gradients only; a parameter without a gradient is None."""
        layer = torch.nn.Linear(2, 2)
        snap = snapshot(layer)
        assert set(snap) == {"parameters", "gradients"} and snap["gradients"] == {"weight": None, "bias": None}


class TestSqnr:
    def test_hand_computed(self):
        """10 log10(signal / noise): a signal of energy 4 with noise of energy 0.04 is 20 dB."""
        ref = torch.tensor([1.0, -1.0, 1.0, -1.0])
        assert sqnr(ref, ref + torch.tensor([0.1, -0.1, 0.1, -0.1])) == pytest.approx(20.0)
        assert sqnr(ref, ref * 0.9) == pytest.approx(20.0)

    def test_edges(self):
        """Exact: inf; a zero reference with noise: -inf; low-precision inputs computed in float64."""
        x = torch.randn(64)
        assert sqnr(x, x.clone()) == math.inf
        assert sqnr(torch.zeros(3), torch.ones(3)) == -math.inf
        half = x.half()
        want = 10 * math.log10(float((half.double() ** 2).sum() / ((half.double() - x.double()) ** 2).sum()))
        assert sqnr(half, x) == pytest.approx(want, rel=1e-12)

    def test_shapes_must_match(self):
        """Tensors that would broadcast are refused instead of compared element by element."""
        with pytest.raises(ValueError, match="one shape"):
            sqnr(torch.ones(4, 1), torch.ones(4))


class TestOpLog:
    def test_names_and_counts(self):
        """Every dispatched op by its overload's name, in order; count() takes a name or the overload."""
        with OpLog() as log:
            torch.ones(2, 2).add(1).mm(torch.eye(2))
        assert log.ops == ["aten.ones.default", "aten.add.Tensor", "aten.eye.default", "aten.mm.default"]
        assert log.count("aten.mm.default") == log.count(torch.ops.aten.mm.default) == 1 and len(log) == 4

    def test_when(self):
        """With when=, only the ops dispatched while it is true."""
        on = [False]
        with OpLog(when=lambda: on[0]) as log:
            torch.ones(1)
            on[0] = True
            torch.zeros(1)
        assert log.ops == ["aten.zeros.default"]


class TestCastSpy:
    def test_requests_results_and_restore(self, delayed):
        """Each request and its result, in order; on exit the backend's own method is back."""
        h = delayed.register("fc", roles=(I, W))
        x, w = torch.randn(4, 8), torch.randn(8, 8)
        backend = delayed.backend
        with CastSpy(delayed) as spy, delayed.forward():
            qx = h.quantize(x, I)
            qw = h.quantize(w, W)
            assert h.quantize(w, W) is qw  # a cache hit: no request
        assert spy.results == [qx, qw] and [r.x.data_ptr() for r in spy.requests] == [x.data_ptr(), w.data_ptr()]
        assert spy.casts_of(w) == 1 and spy.casts_of(x) == 1
        assert "cast" not in vars(backend)
        with delayed.forward():
            h.quantize(x, I)
        assert len(spy.requests) == 2  # no longer watching

    def test_backend_instance_and_callback(self):
        """A spy on a backend instance sees the casts of every manager given it; on_cast without keeping."""
        backend = EmulationBackend()
        seen = []
        with CastSpy(backend, on_cast=lambda r, q: seen.append(q.data.dtype), keep=False) as spy:
            for _ in range(2):
                m = ss.ScalingStateManager(ss.DelayedScaling(), backend=backend)
                m.register("fc", roles=(I,)).quantize(torch.ones(2), I)
        assert seen == [torch.float8_e4m3fn] * 2 and spy.requests == [] and spy.results == []

    def test_restores_an_instance_patch_and_nests(self, delayed):
        """Nested spies each see the casts; leaving both restores what the instance had, even its own patch."""
        own = delayed.backend.cast
        delayed.backend.cast = own  # an instance attribute, as another tool may have set
        h = delayed.register("fc", roles=(I,))
        with CastSpy(delayed) as outer:
            with CastSpy(delayed) as inner:
                h.quantize(torch.ones(2), I)
            h.quantize(torch.ones(2), I)
        assert len(inner.requests) == 1 and len(outer.requests) == 2
        assert vars(delayed.backend)["cast"] is own

    def test_exception_inside_restores(self, delayed):
        """An error in the block still restores the backend."""
        with pytest.raises(KeyError), CastSpy(delayed):
            raise KeyError("x")
        assert "cast" not in vars(delayed.backend)

    def test_casting_flag(self, delayed):
        """casting is true exactly while the backend's cast runs."""
        h = delayed.register("fc", roles=(I,))
        during = []
        spy = CastSpy(delayed, on_cast=lambda r, q: during.append(spy.casting))
        with spy, OpLog(when=lambda: spy.casting) as inside:
            assert not spy.casting
            h.quantize(torch.ones(2), I)
        assert during == [False] and inside.ops  # the cast's ops were seen inside, the callback after


class TestRegisteredBackend:
    def test_registered_for_the_block(self):
        """The name works inside the block and is gone after it, also when the block raises."""
        with registered_backend("for_a_test", EmulationBackend) as name:
            assert ss.backends.get_backend(name).name == "emulation"
        with pytest.raises(UnknownBackendError):
            ss.backends.get_backend("for_a_test")
        with pytest.raises(RuntimeError, match="boom"), registered_backend("for_a_test", EmulationBackend):
            raise RuntimeError("boom")
        assert "for_a_test" not in ss.backends.available_backends()

    def test_replaced_builtin_is_restored(self):
        """replace=True over a built-in name: the built-in is back after the block."""
        from scalestate.backends.scaled_mm import ScaledMMBackend

        with registered_backend("emulation", ScaledMMBackend, replace=True):
            assert isinstance(ss.backends.get_backend("emulation"), ScaledMMBackend)
        assert type(ss.backends.get_backend("emulation")) is EmulationBackend
