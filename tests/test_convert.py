"""What the converters keep (every child, parameter and buffer, wherever the layer sits) and their name prefix.

Both converters are tested alike: ``ss.nn.convert`` and the torchao adapter's
``convert_to_float8_training``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torchao.float8 import Float8LinearConfig
from transformers.pytorch_utils import Conv1D as HFConv1D

import scalestate as ss
from scalestate.errors import ConversionError, ConversionTypeError, SlotError
from scalestate.integrations.torchao import ManagedFloat8Linear, convert_to_float8_training
from scalestate.integrations.transformers import Conv1D

Convert = Callable[..., nn.Module]


def _nn_convert(model: nn.Module, manager: ss.ScalingStateManager, *,
                filter_fn: Callable[[str, nn.Module], bool] | None = None, **prefix: Any) -> nn.Module:
    return ss.nn.convert(model, manager, filter_fn, **prefix)


def _torchao_convert(model: nn.Module, manager: ss.ScalingStateManager, *,
                     filter_fn: Callable[[str, nn.Module], bool] | None = None, **prefix: Any) -> nn.Module:
    module_filter_fn = None if filter_fn is None else (lambda module, fqn: filter_fn(fqn, module))
    return convert_to_float8_training(model, manager, config=Float8LinearConfig(emulate=True),
                                      module_filter_fn=module_filter_fn, **prefix)


#: (converter, the FP8 layer type it makes from a torch.nn.Linear)
CONVERTERS = {"ss.nn.convert": (_nn_convert, ss.nn.Linear), "torchao": (_torchao_convert, ManagedFloat8Linear)}


@pytest.fixture(params=sorted(CONVERTERS))
def converter(request: pytest.FixtureRequest) -> tuple[Convert, type[nn.Module]]:
    return CONVERTERS[request.param]


@pytest.fixture
def manager() -> ss.ScalingStateManager:
    return ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation")


def linear_with_children() -> nn.Linear:
    """A Linear holding a child Sequential with a Linear in it, an extra parameter and two buffers."""
    torch.manual_seed(0)
    layer = nn.Linear(3, 3)
    layer.child = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    layer.gain = nn.Parameter(torch.ones(3))
    layer.register_buffer("mask", torch.ones(3))
    layer.register_buffer("scratch", torch.zeros(3), persistent=False)
    return layer


def inventory(model: nn.Module) -> tuple[list[str], list[int], list[int], list[str]]:
    """What a model holds: state_dict keys, the ids of its parameters and buffers (duplicates
    removed, as an optimizer sees them), and every parameter name (duplicates included)."""
    params = [id(p) for p in model.parameters()]
    buffers = [id(b) for b in model.buffers()]
    names = [name for name, _ in model.named_parameters(remove_duplicate=False)]
    return list(model.state_dict()), params, buffers, names


def assert_kept(before: tuple[Any, ...], model: nn.Module) -> None:
    keys, params, buffers, names = inventory(model)
    assert keys == before[0]
    assert sorted(params) == sorted(before[1]) and sorted(buffers) == sorted(before[2])
    assert names == before[3]


class TestNothingDropped:
    """A converted layer keeps its children, parameters and buffers, and its child Linear layers convert too."""

    def test_root(self, converter, manager):
        """The model itself a Linear with children: the FP8 root holds them, its child Linear is converted."""
        convert, fp8 = converter
        model = linear_with_children()
        before = inventory(model)
        child = model.child
        out = convert(model, manager)
        assert type(out) is fp8 and out.weight is model.weight
        assert out.child is child and type(out.child[0]) is fp8
        assert_kept(before, out)
        assert len(list(out.modules())) == 4 and len(list(out.parameters())) == 5
        assert "scratch" not in out.state_dict() and torch.equal(out.get_buffer("scratch"), torch.zeros(3))
        assert list(manager.handles) == ["linear", "child.0"]
        y = out(torch.randn(2, 3))
        out.child(y).sum().backward()  # the kept child is live: a forward of its own, through its FP8 layer
        assert out.child[0].weight.grad is not None

    def test_nested(self, converter, manager):
        """Such a Linear inside a model: the same, under its path."""
        convert, fp8 = converter
        model = nn.Sequential(nn.Linear(3, 3), linear_with_children())
        before = inventory(model)
        assert convert(model, manager) is model
        assert type(model[1]) is fp8 and type(model[1].child[0]) is fp8
        assert_kept(before, model)
        assert list(manager.handles) == ["0", "1", "1.child.0"]

    def test_deep(self, converter, manager):
        """Linear layers inside Linear layers inside Linear layers, all converted, children kept."""
        convert, fp8 = converter
        outer = linear_with_children()
        outer.child[0].inner = linear_with_children()
        model = nn.Sequential(outer)
        before = inventory(model)
        convert(model, manager)
        assert type(model[0]) is type(model[0].child[0]) is type(model[0].child[0].inner) is fp8
        assert type(model[0].child[0].inner.child[0]) is fp8
        assert_kept(before, model)
        assert list(manager.handles) == ["0", "0.child.0", "0.child.0.inner", "0.child.0.inner.child.0"]

    def test_shared_layer(self, converter, manager):
        """A Linear with children reachable by two paths becomes one FP8 layer at both, its child converted once."""
        convert, fp8 = converter
        layer = linear_with_children()
        model = nn.Sequential(layer, nn.ReLU(), layer)
        before = inventory(model)
        convert(model, manager)
        assert model[0] is model[2] and type(model[0]) is fp8 and type(model[0].child[0]) is fp8
        assert_kept(before, model)
        assert list(manager.handles) == ["0", "0.child.0"]

    def test_shared_child(self, converter, manager):
        """A child of a converted Linear that the model also holds elsewhere: kept at both places, the
        Linear inside it converted once."""
        convert, fp8 = converter
        shared = nn.Sequential(nn.Linear(3, 3))
        layer = nn.Linear(3, 3)
        layer.child = shared
        model = nn.Sequential(layer, shared)
        before = inventory(model)
        convert(model, manager)
        assert model[0].child is model[1] is shared and type(shared[0]) is fp8
        assert_kept(before, model)
        assert list(manager.handles) == ["0", "0.child.0"]

    def test_tied_weights(self, converter, manager):
        """A child Linear whose weight is its parent's: still one weight, held by both FP8 layers."""
        convert, fp8 = converter
        model = linear_with_children()
        model.child[0].weight = model.weight
        before = inventory(model)
        out = convert(model, manager)
        assert type(out.child[0]) is fp8 and out.child[0].weight is out.weight is model.weight
        assert_kept(before, out)
        assert len(list(out.parameters())) == 4  # weight (once), bias, gain, the child's bias

    def test_root_filtered_out(self, converter, manager):
        """The root left out by the filter: it stays, and the Linear layers inside it are converted."""
        convert, fp8 = converter
        model = linear_with_children()
        before = inventory(model)
        out = convert(model, manager, filter_fn=lambda path, module: path != "")
        assert out is model and type(out) is nn.Linear and type(out.child[0]) is fp8
        assert_kept(before, out)
        assert list(manager.handles) == ["child.0"]

    def test_registered_conversion_keeps_children(self, manager):
        """transformers' Conv1D (a registered conversion) keeps its children and buffers as Linear does."""
        layer = HFConv1D(3, 3)
        layer.child = nn.Linear(3, 3)
        layer.register_buffer("mask", torch.ones(3))
        model = nn.Sequential(layer)
        before = inventory(model)
        ss.nn.convert(model, manager)
        assert type(model[0]) is Conv1D and type(model[0].child) is ss.nn.Linear
        assert_kept(before, model)


