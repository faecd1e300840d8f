"""scalestate.integrations.torchao: torchao's float8 training with its casts scaled by a manager.

Every run trains a small ReLU MLP (layers 32 -> 64 -> 64 -> 16, three-dimensional
inputs) for 5 optimizer steps of 2 microbatches with AdamW, on inputs whose
range grows each step so that delayed scales really move, and records losses,
outputs, input and parameter gradients, parameters and the manager's state
after every step. Comparisons are ``torch.equal`` unless a test says otherwise.
"""

from __future__ import annotations

import copy
import importlib
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import attrs
import pytest
import torch
import torch.utils.checkpoint as tcp
from torch import Tensor, nn
from torch._dynamo.utils import counters
from torchao.float8 import Float8LinearConfig
from torchao.float8 import convert_to_float8_training as torchao_convert
from torchao.float8.config import CastConfig, ScalingGranularity, ScalingType
from torchao.float8.float8_training_tensor import Float8TrainingTensor
from torchao.float8.float8_utils import amax_to_scale

import scalestate as ss
from sac_programs import Policy
from scalestate.errors import ScaleStateError, SlotError
from scalestate.integrations.torchao import (
    AMAX_FLOOR,
    ConversionError,
    ConversionTypeError,
    ManagedFloat8Linear,
    convert_to_float8_training,
    matching_recipe,
)
from scalestate.math import scale_from_amax

ROOT = Path(__file__).resolve().parents[1]
#: torchao's default (tensorwise) config, its products emulated in float32 (CPU).
CONFIG = Float8LinearConfig(emulate=True)
STEPS, MICROBATCHES = 5, 2
DELAYED = ss.DelayedScaling(history_len=4)


class MLP(nn.Module):
    """Three Linear layers; ``checkpoint`` wraps the first two (with their ReLUs) in torch's checkpoint."""

    def __init__(self, checkpoint: str = "none") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.head = nn.Linear(64, 16)
        self.checkpoint = checkpoint

    def forward(self, x: Tensor) -> Tensor:
        if self.checkpoint == "none":
            h = self.body(x)
        else:
            h = tcp.checkpoint(self.body, x, use_reentrant=self.checkpoint == "reentrant")
        return self.head(h)


def batches(steps: int = STEPS) -> list[list[Tensor]]:
    """Per step, per microbatch, a ``[2, 8, 32]`` input whose range grows with the step."""
    gen = torch.Generator().manual_seed(1)
    return [[torch.randn(2, 8, 32, generator=gen) * (1 + step) * (1 + mb) for mb in range(MICROBATCHES)]
            for step in range(steps)]


@attrs.define
class Record:
    losses: list[Tensor] = attrs.Factory(list)
    outputs: list[Tensor] = attrs.Factory(list)
    input_grads: list[Tensor] = attrs.Factory(list)
    #: Per step: parameter gradients, then parameters after the optimizer step (by name).
    grads: list[dict[str, Tensor]] = attrs.Factory(list)
    params: list[dict[str, Tensor]] = attrs.Factory(list)
    #: Per step: the manager's state_dict after step().
    states: list[dict[str, Any]] = attrs.Factory(list)


def run_steps(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    manager: ss.ScalingStateManager | None,
    data: list[list[Tensor]],
    rec: Record,
    *,
    call: Callable[[Tensor], Tensor] | None = None,
    evaluate: bool = False,
) -> Record:
    """Train on ``data`` (phase blocks and step() when there is a manager), recording into ``rec``."""
    call = model if call is None else call
    for step_inputs in data:
        for x in step_inputs:
            x = x.clone().requires_grad_()
            if manager is None:
                y = call(x)
                loss = y.square().mean()
                loss.backward()
            else:
                with manager.forward():
                    y = call(x)
                    loss = y.square().mean()
                with manager.backward():
                    loss.backward()
            rec.outputs.append(y.detach().clone())
            rec.losses.append(loss.detach().clone())
            assert x.grad is not None
            rec.input_grads.append(x.grad)
        rec.grads.append({k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None})
        opt.step()
        opt.zero_grad()
        if manager is not None:
            manager.step()
            if evaluate:  # an evaluation pass between steps, on inputs far out of the training range
                with torch.no_grad():
                    call(step_inputs[0] * 50)
            rec.states.append(manager.state_dict())
        rec.params.append({k: p.detach().clone() for k, p in model.named_parameters()})
    return rec


def managed(recipe: ss.Recipe, *, checkpoint: str = "none", config: Float8LinearConfig = CONFIG) -> tuple[
    nn.Module, torch.optim.Optimizer, ss.ScalingStateManager
]:
    manager = ss.ScalingStateManager(recipe, backend="emulation")
    model = convert_to_float8_training(MLP(checkpoint), manager, config=config)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01), manager


