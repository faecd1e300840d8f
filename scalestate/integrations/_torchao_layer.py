"""The layer behind :mod:`scalestate.integrations.torchao`: private, imported from there.

:class:`ManagedFloat8Linear` (documented and exported by
:mod:`scalestate.integrations.torchao`), the two autograd functions that hand
the manager's casts to torchao's product, and the checks a torchao config and
a manager pass before they drive a layer together. Importing this module
imports torchao; without it, it raises
:class:`~scalestate.errors.MissingDependencyError`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from scalestate.errors import ConversionError, ConversionTypeError, MissingDependencyError
from scalestate.handle import ScalingHandle
from scalestate.manager import ScalingStateManager
from scalestate.nn.base import WeightSlotModule
from scalestate.recipe import Format, NVFP4Scaling, Role

try:
    from torchao.float8.config import Float8LinearConfig, ScalingGranularity, ScalingType
    from torchao.float8.float8_linear import Float8Linear, matmul_with_hp_or_float8_args
    from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole
    from torchao.float8.float8_utils import EPS as TORCHAO_EPS
except ImportError as exc:
    raise MissingDependencyError(
        "scalestate.integrations.torchao needs torchao (>= 0.18), which is not installed "
        f"({exc}); install the extra: pip install \"scalestate[torchao]\""
    ) from exc

__all__ = [
    "CAST_CONFIGS",
    "TORCHAO_EPS",
    "Float8Linear",
    "Float8LinearConfig",
    "ManagedFloat8Linear",
    "check_config",
    "dtypes_of",
    "format_of",
]

#: The cast configs of a ``Float8LinearConfig`` that cast each role (for each of its two products).
CAST_CONFIGS = {
    Role.INPUT: ("cast_config_input", "cast_config_input_for_grad_weight"),
    Role.WEIGHT: ("cast_config_weight", "cast_config_weight_for_grad_input"),
    Role.GRAD_OUTPUT: ("cast_config_grad_output", "cast_config_grad_output_for_grad_weight"),
}


class _AsFloat8(torch.autograd.Function):
    """Forward: ``data`` and ``scale`` as torchao's float8 training tensor standing for ``hp``.
    Backward: ``hp``'s gradient is the one torchao computes for that tensor, passed through."""

    @staticmethod
    def forward(ctx: Any, hp: Tensor, data: Tensor, scale: Tensor, mm_config: Any, role: Any) -> Tensor:
        out: Tensor = Float8TrainingTensor(data, scale, hp.dtype, linear_mm_config=mm_config, gemm_input_role=role)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None, None]:
        return grad, None, None, None, None


class _CastGradOutput(torch.autograd.Function):
    """Forward: identity. Backward: the output gradient cast through the ``GRAD_OUTPUT`` slot,
    as torchao's float8 training tensor (which torchao's backward then uses as it is)."""

    @staticmethod
    def forward(ctx: Any, out: Tensor, handle: ScalingHandle, mm_config: Any) -> Tensor:
        ctx.handle = handle
        ctx.mm_config = mm_config
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        q = ctx.handle.quantize(grad, Role.GRAD_OUTPUT)
        cast: Tensor = Float8TrainingTensor(
            q.data, q.scale, grad.dtype, linear_mm_config=ctx.mm_config, gemm_input_role=GemmInputRole.GRAD_OUTPUT
        )
        return cast, None, None