class TestClashRefused:
    """Something of the layer's that its FP8 version cannot hold is refused; the model is left as it was."""

    @pytest.mark.parametrize("name", ["handle", "config"])
    def test_child_named_like_an_attribute(self, converter, manager, name):
        """A child named like an attribute of the FP8 layer (``handle``; torchao's layer also has ``config``)."""
        convert, fp8 = converter
        fp8_names = {ss.nn.Linear: {"handle"}, ManagedFloat8Linear: {"handle", "config"}}
        layer = nn.Linear(3, 3)
        layer.add_module(name, nn.Sequential(nn.Linear(3, 3)))
        model = nn.Sequential(layer)
        before = inventory(model)
        if name not in fp8_names[fp8]:
            convert(model, manager)  # a name the FP8 layer does not use: kept
            assert type(model[0]) is fp8 and type(getattr(model[0], name)[0]) is fp8
            return
        with pytest.raises(ConversionError, match=rf"layer '0' \(Linear\): it holds a child module '{name}'"):
            convert(model, manager)
        assert type(model[0]) is nn.Linear and type(getattr(model[0], name)[0]) is nn.Linear
        assert_kept(before, model)

    def test_conversion_replacing_a_child(self, manager):
        """A registered conversion that puts another module where the layer had a child is refused."""

        class Holder(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.weight = nn.Parameter(torch.ones(2, 2))
                self.child = nn.ReLU()

        class FP8Holder(nn.Module):
            def __init__(self, weight: nn.Parameter, handle: ss.ScalingHandle) -> None:
                super().__init__()
                self.weight, self.handle, self.child = weight, handle, nn.Tanh()

        ss.nn.register_conversion(Holder, lambda m, r: FP8Holder(m.weight, r.manager.register(r.name)))
        try:
            model = nn.Sequential(Holder())
            with pytest.raises(ConversionError, match=r"a child module 'child' of its own \(Tanh\)"):
                ss.nn.convert(model, manager)
            assert type(model[0]) is Holder
        finally:
            ss.nn.unregister_conversion(Holder)

    def test_conversion_dropping_the_bias(self, manager):
        """A registered conversion that leaves out a parameter the layer has (``bias`` set to None) is refused."""

        class NoBias(nn.Linear):
            pass

        def drop_bias(module: nn.Module, request: ss.nn.ConversionRequest) -> nn.Module:
            assert isinstance(module, nn.Linear)
            new = ss.nn.Linear(3, 3, bias=False, manager=request.manager, name=request.name, device="meta")
            new.weight = module.weight
            return new

        ss.nn.register_conversion(NoBias, drop_bias)
        try:
            model = nn.Sequential(NoBias(3, 3))
            with pytest.raises(ConversionError, match=r"parameter 'bias' \(Parameter\).*'bias' set to None"):
                ss.nn.convert(model, manager)
            assert type(model[0]) is NoBias
        finally:
            ss.nn.unregister_conversion(NoBias)


def _two_layers() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))