def train(recipe: ss.Recipe, *, checkpoint: str = "none", compile_kwargs: dict[str, Any] | None = None,
          evaluate: bool = False, config: Float8LinearConfig = CONFIG) -> Record:
    model, opt, manager = managed(recipe, checkpoint=checkpoint, config=config)
    call = torch.compile(model, **compile_kwargs) if compile_kwargs is not None else None
    return run_steps(model, opt, manager, batches(), Record(), call=call, evaluate=evaluate)


def assert_tensors_equal(a: list[Tensor], b: list[Tensor], what: str) -> None:
    assert len(a) == len(b), what
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert torch.equal(x, y), f"{what} {i} differ"


def assert_same_training(a: Record, b: Record) -> None:
    """Losses, outputs, gradients and parameters of every microbatch and step are bitwise equal."""
    assert_tensors_equal(a.losses, b.losses, "losses of microbatch")
    assert_tensors_equal(a.outputs, b.outputs, "outputs of microbatch")
    assert_tensors_equal(a.input_grads, b.input_grads, "input gradients of microbatch")
    for field in ("grads", "params"):
        assert len(getattr(a, field)) == len(getattr(b, field)) == STEPS
        for step, (da, db) in enumerate(zip(getattr(a, field), getattr(b, field), strict=True)):
            assert da.keys() == db.keys()
            for key in da:
                assert torch.equal(da[key], db[key]), f"{field} {key} differ at step {step}"


def assert_same_state(a: Record, b: Record) -> None:
    """The manager's state_dict after every step is bitwise equal (histories, scales, pending amaxes)."""
    assert len(a.states) == len(b.states) == STEPS
    for step, (sa, sb) in enumerate(zip(a.states, b.states, strict=True)):
        assert sa["slots"] == sb["slots"] and sa["iteration"] == sb["iteration"]
        for key in ("amax_history", "scale", "step_amax", "nonfinite_counts"):
            assert torch.equal(sa[key], sb[key]), f"{key} differs after step {step}"


def emulated(x: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """The value torchao's emulated product reads for ``x`` cast with ``scale``: cast, then divided by it."""
    fmax = torch.finfo(dtype).max
    return (x.float() * scale).clamp(-fmax, fmax).to(dtype).float() / scale


class TestTorchaoParity:
    """With ss.CurrentScaling the adapter trains exactly as torchao's own dynamic tensorwise scaling."""

    @pytest.mark.parametrize("emulate", [True, False], ids=["emulated", "scaled_mm"])
    def test_current_scaling_is_torchao_dynamic(self, emulate):
        """Losses, outputs, gradients and parameters of 5 steps x 2 microbatches, bitwise (emulated
        products, and torch._scaled_mm's CPU kernel)."""
        config = Float8LinearConfig(emulate=emulate)
        theirs = torchao_convert(MLP(), config=config)
        ref = run_steps(theirs, torch.optim.AdamW(theirs.parameters(), lr=0.01), None, batches(), Record())
        ours = train(ss.CurrentScaling(), config=config)
        assert_same_training(ours, ref)

    @pytest.mark.parametrize("precision", ["bf16_params", "cpu_autocast"])
    def test_low_precision_is_torchao(self, precision):
        """A bfloat16 model, and float32 under CPU autocast (bfloat16), train as torchao's do: bitwise."""
        theirs = torchao_convert(MLP(), config=CONFIG)
        ours, _, manager = managed(ss.CurrentScaling())
        if precision == "bf16_params":
            theirs, ours = theirs.to(torch.bfloat16), ours.to(torch.bfloat16)
        data = [[x.to(torch.bfloat16) if precision == "bf16_params" else x for x in step] for step in batches()]
        recs = []
        for model, mgr in ((theirs, None), (ours, manager)):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "cpu_autocast"):
                recs.append(run_steps(model, torch.optim.SGD(model.parameters(), lr=0.1), mgr, data, Record()))
        assert recs[1].outputs[0].dtype == torch.bfloat16
        assert_same_training(recs[1], recs[0])

    def test_delayed_scaling_is_not_dynamic(self):
        """Sanity of the above: delayed scales (from earlier steps) give other numbers than torchao's."""
        theirs = torchao_convert(MLP(), config=CONFIG)
        ref = run_steps(theirs, torch.optim.AdamW(theirs.parameters(), lr=0.01), None, batches(), Record())
        ours = train(DELAYED)
        assert torch.equal(ours.losses[0], ref.losses[0])  # before the first step() both scale just in time
        assert not torch.equal(ours.losses[-1], ref.losses[-1])


#: Amaxes at and below torchao's floor (1e-12): tiny normal ones, subnormal ones down to the smallest,
#: and the floor's own float32 with its neighbours.
_F32_EPS = torch.tensor(1e-12)
TINY_AMAXES = {
    "1e-13": 1e-13,
    "1e-30": 1e-30,
    "subnormal_1e-40": 1e-40,
    "subnormal_min": 2.0**-149,
    "float32(1e-12)": _F32_EPS.item(),
    "below_float32(1e-12)": torch.nextafter(_F32_EPS, torch.tensor(0.0)).item(),
    "above_float32(1e-12)": torch.nextafter(_F32_EPS, torch.tensor(1.0)).item(),
}


