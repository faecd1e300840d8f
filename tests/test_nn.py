"""scalestate.nn: the FP8 Linear and convert()."""

from __future__ import annotations

import pytest
import torch

import scalestate as ss
from helpers import backend_for
from scalestate.testing import sqnr

I, W, G = ss.Role.INPUT, ss.Role.WEIGHT, ss.Role.GRAD_OUTPUT

# Thresholds (signal-to-quantization-noise ratio vs fp32, random normal data):
# E4M3 has 3 mantissa bits (~29 dB measured on a 256->128 layer), E5M2 2 bits,
# and the gradients multiply an E5M2 operand by an E4M3 one (~24.5 dB measured).
OUTPUT_SQNR_DB = 25.0
GRAD_SQNR_DB = 20.0
#: NVFP4's 4-bit values (measured here: 16.7 dB output, 15.0 dB input and 15.5 dB weight gradients), with a margin.
NVFP4_OUTPUT_SQNR_DB = 15.5
NVFP4_GRAD_SQNR_DB = 13.5


def _pair(manager, dtype=torch.float32, bias=True):
    ref = torch.nn.Linear(256, 128, bias=bias).to(dtype)
    fp8 = ss.nn.Linear(256, 128, bias=bias, manager=manager, name="fc", dtype=dtype)
    fp8.load_state_dict(ref.state_dict())
    return ref, fp8


class TestNumerics:
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_sqnr_vs_fp32(self, manager, dtype):
        """Output >= 25 dB, input and weight gradients >= 20 dB, over 3 steps."""
        ref, fp8 = _pair(manager, dtype)
        nvfp4 = isinstance(manager.recipe, ss.NVFP4Scaling)
        out_db, grad_db = (NVFP4_OUTPUT_SQNR_DB, NVFP4_GRAD_SQNR_DB) if nvfp4 else (OUTPUT_SQNR_DB, GRAD_SQNR_DB)
        for _ in range(3):
            x, g = torch.randn(4, 32, 256, dtype=dtype), torch.randn(4, 32, 128, dtype=dtype)
            x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
            y_ref = ref(x1)
            y_ref.backward(g)
            with manager.forward():
                y = fp8(x2)
            with manager.backward():
                y.backward(g)
            assert y.dtype == dtype and x2.grad.dtype == dtype and fp8.weight.grad.dtype == dtype
            assert sqnr(y_ref, y) >= out_db
            assert sqnr(x1.grad, x2.grad) >= grad_db
            assert sqnr(ref.weight.grad, fp8.weight.grad) >= grad_db
            assert sqnr(ref.bias.grad, fp8.bias.grad) >= 40.0
            ref.zero_grad()
            fp8.zero_grad()
            manager.step()

    def test_backends_agree(self, recipe):
        """emulation and scaled_mm give the same outputs and grads (1e-5 relative)."""
        results = []
        for backend in ("emulation", "scaled_mm"):
            m = ss.ScalingStateManager(recipe, backend=backend_for(recipe, backend))
            torch.manual_seed(0)
            layer = ss.nn.Linear(64, 32, manager=m, name="fc")
            x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1), requires_grad=True)
            with m.forward():
                y = layer(x)
            with m.backward():
                y.square().sum().backward()
            results.append((y.detach(), x.grad, layer.weight.grad))
        for a, b in zip(*results, strict=False):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * a.abs().max().item())


