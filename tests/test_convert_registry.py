"""ss.nn.register_conversion and the registry convert() reads; transformers' Conv1D converted."""

from __future__ import annotations

import pytest
import torch
from transformers.pytorch_utils import Conv1D as HFConv1D

import scalestate as ss
from scalestate.backends.emulation import EmulationBackend
from scalestate.integrations.transformers import Conv1D, convert_conv1d

R = ss.Role


@pytest.fixture(autouse=True)
def _restore_conversions():
    """Tests register conversions; put the process-wide table back afterwards, through the public API."""
    saved = ss.nn.registered_conversions()
    yield
    for module_type in list(ss.nn.registered_conversions()):
        ss.nn.unregister_conversion(module_type)
    for module_type, fn in saved.items():
        ss.nn.register_conversion(module_type, fn)


class Doubled(torch.nn.Module):
    """A module type of the user's: ``2 * (x @ weight.T)``."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * torch.nn.functional.linear(x, self.weight)


class FP8Doubled(torch.nn.Module):
    def __init__(self, weight: torch.nn.Parameter, handle: ss.ScalingHandle) -> None:
        super().__init__()
        self.weight = weight
        self.handle = handle

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * ss.nn.linear(x, self.weight, None, self.handle)


def to_fp8_doubled(module: torch.nn.Module, request: ss.nn.ConversionRequest) -> torch.nn.Module:
    assert isinstance(module, Doubled)
    return FP8Doubled(module.weight, request.manager.register(request.name, roles=tuple(R)))


class TestRegistry:
    def test_default_registry(self):
        """torch.nn.Linear is registered by default; with transformers imported, its Conv1D too."""
        table = ss.nn.registered_conversions()
        assert torch.nn.Linear in table
        assert table[HFConv1D] is convert_conv1d

    def test_listing_is_a_copy(self):
        """Editing the returned dict changes nothing."""
        ss.nn.registered_conversions().clear()
        assert torch.nn.Linear in ss.nn.registered_conversions()

    def test_user_type_converts(self, delayed):
        """A registered type is converted at its path, keeping its parameter, and computes in FP8."""
        ss.nn.register_conversion(Doubled, to_fp8_doubled)
        model = torch.nn.Sequential(Doubled(8), torch.nn.Linear(8, 8))
        weight = model[0].weight
        ss.nn.convert(model, delayed)
        assert type(model[0]) is FP8Doubled and model[0].weight is weight
        assert list(delayed.handles) == ["0", "1"]
        x = torch.randn(4, 8)
        ref = ss.ScalingStateManager(ss.DelayedScaling(history_len=4), backend="emulation")
        expected = 2 * ss.nn.linear(x, weight, None, ref.register("0", roles=tuple(R)))
        assert torch.equal(model[0](x), expected)

    def test_bare_module_of_registered_type(self, delayed):
        """Converting a registered module itself returns its FP8 version, named after its class."""
        ss.nn.register_conversion(Doubled, to_fp8_doubled)
        new = ss.nn.convert(Doubled(4), delayed)
        assert type(new) is FP8Doubled and list(delayed.handles) == ["doubled"]

    def test_exact_type_by_default(self, delayed):
        """A subclass of a registered type is left alone unless registered with subclasses=True."""

        class Sub(Doubled):
            pass

        ss.nn.register_conversion(Doubled, to_fp8_doubled)
        model = ss.nn.convert(torch.nn.Sequential(Sub(4)), delayed)
        assert type(model[0]) is Sub and not delayed.handles
        ss.nn.register_conversion(Doubled, to_fp8_doubled, replace=True, subclasses=True)
        model = ss.nn.convert(torch.nn.Sequential(Sub(4)), delayed)
        assert type(model[0]) is FP8Doubled

    def test_subclasses_never_reconvert(self, delayed):
        """torch.nn.Linear with subclasses=True converts a subclass, but never a converted layer."""

        class Custom(torch.nn.Linear):
            pass

        linear = ss.nn.registered_conversions()[torch.nn.Linear]
        ss.nn.register_conversion(torch.nn.Linear, linear, replace=True, subclasses=True)
        done = ss.nn.Linear(4, 4, manager=delayed, name="done")
        model = ss.nn.convert(torch.nn.Sequential(Custom(4, 4), done), delayed)
        assert type(model[0]) is ss.nn.Linear and model[1] is done
        assert list(delayed.handles) == ["done", "0"]

    def test_duplicate_registration_refused(self):
        """A second registration of a type is an error naming replace=True; the first one stays."""
        ss.nn.register_conversion(Doubled, to_fp8_doubled)
        with pytest.raises(ss.errors.ScaleStateError, match=r"Doubled is already registered.*replace=True"):
            ss.nn.register_conversion(Doubled, lambda module, request: module)
        assert ss.nn.registered_conversions()[Doubled] is to_fp8_doubled
        with pytest.raises(ss.errors.ScaleStateError, match="already registered"):
            ss.nn.register_conversion(torch.nn.Linear, to_fp8_doubled)

    def test_replace(self, delayed):
        """replace=True swaps the conversion, also torch.nn.Linear's default."""

        def keep(module, request):
            request.manager.register(request.name)
            return module

        ss.nn.register_conversion(torch.nn.Linear, keep, replace=True)
        model = ss.nn.convert(torch.nn.Sequential(torch.nn.Linear(2, 2)), delayed)
        assert type(model[0]) is torch.nn.Linear and list(delayed.handles) == ["0"]

    def test_unregister(self, delayed):
        """An unregistered type is no longer converted; unregistering it again is an error listing the table."""
        ss.nn.unregister_conversion(torch.nn.Linear)
        model = ss.nn.convert(torch.nn.Sequential(torch.nn.Linear(2, 2)), delayed)
        assert type(model[0]) is torch.nn.Linear and not delayed.handles
        message = r"no conversion of torch\.nn\..*Linear is registered \(registered: .*Conv1D"
        with pytest.raises(ss.errors.ScaleStateError, match=message):
            ss.nn.unregister_conversion(torch.nn.Linear)

    @pytest.mark.parametrize(
        ("module_type", "fn", "kwargs", "message"),
        [
            (torch.nn.Linear(2, 2), to_fp8_doubled, {}, "the class, not an instance"),
            (int, to_fp8_doubled, {}, "must be a torch.nn.Module subclass"),
            (Doubled, "to_fp8", {}, "must be callable as fn\\(module, request\\)"),
            (Doubled, to_fp8_doubled, {"replace": 1}, "replace and subclasses must be True or False"),
            (Doubled, to_fp8_doubled, {"subclasses": "yes"}, "replace and subclasses must be True or False"),
        ],
        ids=["instance", "not-a-module", "fn-not-callable", "replace-not-bool", "subclasses-not-bool"],
    )
    def test_bad_arguments(self, module_type, fn, kwargs, message):
        """Bad arguments are TypeErrors saying what was expected; nothing is registered."""
        before = ss.nn.registered_conversions()
        with pytest.raises(TypeError, match=message):
            ss.nn.register_conversion(module_type, fn, **kwargs)
        assert ss.nn.registered_conversions() == before

    def test_conversion_must_return_a_module(self, delayed):
        """A conversion returning something else is a TypeError naming it; the model keeps its layers."""
        ss.nn.register_conversion(Doubled, lambda module, request: "oops")
        model = torch.nn.Sequential(Doubled(2))
        with pytest.raises(TypeError, match=r"returned str, not a torch.nn.Module"):
            ss.nn.convert(model, delayed)
        assert type(model[0]) is Doubled

    def test_convert_bad_arguments(self, delayed):
        """convert() names a wrong model, manager or filter_fn."""
        with pytest.raises(TypeError, match=r"model must be a torch\.nn\.Module; got str"):
            ss.nn.convert("model", delayed)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="manager must be a ScalingStateManager; got NoneType"):
            ss.nn.convert(torch.nn.Linear(2, 2), None)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="filter_fn must be None or callable"):
            ss.nn.convert(torch.nn.Linear(2, 2), delayed, filter_fn=True)  # type: ignore[arg-type]