def _layer_run(layer: nn.Module, x: Tensor, grad: Tensor) -> list[Tensor]:
    """Output, input gradient and parameter gradients of one forward and backward of ``layer``."""
    x = x.clone().requires_grad_()
    y = layer(x)
    y.backward(grad)
    assert x.grad is not None
    return [y.detach(), x.grad, *(p.grad for p in layer.parameters() if p.grad is not None)]


def _tiny_case(which: str, amax: float) -> tuple[nn.Linear, Tensor, Tensor]:
    """A Linear(32, 16) and an input and output gradient, the one named by ``which`` scaled to ``amax``."""
    gen = torch.Generator().manual_seed(2)
    layer = nn.Linear(32, 16)
    x, grad = torch.randn(8, 32, generator=gen), torch.randn(8, 16, generator=gen)
    tensors = {"input": x, "weight": layer.weight.data, "grad_output": grad}
    tensors[which].div_(tensors[which].abs().max()).mul_(amax)
    return layer, x, grad


class TestTinyAmaxes:
    """At and below torchao's amax floor, matching_recipe(config) keeps the adapter bitwise torchao's."""

    def test_matching_recipe(self):
        """CurrentScaling with the config's format and power-of-two rounding, and torchao's floor."""
        assert AMAX_FLOOR == 1e-12
        assert matching_recipe(CONFIG) == ss.CurrentScaling(amax_floor=1e-12)
        pow2 = Float8LinearConfig(round_scales_to_power_of_2=True, emulate=True)
        assert matching_recipe(pow2, DELAYED) == ss.DelayedScaling(history_len=4, power_of_2=True, amax_floor=1e-12)
        e5m2 = CastConfig(target_dtype=torch.float8_e5m2)
        assert matching_recipe(Float8LinearConfig(cast_config_input=e5m2, cast_config_weight=e5m2)).format is (
            ss.Format.E5M2
        )
        with pytest.raises(ConversionError, match=re.escape("no ss.Format casts the config's dtypes")):
            matching_recipe(Float8LinearConfig(cast_config_input=e5m2))
        with pytest.raises(ConversionTypeError, match=re.escape("ss.DelayedScaling or ss.CurrentScaling")):
            matching_recipe(CONFIG, ss.RowwiseScaling())  # type: ignore[arg-type]

    @pytest.mark.parametrize("power_of_2", [False, True], ids=["exact", "pow2"])
    @pytest.mark.parametrize("fmt", [ss.Format.E4M3, ss.Format.E5M2], ids=["e4m3", "e5m2"])
    def test_scales_are_torchaos(self, fmt, power_of_2):
        """The scale rule of matching_recipe, and a cast's scale, are torchao's amax_to_scale bit for bit:
        every power of two from the smallest subnormal to 2**127, the 128 float32 values around the
        floor, and 20000 random float32 amaxes over the whole range."""
        gen = torch.Generator().manual_seed(0)
        around = torch.tensor(1e-12).view(torch.int32) + torch.arange(-64, 65, dtype=torch.int32)
        amaxes = torch.cat([
            torch.exp2(torch.arange(-149, 128, dtype=torch.float64)).float(),
            around.view(torch.float32),
            torch.exp2(torch.rand(20000, generator=gen, dtype=torch.float64) * 276 - 149).float(),
        ])
        recipe = attrs.evolve(matching_recipe(Float8LinearConfig(round_scales_to_power_of_2=power_of_2)), format=fmt)
        dtype = fmt.dtype(ss.Role.INPUT)
        theirs = amax_to_scale(amaxes, dtype, power_of_2)
        assert torch.equal(scale_from_amax(amaxes, torch.finfo(dtype).max, recipe.rule), theirs)
        handle = ss.ScalingStateManager(recipe, backend="emulation").register("fc")
        some = range(0, len(amaxes), 97)
        casts = torch.stack([handle.quantize(amaxes[i].reshape(1), ss.Role.INPUT).scale for i in some])
        assert torch.equal(casts, theirs[list(some)])

    @pytest.mark.parametrize("emulate", [True, False], ids=["emulated", "scaled_mm"])
    @pytest.mark.parametrize("which", ["input", "weight", "grad_output"])
    @pytest.mark.parametrize("amax", sorted(TINY_AMAXES))
    def test_layer_is_torchaos(self, amax, which, emulate):
        """Output, input gradient, weight and bias gradients of a layer whose input, weight or output
        gradient has the amax: bitwise torchao's own layer."""
        config = Float8LinearConfig(emulate=emulate)
        layer, x, grad = _tiny_case(which, TINY_AMAXES[amax])
        theirs = _layer_run(torchao_convert(copy.deepcopy(layer), config=config), x, grad)
        manager = ss.ScalingStateManager(matching_recipe(config), backend="emulation")
        ours = _layer_run(convert_to_float8_training(copy.deepcopy(layer), manager, config=config), x, grad)
        assert_tensors_equal(ours, theirs, "output, input, weight and bias gradients")

    def test_without_the_floor_tiny_gradients_differ(self):
        """Why the floor: ss.CurrentScaling() (no floor) scales a gradient of amax 1e-13 ten times
        higher than torchao (5.734e17 against 5.734e16), and every weight-gradient element differs."""
        layer, x, grad = _tiny_case("grad_output", 1e-13)
        theirs = _layer_run(torchao_convert(copy.deepcopy(layer), config=CONFIG), x, grad)
        manager = ss.ScalingStateManager(ss.CurrentScaling(), backend="emulation")
        ours = _layer_run(convert_to_float8_training(copy.deepcopy(layer), manager, config=CONFIG), x, grad)
        assert torch.equal(ours[0], theirs[0])  # the forward is untouched
        assert (ours[2] != theirs[2]).all() and ours[2].numel() == 512

    def test_training_with_tiny_gradients_is_torchaos(self):
        """5 steps x 2 microbatches of the MLP with its output scaled by 1e-6 (output gradients of 1e-14 to
        1e-16 in every layer): losses, outputs, gradients and parameters bitwise torchao's."""
        def scaled(model: nn.Module) -> Callable[[Tensor], Tensor]:
            return lambda x: model(x) * 1e-6

        theirs = torchao_convert(MLP(), config=CONFIG)
        ref = run_steps(theirs, torch.optim.AdamW(theirs.parameters(), lr=0.01), None, batches(), Record(),
                        call=scaled(theirs))
        model, opt, manager = managed(matching_recipe(CONFIG))
        got = run_steps(model, opt, manager, batches(), Record(), call=scaled(model))
        assert_same_training(got, ref)
        for handle in manager.handles.values():
            assert 0 < handle.amax_history(ss.Role.GRAD_OUTPUT)[-1] < 1e-13