class TestLinear:
    def test_leading_dims(self, delayed):
        """Any number of leading batch dimensions."""
        layer = ss.nn.Linear(8, 4, manager=delayed)
        for shape in [(8,), (3, 8), (2, 3, 8), (2, 1, 3, 8)]:
            x = torch.randn(shape, requires_grad=True)
            y = layer(x)
            y.sum().backward()
            assert y.shape == (*shape[:-1], 4) and x.grad.shape == shape

    def test_feature_mismatch(self, delayed):
        """A wrong last dimension names both sizes."""
        layer = ss.nn.Linear(8, 4, manager=delayed)
        with pytest.raises(ValueError, match=r"9 features.*expects 8"):
            layer(torch.randn(2, 9))

    def test_no_bias(self, delayed):
        """bias=False works and has no bias parameter."""
        layer = ss.nn.Linear(8, 4, bias=False, manager=delayed)
        assert layer.bias is None
        layer(torch.randn(2, 8)).sum().backward()
        assert layer.weight.grad is not None

    def test_handle_and_names(self, delayed):
        """Each layer registers INPUT, WEIGHT and GRAD_OUTPUT under a unique name."""
        a = ss.nn.Linear(8, 4, manager=delayed)
        b = ss.nn.Linear(8, 4, manager=delayed)
        c = ss.nn.Linear(8, 4, manager=delayed, name="head")
        assert (a.handle.name, b.handle.name, c.handle.name) == ("linear", "linear_1", "head")
        assert a.handle.roles == (I, W, G)
        assert "slot='head'" in repr(c)

    def test_empty_name_refused(self, delayed):
        """An empty name is an error, not a request for a default one."""
        with pytest.raises(ss.errors.SlotError):
            ss.nn.Linear(8, 4, manager=delayed, name="")

    def test_manager_required(self):
        """The manager must be a ScalingStateManager."""
        with pytest.raises(TypeError, match="ScalingStateManager"):
            ss.nn.Linear(8, 4, manager=None)  # type: ignore[arg-type]

    def test_state_dict_keys_match_torch(self, delayed):
        """Checkpoints of torch.nn.Linear load into ss.nn.Linear and back."""
        ref = torch.nn.Linear(8, 4)
        layer = ss.nn.Linear(8, 4, manager=delayed)
        layer.load_state_dict(ref.state_dict())
        assert layer.state_dict().keys() == ref.state_dict().keys()

    def test_saves_only_fp8_activations(self, delayed):
        """The input is saved for backward in FP8; no high-precision activation is kept."""
        layer = ss.nn.Linear(64, 64, manager=delayed)
        saved = []

        def pack(t):
            saved.append(t)
            return t

        x = torch.randn(16, 64, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = layer(x)
        big = [t for t in saved if t.numel() > 1]
        assert big and all(t.dtype == torch.float8_e4m3fn for t in big)
        y.sum().backward()

    def test_backward_products_run_in_fp8(self, delayed):
        """Both backward products get FP8 operands (E5M2 gradient, E4M3 weight/input)."""
        seen = []
        real = delayed.backend.scaled_mm

        def spy(a, b, **kw):
            seen.append((a.dtype, b.dtype))
            return real(a, b, **kw)

        delayed.backend.scaled_mm = spy  # type: ignore[method-assign]
        layer = ss.nn.Linear(16, 8, manager=delayed)
        layer(torch.randn(4, 16, requires_grad=True)).sum().backward()
        e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
        assert seen == [(e4, e4), (e5, e4), (e5, e4)]

    def test_autocast(self, backend):
        """Under bf16 autocast the output is bf16 and equals the fp32-output product rounded to bf16."""
        outs = []
        for autocast in (False, True):
            m = ss.ScalingStateManager(ss.DelayedScaling(), backend=backend)
            torch.manual_seed(0)
            layer = ss.nn.Linear(32, 16, manager=m, name="fc")
            x = torch.randn(4, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                y = layer(x)
            y.float().sum().backward()
            assert x.grad.dtype == torch.float32
            outs.append(y)
        assert outs[1].dtype == torch.bfloat16
        assert torch.equal(outs[1], outs[0].to(torch.bfloat16))

    def test_grad_output_recorded(self, delayed):
        """The backward cast feeds the GRAD_OUTPUT slot."""
        layer = ss.nn.Linear(8, 4, manager=delayed, name="fc")
        layer(torch.randn(2, 8)).mul(3.0).sum().backward()
        delayed.step()
        assert layer.handle.amax_history(G)[-1].item() == 3.0


class TestConvert:
    def _model(self):
        return torch.nn.Sequential(
            torch.nn.Linear(8, 16),
            torch.nn.ReLU(),
            torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)),
        )

    def test_swaps_and_keeps_parameters(self, delayed):
        """Every Linear is swapped, keeping the very parameter objects and the outputs' meaning."""
        model = self._model()
        params = list(model.parameters())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ss.nn.convert(model, delayed)
        assert isinstance(model[0], ss.nn.Linear) and isinstance(model[2][1], ss.nn.Linear)
        assert all(a is b for a, b in zip(params, model.parameters(), strict=False))
        assert list(delayed.handles) == ["0", "2.0", "2.1"]
        before = model[0].weight.clone()
        model(torch.randn(2, 8)).sum().backward()
        opt.step()  # the optimizer built before the conversion still updates the weights
        assert not torch.equal(before, model[0].weight)

    def test_filter_fn(self, delayed):
        """filter_fn(path, module) chooses which layers convert."""
        model = ss.nn.convert(self._model(), delayed, filter_fn=lambda path, mod: mod.out_features != 4)
        assert type(model[2][1]) is torch.nn.Linear and list(delayed.handles) == ["0", "2.0"]

    def test_leaves_subclasses_and_converted(self, delayed):
        """Subclasses of torch.nn.Linear and already-converted layers are left alone."""

        class Custom(torch.nn.Linear):
            pass

        model = torch.nn.Sequential(Custom(4, 4), ss.nn.Linear(4, 4, manager=delayed, name="done"))
        ss.nn.convert(model, delayed)
        assert type(model[0]) is Custom and list(delayed.handles) == ["done"]

    def test_shared_layer_converted_everywhere(self, delayed):
        """A layer reachable by two paths becomes one FP8 layer at both."""
        shared = torch.nn.Linear(4, 4)
        model = torch.nn.Sequential(shared, torch.nn.ReLU(), shared)
        ss.nn.convert(model, delayed)
        assert isinstance(model[0], ss.nn.Linear) and model[2] is model[0]
        assert list(delayed.handles) == ["0"]

    def test_taken_name_changes_nothing(self, delayed):
        """A name already registered: nothing is converted, no slot is added."""
        delayed.register("1")
        model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
        with pytest.raises(ss.errors.SlotError, match=r"\['1'\] are already registered"):
            ss.nn.convert(model, delayed)
        assert list(delayed.handles) == ["1"]
        assert type(model[0]) is torch.nn.Linear and type(model[1]) is torch.nn.Linear

    def test_bare_linear(self, delayed):
        """Converting a Linear itself returns the FP8 layer."""
        layer = torch.nn.Linear(4, 4, bias=False)
        out = ss.nn.convert(layer, delayed)
        assert isinstance(out, ss.nn.Linear) and out.weight is layer.weight and out.bias is None

    def test_keeps_training_flag(self, delayed):
        """An eval-mode layer stays in eval mode."""
        model = self._model().eval()
        ss.nn.convert(model, delayed)
        assert not model[0].training


