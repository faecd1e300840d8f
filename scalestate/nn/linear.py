"""`Linear`: a drop-in ``torch.nn.Linear`` whose three GEMMs run in FP8."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from scalestate.handle import ScalingHandle
from scalestate.manager import ScalingStateManager
from scalestate.quantized import Quantized
from scalestate.recipe import Role

__all__ = ["Linear", "linear"]



class _FP8Linear(torch.autograd.Function):
    """``y = x @ w.T + b`` with x and w already cast; backward casts ``dy`` and
    runs both of its products in FP8. Only FP8 tensors are saved."""

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        x_data: Tensor,
        x_scale_inv: Tensor,
        w_data: Tensor,
        w_scale_inv: Tensor,
        handle: ScalingHandle,
        out_dtype: torch.dtype,
    ) -> Tensor:
        backend = handle.manager.backend
        qx, qw = Quantized(x_data, x_scale_inv), Quantized(w_data, w_scale_inv)
        with torch.autocast(x.device.type, enabled=False):
            out = backend.scaled_mm(qx, qw.t(), out_dtype=out_dtype, bias=bias)
        ctx.save_for_backward(x_data, x_scale_inv, w_data, w_scale_inv)
        ctx.handle = handle
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        x_data, x_scale_inv, w_data, w_scale_inv = ctx.saved_tensors
        handle: ScalingHandle = ctx.handle
        backend = handle.manager.backend
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_x = grad_w = grad_b = None
        with torch.autocast(grad_out.device.type, enabled=False):
            if need_x or need_w:
                qg = handle.quantize(grad_out, Role.GRAD_OUTPUT)
                if need_x:
                    grad_x = backend.scaled_mm(qg, Quantized(w_data, w_scale_inv), out_dtype=x_dtype)
                if need_w:
                    grad_w = backend.scaled_mm(qg.t(), Quantized(x_data, x_scale_inv), out_dtype=w_dtype)
            if need_b:
                grad_b = grad_out.sum(0, dtype=torch.float32).to(b_dtype)
        return grad_x, grad_w, grad_b, None, None, None, None, None, None


def linear(x: Tensor, weight: Tensor, bias: Tensor | None, handle: ScalingHandle) -> Tensor:
    """``torch.nn.functional.linear`` in FP8 through ``handle``'s slots.

    ``handle`` needs the roles INPUT, WEIGHT and GRAD_OUTPUT. ``x`` may have
    any number of leading dimensions. The output has ``x``'s dtype, or the
    autocast dtype where autocast is on (the FP8 products ignore autocast:
    their operands are FP8 and they accumulate in float32).
    """
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"slot {handle.name!r}: input has {x.shape[-1]} features in its last dimension, "
            f"the weight expects {weight.shape[1]}"
        )
    device_type = x.device.type
    out_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    qx = handle.quantize(x2, Role.INPUT)
    qw = handle.quantize(weight, Role.WEIGHT)
    # torch types Function.apply as untyped; its result here is the forward's Tensor
    out: Tensor = _FP8Linear.apply(  # type: ignore[no-untyped-call]
        x2, weight, bias, qx.data, qx.scale_inv, qw.data, qw.scale_inv, handle, out_dtype
    )
    return out.reshape(*lead, weight.shape[0])


class Linear(torch.nn.Linear):
    """``torch.nn.Linear`` with input, weight and gradient cast to FP8 by a manager.

    Forward: ``x`` and the weight are cast (the weight cast is cached until the
    weight or the scales change) and multiplied in FP8. Backward: the output
    gradient is cast and both products (input and weight gradients) run in FP8;
    the only activation saved is the FP8 input. Parameters and ``state_dict``
    keys are those of ``torch.nn.Linear``.

    Args:
        in_features, out_features, bias: as in ``torch.nn.Linear``.
        manager: the manager that owns its scaling state.
        name: its slot name (default: ``"linear"``, ``"linear_1"``, ... unique
            in the manager); :func:`scalestate.nn.convert` uses module paths.
        device, dtype: of the parameters, as in ``torch.nn.Linear``.

    Example:
        >>> import torch, scalestate as ss
        >>> m = ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation")
        >>> fc = ss.nn.Linear(32, 16, manager=m, name="fc")
        >>> fc(torch.randn(2, 5, 32)).shape
        torch.Size([2, 5, 16])
        >>> fc.handle
        <ScalingHandle('fc', roles=(INPUT, WEIGHT, GRAD_OUTPUT))>
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        manager: ScalingStateManager,
        name: str | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        if not isinstance(manager, ScalingStateManager):
            raise TypeError(f"manager must be a ScalingStateManager; got {type(manager).__name__}")
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.handle = manager.register(name if name is not None else _free_name(manager, "linear"), roles=tuple(Role))

    def forward(self, x: Tensor) -> Tensor:
        """FP8 ``x @ weight.T + bias``."""
        return linear(x, self.weight, self.bias, self.handle)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, slot={self.handle.name!r}"


def _free_name(manager: ScalingStateManager, base: str) -> str:
    taken = manager.handles
    if base not in taken:
        return base
    i = 1
    while f"{base}_{i}" in taken:
        i += 1
    return f"{base}_{i}"