class TestPrefix:
    """A name prefix lets separately converted models share one manager."""

    def test_two_models_one_manager(self, converter, manager):
        """A second model without a prefix is refused (the error names the fix); with one it registers its own slots."""
        convert, _ = converter
        first, second = convert(_two_layers(), manager), _two_layers()
        with pytest.raises(SlotError, match=r"\['0', '2'\] are already registered.*prefix='encoder'"):
            convert(second, manager)
        assert type(second[0]) is nn.Linear
        convert(second, manager, prefix="model.decoder")
        assert list(manager.handles) == ["0", "2", "model.decoder.0", "model.decoder.2"]
        assert second[2].handle is manager.handles["model.decoder.2"]
        x = torch.randn(3, 4)
        with manager.forward():
            loss = first(x).sum() + second(x).sum()
        with manager.backward():
            loss.backward()
        manager.step()
        history = manager.state_dict()["amax_history"]
        assert (history[:, -1] > 0).all()  # every slot of both models recorded its step

    def test_root_takes_the_prefix(self, converter, manager):
        """A converted root is named by the prefix itself (as named_modules(prefix=...) names it)."""
        convert, _ = converter
        out = convert(linear_with_children(), manager, prefix="head")
        assert list(manager.handles) == ["head", "head.child.0"] and out.handle.name == "head"

    def test_filter_sees_model_paths(self, converter, manager):
        """The filter gets paths in the model, without the prefix."""
        convert, fp8 = converter
        seen: list[str] = []
        model = convert(_two_layers(), manager, prefix="enc", filter_fn=lambda path, m: seen.append(path) or True)
        assert seen == ["0", "2"] and type(model[0]) is fp8

    @pytest.mark.parametrize("prefix", [".enc", "enc.", "a..b", "."])
    def test_not_a_path(self, converter, manager, prefix):
        """A prefix with an empty name is a ConversionError (a ValueError); nothing changes."""
        convert, _ = converter
        model = _two_layers()
        with pytest.raises(ConversionError, match="not a dotted module path") as info:
            convert(model, manager, prefix=prefix)
        assert isinstance(info.value, ValueError) and isinstance(info.value, ss.errors.ScaleStateError)
        assert type(model[0]) is nn.Linear and not manager.handles

    def test_not_a_string(self, converter, manager):
        """A prefix that is not a string is a ConversionTypeError (a TypeError)."""
        convert, _ = converter
        with pytest.raises(ConversionTypeError, match="prefix must be a string") as info:
            convert(_two_layers(), manager, prefix=3)
        assert isinstance(info.value, TypeError)