class TestConversion:
    """What convert_to_float8_training swaps, keeps and registers."""

    def test_layers_parameters_and_names(self):
        """Every Linear becomes a ManagedFloat8Linear holding the same parameter objects and state_dict keys;
        slots are named by module path."""
        model = MLP()
        params = dict(model.named_parameters())
        keys = list(model.state_dict())
        manager = ss.ScalingStateManager(DELAYED, backend="emulation")
        out = convert_to_float8_training(model, manager, config=CONFIG)
        assert out is model
        assert [type(m) for m in (model.body[0], model.body[2], model.head)] == [ManagedFloat8Linear] * 3
        assert all(p is params[k] for k, p in model.named_parameters())
        assert list(model.state_dict()) == keys
        assert list(manager.handles) == ["body.0", "body.2", "head"]
        assert model.head.handle is manager.handles["head"]
        assert model.head.handle.roles == (ss.Role.INPUT, ss.Role.WEIGHT, ss.Role.GRAD_OUTPUT)

    def test_filter_takes_module_and_fqn(self):
        """module_filter_fn(module, fqn), torchao's order; a root Linear has fqn '' and is returned converted."""
        manager = ss.ScalingStateManager(DELAYED, backend="emulation")
        seen: list[tuple[type, str]] = []

        def keep(module: nn.Module, fqn: str) -> bool:
            seen.append((type(module), fqn))
            return fqn != "head"

        model = convert_to_float8_training(MLP(), manager, config=CONFIG, module_filter_fn=keep)
        assert seen == [(nn.Linear, "body.0"), (nn.Linear, "body.2"), (nn.Linear, "head")]
        assert type(model.head) is nn.Linear and list(manager.handles) == ["body.0", "body.2"]
        root = nn.Linear(16, 16)
        new = convert_to_float8_training(root, manager, config=CONFIG)
        assert isinstance(new, ManagedFloat8Linear) and new.weight is root.weight
        assert new.handle.name == "linear"

    def test_shared_layer_converted_once(self):
        """A layer reachable by two paths becomes one layer, under its first path."""
        lin = nn.Linear(16, 16)
        model = nn.Sequential(lin, nn.ReLU(), lin)
        manager = ss.ScalingStateManager(DELAYED, backend="emulation")
        convert_to_float8_training(model, manager, config=CONFIG)
        assert model[0] is model[2] and list(manager.handles) == ["0"]

    def test_default_config_is_torchao_default(self):
        """config=None is torchao's Float8LinearConfig() (tensorwise; torch._scaled_mm products)."""
        manager = ss.ScalingStateManager(DELAYED, backend="emulation")
        model = convert_to_float8_training(MLP(), manager)
        assert model.head.config == Float8LinearConfig()
        model(torch.randn(4, 32)).sum().backward()