class ManagedFloat8Linear(WeightSlotModule, Float8Linear):  # type: ignore[misc]  # torchao ships no type information
    """torchao's float8 ``Linear`` whose input, weight and output-gradient casts a manager scales.

    Same products, kernels and ``torch.compile`` support as torchao's
    ``Float8Linear`` (of which it is a subclass); only the scales differ: they
    come from the manager's slots under the name :attr:`handle` was registered
    with. Parameters and ``state_dict`` keys are those of ``torch.nn.Linear``.
    Made by :func:`~scalestate.integrations.torchao.convert_to_float8_training`, or directly.

    Args:
        in_features, out_features, bias: as in ``torch.nn.Linear``.
        config: torchao's ``Float8LinearConfig`` (per-tensor scaling; see
            :func:`~scalestate.integrations.torchao.convert_to_float8_training` for what is refused).
        manager: owns the layer's scaling state.
        name: its slot name, unique in the manager.
        device, dtype: of the parameters, as in ``torch.nn.Linear``.

    Raises:
        ConversionError: the config or the manager's recipe is not served.
        ConversionTypeError: ``manager`` or ``config`` has the wrong type.
        SlotError: ``name`` is taken in ``manager``.

    Example:
        >>> import torch, scalestate as ss
        >>> from torchao.float8 import Float8LinearConfig
        >>> from scalestate.integrations.torchao import ManagedFloat8Linear
        >>> m = ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation")
        >>> fc = ManagedFloat8Linear(32, 16, config=Float8LinearConfig(emulate=True), manager=m, name="fc")
        >>> fc(torch.randn(4, 32)).shape
        torch.Size([4, 16])
        >>> fc.handle
        <ScalingHandle('fc', roles=(INPUT, WEIGHT, GRAD_OUTPUT))>
    """

    weight: Tensor
    bias: Tensor | None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        config: Float8LinearConfig,
        manager: ScalingStateManager,
        name: str,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        check_config(config, manager)
        super().__init__(in_features, out_features, bias, config=config, device=device, dtype=dtype)
        self.bind_slot(manager, name, "linear", fp8_all_gather=False)  # torchao's own all-gather is refused

    @classmethod
    def from_linear(
        cls, module: torch.nn.Linear, *, config: Float8LinearConfig, manager: ScalingStateManager, name: str
    ) -> ManagedFloat8Linear:
        """A layer that takes over ``module``'s parameter objects (so an optimizer built before keeps them)."""
        new = cls(
            module.in_features, module.out_features, bias=False, config=config, manager=manager, name=name,
            device="meta",
        )
        new.weight = module.weight
        new.bias = module.bias
        new.train(module.training)
        return new

    def forward(self, input: Tensor) -> Tensor:
        """torchao's float8 ``input @ weight.T + bias``, with the manager's casts."""
        # As torchao's Float8Linear: under CUDA autocast the input goes in the autocast dtype.
        if torch.is_autocast_enabled():
            input = input.to(torch.get_autocast_dtype("cuda"))
        handle, mm_config = self.handle, self.linear_mm_config
        qx = handle.quantize(input, Role.INPUT)
        qw = handle.quantize(self.weight, Role.WEIGHT)
        # torch types Function.apply as untyped; each result is the forward's Tensor
        x8: Tensor = _AsFloat8.apply(input, qx.data, qx.scale, mm_config, GemmInputRole.INPUT)  # type: ignore[no-untyped-call]
        w8_t: Tensor = _AsFloat8.apply(  # type: ignore[no-untyped-call]
            self.weight.t(), qw.data.t(), qw.scale, mm_config, GemmInputRole.WEIGHT
        )
        out: Tensor = matmul_with_hp_or_float8_args.apply(x8, w8_t, mm_config, self.config)
        out = _CastGradOutput.apply(out, handle, mm_config)  # type: ignore[no-untyped-call]
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, slot={self.handle.name!r}"