def _mlp(manager, device=None, fp8_all_gather=False):
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(16, 32, device=device), torch.nn.ReLU(), torch.nn.Linear(32, 8, device=device)
    )
    return ss.nn.convert(net, manager, fp8_all_gather=fp8_all_gather)


def _train(manager, model, steps=3):
    """SGD with 2 microbatches per step and growing data; returns losses and the manager's state."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step)) * (1 + step)
        for mb in x.split(4):
            with manager.forward():
                loss = model(mb).square().mean()
            with manager.backward():
                loss.backward()
            losses.append(loss.detach())
        opt.step()
        opt.zero_grad()
        manager.step()
    sd = manager.state_dict()
    return torch.stack(losses), sd["amax_history"], sd["scale"]


class TestMeta:
    def test_forward_infers_shapes_and_records_nothing(self, delayed):
        """A forward on meta returns a meta output of the right shape and dtype, with autograd, and touches no state."""
        layer = ss.nn.Linear(16, 8, manager=delayed, name="fc", device="meta")
        x = torch.randn(2, 3, 16, device="meta", requires_grad=True)
        y = layer(x)
        assert y.is_meta and y.shape == (2, 3, 8) and y.dtype == torch.float32
        y.sum().backward()
        assert x.grad.is_meta and layer.weight.grad.is_meta
        assert not delayed.state_dict()["step_amax"].any()
        delayed.step()  # nothing recorded: no backward-without-forward complaint either
        assert not delayed.state_dict()["amax_history"].any()

    def test_mixed_devices_say_how_to_materialize(self, delayed):
        """A meta layer fed a CPU input (or the reverse) is an error that names to_empty."""
        layer = ss.nn.Linear(16, 8, manager=delayed, name="fc", device="meta")
        with pytest.raises(ss.errors.CastError, match=r"meta.*to_empty"):
            layer(torch.randn(2, 16))
        with pytest.raises(ss.errors.CastError, match=r"meta.*to_empty"):
            ss.nn.Linear(16, 8, manager=delayed, name="cpu")(torch.randn(2, 16, device="meta"))

    @pytest.mark.parametrize("fp8_all_gather", [False, True])
    def test_materialized_model_trains_like_one_built_on_cpu(self, fp8_all_gather):
        """Built and converted on meta, then to_empty + the same weights: bitwise the training of a CPU-built model."""
        results = []
        for device in ("cpu", "meta"):
            m = ss.ScalingStateManager(ss.DelayedScaling(history_len=4), backend="emulation")
            model = _mlp(m, device=device, fp8_all_gather=fp8_all_gather)
            with torch.no_grad():  # an evaluation pass: records nothing; on meta it must not pin the state there
                model(torch.randn(4, 16, device=device))
            if device == "meta":
                model.to_empty(device="cpu")
                for layer in model:
                    if isinstance(layer, torch.nn.Linear):
                        layer.reset_parameters()  # initializes; the weights are then set like the CPU model's
                model.load_state_dict(_mlp(ss.ScalingStateManager(ss.DelayedScaling()), "cpu").state_dict())
            results.append(_train(m, model))
            assert m.device == torch.device("cpu")
        for a, b in zip(*results, strict=True):
            assert torch.equal(a, b)

    def test_linear_on_meta_with_fp8_all_gather(self, delayed):
        """ss.nn.Linear(..., device="meta", fp8_all_gather=True) materializes and runs."""
        layer = ss.nn.Linear(16, 8, manager=delayed, name="fc", device="meta", fp8_all_gather=True)
        layer.to_empty(device="cpu")
        layer.reset_parameters()
        assert isinstance(layer.weight, ss.nn.fsdp.FP8AllGatherWeight) and layer.weight.device.type == "cpu"
        y = layer(torch.randn(2, 16))
        y.sum().backward()
        assert layer.weight.grad is not None and layer.weight.grad.shape == (8, 16)


class TestFP8AllGatherWithoutFSDP:
    def test_trains_bitwise_like_a_plain_weight(self):
        """Outside FSDP, fp8_all_gather=True changes nothing: losses, histories and scales are bitwise equal."""
        runs = []
        for fp8_all_gather in (False, True):
            m = ss.ScalingStateManager(ss.DelayedScaling(history_len=4), backend="emulation")
            runs.append(_train(m, _mlp(m, fp8_all_gather=fp8_all_gather), steps=4))
        for a, b in zip(*runs, strict=True):
            assert torch.equal(a, b)

    def test_in_place_updates_invalidate_the_weight_cast(self, delayed):
        """An in-place change of the wrapped weight is seen (a fresh cast), as with a plain weight."""
        layer = ss.nn.Linear(8, 4, manager=delayed, name="fc", fp8_all_gather=True)
        x = torch.randn(2, 8)
        with torch.no_grad():
            before = layer(x)
            layer.weight.mul_(2.0)
            after = layer(x)
        assert not torch.equal(before, after)

    @pytest.mark.parametrize(
        "edit",
        [
            pytest.param(lambda w: w.__setitem__((0, 0), 5.0), id="w[0,0]=5"),
            pytest.param(lambda w: w[0].mul_(3.0), id="w[0]"),
            pytest.param(lambda w: w[:, :3].fill_(0.25), id="w[:,:k]"),
            pytest.param(lambda w: w.t().mul_(-2.0), id="w.t()"),
            pytest.param(lambda w: w.view(-1).__setitem__(1, 7.0), id="w.view(-1)"),
            pytest.param(lambda w: w.narrow(0, 1, 2).zero_(), id="w.narrow"),
            pytest.param(lambda w: w.t()[2].add_(1.0), id="w.t()[2]"),
            pytest.param(lambda w: w.detach()[1].sub_(1.0), id="w.detach()[1]"),
        ],
    )
    def test_writes_through_views_invalidate_the_weight_cast(self, edit):
        """A write through any view of the wrapped weight is seen by the next forward, as with a plain weight."""
        outs = []
        for fp8_all_gather in (True, False):
            m = ss.ScalingStateManager(ss.DelayedScaling(history_len=4), backend="emulation")
            torch.manual_seed(0)
            layer = ss.nn.Linear(8, 4, manager=m, name="fc", fp8_all_gather=fp8_all_gather)
            x = torch.randn(2, 8, generator=torch.Generator().manual_seed(1))
            with torch.no_grad():
                before = layer(x)  # caches the weight cast
                edit(layer.weight)
                after = layer(x)
            outs.append((before, after, layer.weight.detach().clone()))
        (before, after, weight), (plain_before, plain_after, plain_weight) = outs
        assert torch.equal(weight, plain_weight) and torch.equal(before, plain_before)
        assert not torch.equal(before, after)
        assert torch.equal(after, plain_after)  # the same fresh cast as a plain weight's

    def test_views_keep_the_weights_type_and_values(self, delayed):
        """Views of the wrapped weight are wrappers too, over the same values; other ops give plain tensors."""
        layer = ss.nn.Linear(8, 4, manager=delayed, name="fc", fp8_all_gather=True)
        w = layer.weight.detach()
        for view in (w[0], w.t(), w[:, :3], w.view(-1), w.unbind(0)[1]):
            assert isinstance(view, ss.nn.fsdp.FP8AllGatherWeight)
        assert torch.equal(w.t().clone(), w.clone().t())
        assert type(w + 1) is torch.Tensor and type(w.t() @ w) is torch.Tensor

    def test_weight_is_a_tensor_everywhere(self, delayed):
        """The wrapped weight keeps torch.nn.Linear's state_dict keys and loads plain checkpoints."""
        ref = torch.nn.Linear(8, 4)
        layer = ss.nn.Linear(8, 4, manager=delayed, name="fc", fp8_all_gather=True)
        layer.load_state_dict(ref.state_dict())
        assert layer.state_dict().keys() == ref.state_dict().keys()
        assert torch.equal(layer.weight.detach().clone(), ref.weight.detach())
        assert layer.fp8_all_gather and "fp8_all_gather=True" in repr(layer)

    def test_checkpoints_hold_plain_tensors(self, delayed, tmp_path):
        """state_dict() saves plain tensors: torch.load(weights_only=True) reads them; they load back."""
        layer = ss.nn.Linear(8, 4, manager=delayed, name="fc", fp8_all_gather=True)
        assert type(layer.state_dict()["weight"]) is torch.Tensor
        torch.save(layer.state_dict(), tmp_path / "fc.pt")
        state = torch.load(tmp_path / "fc.pt", weights_only=True)
        other = ss.nn.Linear(8, 4, manager=delayed, name="other", fp8_all_gather=True)
        other.load_state_dict(state)
        torch.nn.Linear(8, 4).load_state_dict(state)
        x = torch.randn(2, 8)
        with torch.no_grad():
            assert torch.equal(layer(x), other(x))

    def test_keyword_checked(self, delayed):
        """fp8_all_gather takes a bool, on the layer and in convert()."""
        with pytest.raises(TypeError, match="fp8_all_gather"):
            ss.nn.Linear(8, 4, manager=delayed, fp8_all_gather=1)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="fp8_all_gather"):
            ss.nn.convert(torch.nn.Linear(8, 4), delayed, fp8_all_gather="yes")  # type: ignore[arg-type]

    def test_tied_weights_refused(self, delayed):
        """convert(fp8_all_gather=True) refuses layers that share a weight, converting nothing."""
        a, b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
        b.weight = a.weight
        model = torch.nn.Sequential(a, b)
        with pytest.raises(ss.errors.SlotError, match=r"share one weight.*filter_fn"):
            ss.nn.convert(model, delayed, fp8_all_gather=True)
        assert type(model[0]) is torch.nn.Linear and not delayed.handles