class TestManagerScales:
    """The casts are the manager's: its slot scales are used and its slots record the amaxes."""

    def test_casts_use_slot_scales(self):
        """After a step, output and input gradient are torchao's emulated products of operands cast with
        the slots' own scales (INPUT, WEIGHT forward; GRAD_OUTPUT backward)."""
        manager = ss.ScalingStateManager(DELAYED, backend="emulation")
        layer = convert_to_float8_training(nn.Linear(32, 16), manager, config=CONFIG)
        h = layer.handle
        with manager.forward():
            y = layer(torch.randn(4, 32))
        with manager.backward():
            y.sum().backward()
        manager.step()
        x = (torch.randn(4, 32) * 3).requires_grad_()
        y = layer(x)
        e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
        sx, sw, sg = (h.scale(role) for role in (ss.Role.INPUT, ss.Role.WEIGHT, ss.Role.GRAD_OUTPUT))
        w = layer.weight.detach()
        assert torch.equal(y.detach(), emulated(x.detach(), sx, e4m3) @ emulated(w, sw, e4m3).t() + layer.bias.detach())
        g = torch.randn(4, 16) * 1e-3
        y.backward(g)
        assert torch.equal(x.grad, emulated(g, sg, e5m2) @ emulated(w, sw, e4m3))

    def test_amaxes_max_reduced_over_microbatches(self):
        """After a step, each forward slot's newest history entry is the max over the step's microbatches."""
        model, opt, manager = managed(DELAYED)
        step = batches(1)
        first_weight = model.body[0].weight.detach().abs().max()
        run_steps(model, opt, manager, step, Record())
        x_max = max(x.abs().max() for x in step[0])
        assert torch.equal(model.body[0].handle.amax_history(ss.Role.INPUT)[-1], x_max)
        assert torch.equal(model.body[0].handle.amax_history(ss.Role.WEIGHT)[-1], first_weight)
        assert model.head.handle.amax_history(ss.Role.GRAD_OUTPUT)[-1] > 0

    def test_setting_weight_drops_cached_cast(self):
        """Setting ``weight`` (as FSDP2 does at each all-gather, after refilling it in place with its version
        counter preserved) drops the cached weight cast; without it the stale cast would be reused."""
        manager = ss.ScalingStateManager(ss.CurrentScaling(), backend="emulation")
        layer = convert_to_float8_training(nn.Linear(32, 16, bias=False), manager, config=CONFIG)
        x = torch.randn(4, 32)
        with torch.no_grad():
            y1 = layer(x)
            layer.weight.data.mul_(2)  # a write the version counter does not see
            assert torch.equal(layer(x), y1)  # the cached cast, as documented for such writes
            layer.weight = layer.weight
            assert torch.equal(layer(x), 2 * y1)  # doubled weight: halved scale, same FP8 bits

    def test_saves_fp8_only(self):
        """torchao's product saves its operands for backward: here they are float8 training tensors."""
        manager = ss.ScalingStateManager(DELAYED, backend="emulation")
        layer = convert_to_float8_training(nn.Linear(32, 16), manager, config=CONFIG)
        saved: list[Tensor] = []

        def pack(t: Tensor) -> Tensor:
            saved.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            layer(torch.randn(4, 32, requires_grad=True)).sum().backward()
        assert len(saved) == 2 and all(isinstance(t, Float8TrainingTensor) for t in saved)


class TestCheckpointing:
    """Activation checkpointing changes nothing (delayed scaling, 2 microbatches, step() per step)."""

    @pytest.mark.parametrize("checkpoint", ["non_reentrant", "reentrant"])
    def test_parity(self, checkpoint):
        """Losses, outputs, gradients, parameters and the manager's state after every step, bitwise."""
        plain = train(DELAYED)
        ckpt = train(DELAYED, checkpoint=checkpoint)
        assert_same_training(ckpt, plain)
        assert_same_state(ckpt, plain)
        assert plain.states[-1]["iteration"] == STEPS
        assert (plain.states[-1]["amax_history"] > 0).all()  # every slot of every role recorded


class _SelectiveMLP(MLP):
    """``MLP`` whose body is checkpointed selectively with ``policy``."""

    def __init__(self, policy: Policy) -> None:
        super().__init__()
        self.policy = policy

    def forward(self, x: Tensor) -> Tensor:
        return self.head(tcp.checkpoint(self.body, x, use_reentrant=False, context_fn=self.policy.context_fn()))