def check_config(config: Float8LinearConfig, manager: ScalingStateManager) -> None:
    """Raise unless ``config`` and ``manager`` can drive a :class:`ManagedFloat8Linear` together.

    Raises:
        ConversionTypeError: ``config`` is not a ``Float8LinearConfig`` or
            ``manager`` not a :class:`~scalestate.ScalingStateManager`.
        ConversionError: one of the refusals listed in
            :func:`~scalestate.integrations.torchao.convert_to_float8_training`.
    """
    if not isinstance(manager, ScalingStateManager):
        raise ConversionTypeError(
            f"manager must be a scalestate.ScalingStateManager; got {type(manager).__name__}. "
            "Make one with ss.ScalingStateManager(ss.DelayedScaling(), backend=...)"
        )
    if not isinstance(config, Float8LinearConfig):
        raise ConversionTypeError(
            f"config must be a torchao.float8.Float8LinearConfig (or None for its default); got "
            f"{type(config).__name__}"
        )
    recipe = manager.recipe
    fine = [role.name for role in Role if recipe.granularity(role) is not None]
    if fine:
        raise ConversionError(
            f"the manager's recipe {type(recipe).__name__} scales rows, tiles or blocks ({', '.join(fine)}); "
            "torchao's float8 training tensors carried through this adapter take one scale per tensor. Use "
            "ss.DelayedScaling or ss.CurrentScaling here, or keep the fine-grained recipe with scalestate's "
            "own layers: ss.nn.convert(model, manager)"
        )
    assert not isinstance(recipe, NVFP4Scaling)  # it scales blocks: refused above
    for fields in CAST_CONFIGS.values():
        for field in fields:
            cast = getattr(config, field)
            if cast.scaling_granularity is not ScalingGranularity.TENSORWISE:
                raise ConversionError(
                    f"config.{field} scales {cast.scaling_granularity.value} (torchao's 'rowwise' or "
                    "'rowwise_with_gw_hp' recipe, or an axiswise CastConfig); this adapter serves "
                    "tensorwise configs only. Use Float8LinearConfig.from_recipe_name('tensorwise') with a "
                    "per-tensor manager, or for row-wise scaling ss.nn.convert(model, "
                    "ss.ScalingStateManager(ss.RowwiseScaling(), ...)) without torchao"
                )
            if cast.scaling_type is not ScalingType.DYNAMIC:
                raise ConversionError(
                    f"config.{field} has scaling_type={cast.scaling_type.value}: that operand stays in high "
                    "precision, while this adapter casts every operand of the three products through the "
                    "manager. Use a config whose six cast configs are all dynamic (the default, "
                    "Float8LinearConfig()), or leave such layers out with module_filter_fn"
                )
    if config.enable_fsdp_float8_all_gather:
        raise ConversionError(
            "config.enable_fsdp_float8_all_gather=True: torchao's FSDP2 float8 all-gather casts the weight "
            "shards with its own dynamic scales, outside the manager. Set enable_fsdp_float8_all_gather=False "
            "(FSDP2 then gathers the high-precision weight and the manager casts it), or all-gather in FP8 "
            "with scalestate's own layers: ss.nn.convert(model, manager, fp8_all_gather=True)"
        )
    wanted = dtypes_of(config)
    mismatched = [role for role in Role if recipe.format.dtype(role) != wanted[role]]
    if mismatched:
        role = mismatched[0]
        match = format_of(config)
        fix = (
            f"make the manager with format=ss.Format.{match.name}"
            if match is not None
            else "no ss.Format casts those dtypes (INPUT and WEIGHT must share one)"
        )
        raise ConversionError(
            f"config.{CAST_CONFIGS[role][0]} casts {role.name} to {wanted[role]}, the manager's recipe "
            f"(format=ss.Format.{recipe.format.name}) to {recipe.format.dtype(role)}. Use one format on both "
            f"sides: {fix}, or give the config target dtypes matching the recipe's format"
        )
    if bool(config.round_scales_to_power_of_2) != recipe.power_of_2:
        raise ConversionError(
            f"config.round_scales_to_power_of_2={config.round_scales_to_power_of_2} but the manager's recipe "
            f"has power_of_2={recipe.power_of_2}; the manager makes every scale here. Set both the same "
            f"(e.g. ss.{type(recipe).__name__}(..., power_of_2={bool(config.round_scales_to_power_of_2)}))"
        )


def dtypes_of(config: Float8LinearConfig) -> dict[Role, torch.dtype]:
    """The FP8 dtype ``config`` casts each role to (that of the role's first product)."""
    return {role: getattr(config, CAST_CONFIGS[role][0]).target_dtype for role in Role}


def format_of(config: Float8LinearConfig) -> Format | None:
    """The format that casts each role to ``config``'s dtype, if one does."""
    wanted = dtypes_of(config)
    return next((f for f in Format if all(f.dtype(role) == wanted[role] for role in Role)), None)