def _conv1d_pair(manager_a, manager_b, nx=32, nf=16):
    """A converted transformers Conv1D, and an ss.nn.Linear holding a copy of its weight transposed."""
    torch.manual_seed(0)
    hf = HFConv1D(nf, nx)
    with torch.no_grad():
        hf.bias.normal_()
    conv = ss.nn.convert(hf, manager_a)
    lin = ss.nn.Linear(nx, nf, manager=manager_b, name="conv1d")
    with torch.no_grad():
        lin.weight.copy_(hf.weight.t())
        lin.bias.copy_(hf.bias)
    return hf, conv, lin


class TestConv1D:
    def test_keeps_parameters_and_state_dict(self, delayed):
        """The very parameter objects, the same state_dict keys, shapes and values, still a Conv1D."""
        torch.manual_seed(0)
        block = torch.nn.Sequential(HFConv1D(16, 8), torch.nn.ReLU(), HFConv1D(8, 16))
        params = list(block.parameters())
        before = {key: value.clone() for key, value in block.state_dict().items()}
        ss.nn.convert(block, delayed)
        assert type(block[0]) is Conv1D and isinstance(block[0], HFConv1D)
        assert all(a is b for a, b in zip(params, block.parameters(), strict=True))
        after = block.state_dict()
        assert list(after) == list(before) == ["0.weight", "0.bias", "2.weight", "2.bias"]
        assert all(torch.equal(after[key], before[key]) for key in before)
        assert block[0].weight.shape == (8, 16) and list(delayed.handles) == ["0", "2"]
        assert repr(block[0]) == "Conv1D(nf=16, nx=8, slot='0')"

    def test_bitwise_equal_to_linear(self, recipe, backend):
        """Outputs, gradients and scaling state are those of ss.nn.Linear on the transposed weight, bit for bit,
        over steps with microbatches and optimizer updates, on every recipe and CPU backend."""
        a = ss.ScalingStateManager(recipe, backend=backend)
        b = ss.ScalingStateManager(recipe, backend=backend)
        _, conv, lin = _conv1d_pair(a, b)
        opt_a = torch.optim.SGD(conv.parameters(), lr=0.5)
        opt_b = torch.optim.SGD(lin.parameters(), lr=0.5)
        for step in range(3):
            for micro in range(2):
                x = torch.randn(3, 5, 32) * (step + 1 + micro)
                xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
                ya, yb = conv(xa), lin(xb)
                assert torch.equal(ya, yb)
                g = torch.randn_like(ya)
                ya.backward(g)
                yb.backward(g)
                assert torch.equal(xa.grad, xb.grad)
            assert conv.weight.grad.shape == conv.weight.shape
            assert torch.equal(conv.weight.grad.t(), lin.weight.grad)
            assert torch.equal(conv.bias.grad, lin.bias.grad)
            for opt in (opt_a, opt_b):
                opt.step()
                opt.zero_grad()
            a.step()
            b.step()
            for role in R:
                assert torch.equal(conv.handle.amax_history(role), lin.handle.amax_history(role))
                assert torch.equal(conv.handle.scale(role), lin.handle.scale(role))
        assert torch.equal(conv.weight.t(), lin.weight)

    def test_weight_cast_cached(self):
        """The weight is cast once per scale epoch: every microbatch and evaluation pass hits the cache."""
        shapes: list[tuple[int, ...]] = []

        class Counting(EmulationBackend):
            def cast(self, request):
                shapes.append(tuple(request.x.shape))
                return super().cast(request)

        manager = ss.ScalingStateManager(ss.DelayedScaling(history_len=4), backend=Counting())
        conv = ss.nn.convert(HFConv1D(16, 32), manager)
        opt = torch.optim.SGD(conv.parameters(), lr=0.1)
        for step in range(2):
            for _ in range(3):
                conv(torch.randn(4, 32)).sum().backward()
            with torch.no_grad():
                conv(torch.randn(4, 32))
            assert shapes.count((32, 16)) == step + 1  # one weight cast per step, of the parameter itself
            opt.step()
            manager.step()
        assert shapes.count((4, 32)) == 8 and shapes.count((4, 16)) == 6  # inputs and gradients: every time

    def test_fp8_all_gather_outside_fsdp(self, delayed):
        """fp8_all_gather=True: outside FSDP the same bits, and a plain-tensor state_dict."""
        other = ss.ScalingStateManager(ss.DelayedScaling(history_len=4), backend="emulation")
        torch.manual_seed(0)
        hf = HFConv1D(8, 16)
        plain = ss.nn.convert(HFConv1D(8, 16), delayed)
        with torch.no_grad():
            plain.weight.copy_(hf.weight)
        gathered = ss.nn.convert(hf, other, fp8_all_gather=True)
        assert gathered.fp8_all_gather and "fp8_all_gather=True" in repr(gathered)
        x = torch.randn(4, 16)
        for m, layer in ((delayed, plain), (other, gathered)):
            layer(x).sum().backward()
            m.step()
        assert torch.equal(plain(x), gathered(x)) and torch.equal(plain.weight.grad, gathered.weight.grad)
        assert type(gathered.state_dict()["weight"]) is torch.Tensor

    def test_tied_weights_refused_with_fp8_all_gather(self, delayed):
        """A weight shared by a Conv1D and a Linear cannot be all-gathered in FP8 twice; nothing converts."""
        conv = HFConv1D(4, 4)
        lin = torch.nn.Linear(4, 4)
        lin.weight = conv.weight
        model = torch.nn.Sequential(conv, lin)
        with pytest.raises(ss.errors.SlotError, match=r"layers \['0', '1'\] share one weight"):
            ss.nn.convert(model, delayed, fp8_all_gather=True)
        assert type(model[0]) is HFConv1D and not delayed.handles

    def test_shape_errors(self, delayed):
        """A wrong input width names the width the (in, out) weight expects."""
        conv = ss.nn.convert(HFConv1D(4, 8), delayed)
        with pytest.raises(ss.errors.CastError, match=r"input has 4 features .* expects 8"):
            conv(torch.randn(2, 4))

    def test_meta(self, delayed):
        """Built on meta, a forward infers shapes only."""
        conv = Conv1D(6, 4, manager=delayed, device="meta")
        assert conv(torch.empty(2, 3, 4, device="meta")).shape == (2, 3, 6)
        assert conv.handle.name == "conv1d"


@pytest.mark.parametrize(
    "obj",
    [ss.nn.register_conversion, ss.nn.registered_conversions, ss.nn.convert, Conv1D],
    ids=lambda o: o.__name__,
)
def test_doctest(obj):
    """The runnable example in each docstring runs and prints what it says."""
    import doctest

    tests = doctest.DocTestFinder(recurse=False).find(obj, globs={})
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert tests and any(t.examples for t in tests)
    for t in tests:
        runner.run(t)
    assert runner.failures == 0