class TestSelectiveCheckpointing:
    """Selective activation checkpointing with any policy, and an evaluation between forward and backward."""

    POLICIES: ClassVar[dict[str, Policy]] = {
        "all": Policy(),
        "none": Policy(frozenset()),
        "casts_ops": Policy(frozenset({"aten.mul.Tensor", "aten._to_copy.default", "aten.mm.default"})),
        "every_other": Policy(every=2),
    }

    @staticmethod
    def _run(model: nn.Module, manager: ss.ScalingStateManager, evaluate: bool) -> Record:
        ema = copy.deepcopy(model, memo={id(manager): manager})  # an evaluation copy sharing the manager
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        rec = Record()
        for step_inputs in batches():
            for x in step_inputs:
                with manager.forward():
                    loss = model(x).square().mean()
                if evaluate:
                    with torch.no_grad():
                        ema(x * 50)
                with manager.backward():
                    loss.backward()
                rec.losses.append(loss.detach())
            rec.grads.append({k: p.grad.clone() for k, p in model.named_parameters()})
            opt.step()
            opt.zero_grad()
            manager.step()
            rec.states.append(manager.state_dict())
            rec.params.append({k: p.detach().clone() for k, p in model.named_parameters()})
        return rec

    @pytest.mark.parametrize("evaluate", [False, True], ids=["", "eval_between"])
    @pytest.mark.parametrize("policy", sorted(POLICIES))
    def test_bitwise_without_checkpointing(self, policy, evaluate):
        """Losses, gradients, parameters and the manager's state after every step, bitwise."""

        def run(make: Callable[[], nn.Module], evaluate: bool) -> Record:
            manager = ss.ScalingStateManager(DELAYED, backend="emulation")
            return self._run(convert_to_float8_training(make(), manager, config=CONFIG), manager, evaluate)

        plain = run(MLP, False)
        got = run(lambda: _SelectiveMLP(self.POLICIES[policy]), evaluate)
        assert_tensors_equal(got.losses, plain.losses, "losses of microbatch")
        for field in ("grads", "params"):
            for step, (da, db) in enumerate(zip(getattr(got, field), getattr(plain, field), strict=True)):
                for key in db:
                    assert torch.equal(da[key], db[key]), f"{field} {key} differ at step {step}"
        assert_same_state(got, plain)


@pytest.mark.usefixtures("fresh_dynamo")
class TestCompile:
    """torch.compile of the converted model (phase blocks and step() outside it)."""

    @pytest.mark.parametrize(
        ("recipe", "checkpoint"),
        [("delayed", "none"), ("current", "none"), ("delayed", "non_reentrant"), ("delayed", "reentrant")],
    )
    def test_aot_eager_is_eager(self, recipe, checkpoint):
        """fullgraph (torch's checkpoint, either kind, inside the compiled model too), one graph, no graph break, no
        recompilation after step 2; everything bitwise eager's without checkpointing."""
        rec = DELAYED if recipe == "delayed" else ss.CurrentScaling()
        model, opt, manager = managed(rec, checkpoint=checkpoint)
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        data = batches()
        got = run_steps(model, opt, manager, data[:2], Record(), call=compiled)
        graphs = counters["stats"]["unique_graphs"]
        torch._dynamo.config.error_on_recompile = True
        run_steps(model, opt, manager, data[2:], got, call=compiled)
        assert counters["stats"]["unique_graphs"] == graphs == 1
        assert not counters["graph_break"]
        want = train(rec)
        assert_same_training(got, want)
        assert_same_state(got, want)

    def test_inductor_delayed(self):
        """Inductor, delayed scaling: the manager's state after every step is bitwise eager's; parameters
        stay within 1e-6 of eager's (Inductor's fused kernels round some products' last bit differently,
        as in torchao's own compiled training: measured <= 1e-7 relative)."""
        got = train(DELAYED, compile_kwargs={"backend": "inductor"})
        assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
        want = train(DELAYED)
        assert_same_state(got, want)
        for step, (a, b) in enumerate(zip(got.params, want.params, strict=True)):
            for key in a:
                torch.testing.assert_close(a[key], b[key], rtol=1e-6, atol=1e-6, msg=f"{key} at step {step}")

    def test_inductor_current_is_torchao_inductor(self):
        """Inductor, current scaling: bitwise torchao's own model compiled by Inductor (losses, outputs,
        gradients, parameters)."""
        theirs = torchao_convert(MLP(), config=CONFIG)
        compiled = torch.compile(theirs, backend="inductor")
        opt = torch.optim.AdamW(theirs.parameters(), lr=0.01)
        ref = run_steps(theirs, opt, None, batches(), Record(), call=compiled)
        torch._dynamo.reset()
        assert_same_training(train(ss.CurrentScaling(), compile_kwargs={"backend": "inductor"}), ref)


class TestPersistence:
    """Save mid-run, load into fresh objects, continue == never stopped."""

    def test_resume_is_uninterrupted(self, tmp_path):
        """manager, model and optimizer state saved after step 2 (torch.save, weights_only load), loaded into
        a fresh model, manager and optimizer; steps 3-5 bitwise those of the uninterrupted run."""
        data = batches()
        want = train(DELAYED)
        model, opt, manager = managed(DELAYED)
        first = run_steps(model, opt, manager, data[:2], Record())
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "scaling": manager.state_dict()},
                   tmp_path / "ckpt.pt")
        del model, opt, manager
        ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
        model, opt, manager = managed(DELAYED)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.5)  # make sure the loaded values, not the fresh initialization, are used
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        manager.load_state_dict(ckpt["scaling"])
        got = run_steps(model, opt, manager, data[2:], first)
        assert_same_training(got, want)
        assert_same_state(got, want)


class TestEvaluation:
    """An evaluation pass (torch.no_grad(), no phase) records nothing."""

    def test_no_grad_records_nothing(self):
        """The state is unchanged by an evaluation forward, and training with evaluation passes between
        steps is bitwise training without them."""
        model, opt, manager = managed(DELAYED)
        run_steps(model, opt, manager, batches(1), Record())
        before = manager.state_dict()
        with torch.no_grad():
            model(torch.randn(2, 8, 32) * 100)
        after = manager.state_dict()
        for key in ("amax_history", "scale", "step_amax"):
            assert torch.equal(before[key], after[key])
        with_eval = train(DELAYED, evaluate=True)
        without = train(DELAYED)
        assert_same_training(with_eval, without)
        assert_same_state(with_eval, without)


def _axiswise_input() -> Float8LinearConfig:
    return Float8LinearConfig(cast_config_input=CastConfig(scaling_granularity=ScalingGranularity.AXISWISE),
                              cast_config_weight=CastConfig(scaling_granularity=ScalingGranularity.AXISWISE))


def _disabled() -> Float8LinearConfig:
    # the weight-gradient product in high precision (as torchao's "rowwise_with_gw_hp" does)
    return Float8LinearConfig(
        cast_config_input_for_grad_weight=CastConfig(scaling_type=ScalingType.DISABLED),
        cast_config_grad_output_for_grad_weight=CastConfig(scaling_type=ScalingType.DISABLED),
    )


#: (config, recipe, message fragments naming the problem and the fix)
REFUSED_CONFIGS: dict[str, tuple[Callable[[], Float8LinearConfig], ss.Recipe, tuple[str, ...]]] = {
    "rowwise": (lambda: Float8LinearConfig.from_recipe_name("rowwise"), DELAYED,
                ("axiswise", "tensorwise", "ss.RowwiseScaling", "ss.nn.convert")),
    "rowwise_with_gw_hp": (lambda: Float8LinearConfig.from_recipe_name("rowwise_with_gw_hp"), DELAYED,
                           ("axiswise", "from_recipe_name('tensorwise')")),
    "axiswise": (_axiswise_input, DELAYED, ("cast_config_input", "axiswise")),
    "disabled": (_disabled, DELAYED, ("disabled", "high precision", "Float8LinearConfig()")),
    "fsdp_all_gather": (lambda: Float8LinearConfig(enable_fsdp_float8_all_gather=True), DELAYED,
                        ("enable_fsdp_float8_all_gather=False", "ss.nn.convert(model, manager, fp8_all_gather=True)")),
    "fine_rowwise": (Float8LinearConfig, ss.RowwiseScaling(), ("RowwiseScaling", "ss.DelayedScaling", "ss.nn.convert")),
    "fine_block": (Float8LinearConfig, ss.BlockScaling(), ("BlockScaling", "ss.CurrentScaling")),
    "fine_mxfp8": (Float8LinearConfig, ss.MXFP8Scaling(), ("MXFP8Scaling", "one scale per tensor")),
    "format_e4m3": (Float8LinearConfig, ss.DelayedScaling(format=ss.Format.E4M3),
                    ("GRAD_OUTPUT", "torch.float8_e5m2", "format=ss.Format.HYBRID")),
    "format_config_e4m3": (lambda: Float8LinearConfig(
        cast_config_input=CastConfig(target_dtype=torch.float8_e4m3fn),
        cast_config_weight=CastConfig(target_dtype=torch.float8_e4m3fn),
        cast_config_grad_output=CastConfig(target_dtype=torch.float8_e4m3fn)), ss.CurrentScaling(),
        ("GRAD_OUTPUT", "format=ss.Format.E4M3")),
    "format_none_matches": (lambda: Float8LinearConfig(
        cast_config_input=CastConfig(target_dtype=torch.float8_e5m2)), DELAYED,
        ("INPUT", "no ss.Format casts those dtypes")),
    "power_of_2": (lambda: Float8LinearConfig(round_scales_to_power_of_2=True), DELAYED,
                   ("round_scales_to_power_of_2=True", "power_of_2=True")),
}


class TestRefusals:
    """Each refusal raises its documented error, names the fix, and leaves the model unchanged."""

    @pytest.mark.parametrize("case", sorted(REFUSED_CONFIGS))
    def test_config_or_recipe(self, case):
        """torchao's row-wise and axiswise recipes, disabled casts, its FSDP float8 all-gather, fine-grained
        managers, formats and power-of-two rounding that differ between config and recipe."""
        make, recipe, fragments = REFUSED_CONFIGS[case]
        manager = ss.ScalingStateManager(recipe, backend="emulation")
        model = MLP()
        with pytest.raises(ConversionError) as info:
            convert_to_float8_training(model, manager, config=make())
        for fragment in fragments:
            assert fragment in str(info.value), (fragment, str(info.value))
        assert isinstance(info.value, ScaleStateError) and isinstance(info.value, ValueError)
        assert type(model.head) is nn.Linear and not manager.handles

    def test_layer_constructor_refuses_too(self):
        """ManagedFloat8Linear itself applies the same checks."""
        manager = ss.ScalingStateManager(ss.RowwiseScaling(), backend="emulation")
        with pytest.raises(ConversionError, match=re.escape("ss.nn.convert(model, manager)")):
            ManagedFloat8Linear(16, 16, config=CONFIG, manager=manager, name="fc")

    @pytest.mark.parametrize(
        ("argument", "value", "expect"),
        [
            ("model", [nn.Linear(4, 4)], "model must be a torch.nn.Module"),
            ("manager", object(), "ss.ScalingStateManager("),
            ("config", {"emulate": True}, "config must be a torchao.float8.Float8LinearConfig"),
            ("module_filter_fn", "head", "module_filter_fn(module, fqn) -> bool"),
        ],
        ids=["model", "manager", "config", "filter"],
    )
    def test_wrong_types(self, argument, value, expect):
        """A model that is not a Module, a manager that is not one, a config not torchao's, a filter not callable."""
        args: dict[str, Any] = {"model": MLP(), "manager": ss.ScalingStateManager(DELAYED, backend="emulation"),
                                "config": CONFIG, "module_filter_fn": None, argument: value}
        with pytest.raises(ConversionTypeError, match=re.escape(expect)) as info:
            convert_to_float8_training(args.pop("model"), args.pop("manager"), **args)
        assert isinstance(info.value, TypeError) and isinstance(info.value, ConversionError)

    def test_no_linear(self):
        """A model without torch.nn.Linear, or a filter that selects none, is refused."""
        manager = ss.ScalingStateManager(DELAYED, backend="emulation")
        with pytest.raises(ConversionError, match="Conv1d contains none"):
            convert_to_float8_training(nn.Conv1d(4, 4, 1), manager, config=CONFIG)
        with pytest.raises(ConversionError, match="none passes module_filter_fn"):
            convert_to_float8_training(MLP(), manager, config=CONFIG, module_filter_fn=lambda m, fqn: False)

    def test_already_float8(self):
        """Layers converted by torchao, by this function or by ss.nn.convert are refused, not wrapped again."""
        manager = ss.ScalingStateManager(DELAYED, backend="emulation")
        for model in (torchao_convert(MLP(), config=CONFIG), ss.nn.convert(MLP(), manager)):
            with pytest.raises(ConversionError, match="already float8 layers"):
                convert_to_float8_training(model, manager, config=CONFIG)
        other = ss.ScalingStateManager(DELAYED, backend="emulation")
        model = convert_to_float8_training(MLP(), other, config=CONFIG)
        with pytest.raises(ConversionError, match=re.escape("['body.0', 'body.2', 'head']")):
            convert_to_float8_training(model, other, config=CONFIG)

    def test_taken_slot_name(self):
        """A path already registered in the manager is a SlotError, raised before anything changes."""
        manager = ss.ScalingStateManager(DELAYED, backend="emulation")
        manager.register("head")
        model = MLP()
        with pytest.raises(SlotError, match="'head'"):
            convert_to_float8_training(model, manager, config=CONFIG)
        assert type(model.body[0]) is nn.Linear and list(manager.handles) == ["head"]


def test_missing_extra(monkeypatch):
    """Without torchao, importing the adapter raises an ImportError naming the extra to install."""
    for name in [n for n in sys.modules if n == "torchao" or n.startswith("torchao.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.delitem(sys.modules, "scalestate.integrations.torchao")
    monkeypatch.delitem(sys.modules, "scalestate.integrations._torchao_layer")
    with pytest.raises(ImportError, match=re.escape('pip install "scalestate[torchao]"')):
        importlib.import_module("scalestate.integrations.torchao")


def test_docs_example(monkeypatch, tmp_path):
    """The first python block of docs/integrations/torchao.md runs as written, and its checkpoint loads."""
    monkeypatch.chdir(tmp_path)
    text = (ROOT / "docs" / "integrations" / "torchao.md").read_text()
    block = re.findall(r"```python\n(.*?)```", text, flags=re.S)[0]
    namespace: dict[str, Any] = {}
    exec(compile(block, "docs/integrations/torchao.md", "exec"), namespace)
    manager = namespace["manager"]
    assert manager.iteration == 4 and list(manager.handles) == ["0"]
    assert (manager.state_dict()["amax_history"][:, -4:] > 0).all()  # 4 steps: each slot recorded each step
    saved = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert torch.equal(saved["scaling"]["scale"], manager.state_dict()["scale"])


@pytest.mark.parametrize("obj", [ManagedFloat8Linear, convert_to_float8_training], ids=lambda o: o.__name__)
def test_docstring_examples(obj):
    """The runnable example in each public docstring runs and prints what it says."""
    import doctest

    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    tests = doctest.DocTestFinder(recurse=False).find(obj, globs={})
    assert tests and any(t.examples for t in tests)
    for t in tests:
        runner.run(t)
    assert runner.failures == 0
