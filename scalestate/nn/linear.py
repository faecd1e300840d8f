"""`Linear`: a drop-in ``torch.nn.Linear`` whose three GEMMs run in FP8."""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from scalestate.backends import Backend
from scalestate.errors import CastError
from scalestate.handle import ScalingHandle
from scalestate.manager import ScalingStateManager
from scalestate.nn import tensor_parallel
from scalestate.nn.base import WeightSlotModule, check_module_arguments, quantize_weight
from scalestate.nn.compiled_linear import compiled_linear
from scalestate.nn.function import FP8LinearFunction, keep_saved_input
from scalestate.quantized import Quantized
from scalestate.recipe import Role

__all__ = ["Linear", "linear"]


def _cast_grad(handle: ScalingHandle, grad_out: Tensor, transpose: bool) -> Quantized:
    return handle.quantize(grad_out, Role.GRAD_OUTPUT, transpose=transpose)


def linear(
    x: Tensor, weight: Tensor, bias: Tensor | None, handle: ScalingHandle, *, weight_transposed: bool = False
) -> Tensor:
    """``torch.nn.functional.linear`` in FP8 through ``handle``'s slots.

    ``handle`` needs the roles INPUT, WEIGHT and GRAD_OUTPUT. ``x`` may have
    any number of leading dimensions. The output has ``x``'s dtype, or the
    autocast dtype where autocast is on (the FP8 products ignore autocast:
    their operands are FP8 and they accumulate in float32). Where the
    backend's products need operands in the other layout, the casts make
    transposed copies in the same pass. DTensor operands (tensor parallelism)
    go to :func:`scalestate.nn.tensor_parallel.linear`.

    Args:
        x: the input, ``(..., in_features)``.
        weight: ``(out_features, in_features)``, as ``torch.nn.Linear`` keeps it;
            with ``weight_transposed=True``, ``(in_features, out_features)``.
        bias: ``(out_features,)`` or ``None``.
        handle: the slots the casts go through.
        weight_transposed: the weight is stored ``(in_features, out_features)``,
            as transformers' ``Conv1D`` keeps it (``y = x @ weight + bias``).
            The parameter itself is cast, so the weight-cast cache hits as for
            a ``torch.nn.Linear`` weight; the cast also makes the other
            orientation, and the products and their bits are those of
            ``linear(x, weight.t().contiguous(), bias, handle)``. Its gradient
            has the parameter's shape. Not with DTensor (tensor-parallel) weights.

    Returns:
        ``(..., out_features)``.

    Raises:
        CastError: ``x``'s last dimension does not match the weight, some
            operands are on the ``meta`` device and some are not, or a
            transposed weight is a DTensor.
    """
    if tensor_parallel.is_distributed(x, weight, bias):
        if weight_transposed:
            raise CastError(
                f"slot {handle.name!r}: tensor parallelism shards weights stored (out_features, in_features); "
                "got weight_transposed=True. Store the weight as torch.nn.Linear does (pass weight.t() as a "
                "parameter of its own) to shard it"
            )
        return tensor_parallel.linear(x, weight, bias, handle)
    in_features, out_features = weight.shape[::-1] if not weight_transposed else weight.shape
    if x.shape[-1] != in_features:
        raise CastError(
            f"slot {handle.name!r}: input has {x.shape[-1]} features in its last dimension, "
            f"the weight expects {in_features}"
        )
    if x.is_meta or weight.is_meta:
        return _meta_linear(x, weight.t() if weight_transposed else weight, bias, handle)
    device_type = x.device.type
    out_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    backend = handle.manager.backend
    # Fine-grained scales lie along one axis: every role is also cast along the other one.
    transpose = backend.wants_transposed(x.device) or handle.manager.recipe.granularity(Role.INPUT) is not None
    out = None
    if not weight_transposed and torch.compiler.is_compiling():
        out = compiled_linear(x2, weight, bias, handle, transpose, out_dtype)
    if out is None:
        out = _through_casts(x2, weight, bias, handle, backend, transpose, out_dtype, weight_transposed)
    return out if x.dim() == 2 else out.reshape(*x.shape[:-1], out_features)


def _through_casts(
    x2: Tensor, weight: Tensor, bias: Tensor | None, handle: ScalingHandle, backend: Backend, transpose: bool,
    out_dtype: torch.dtype, weight_transposed: bool,
) -> Tensor:
    """:func:`linear` of 2-d ``x2`` through the handle's casts and :class:`FP8LinearFunction`."""
    qx = handle.quantize(x2, Role.INPUT, transpose=transpose)
    if weight_transposed:
        # Cast the parameter itself (the cache keys on it), in both orientations, and take the
        # (out, in) one as data: the very layout a torch.nn.Linear weight's cast has.
        qw = quantize_weight(handle, weight, transpose=True).t()
        if not transpose:
            qw = qw.rowwise()
    else:
        qw = quantize_weight(handle, weight, transpose=transpose)
    keep_saved_input(backend, qx, weight)
    # torch types Function.apply as untyped; its result here is the forward's Tensor
    cast_grad = functools.partial(_cast_grad, handle)
    if weight_transposed:
        out: Tensor = FP8LinearFunction.apply(  # type: ignore[no-untyped-call]
            x2, weight, bias, qx, qw, cast_grad, backend, out_dtype, True, True
        )
    else:
        out = FP8LinearFunction.apply(x2, weight, bias, qx, qw, cast_grad, backend, out_dtype)  # type: ignore[no-untyped-call]
    return out


def _meta_linear(x: Tensor, weight: Tensor, bias: Tensor | None, handle: ScalingHandle) -> Tensor:
    """Shape inference on the ``meta`` device: an output of the FP8 product's shape and of
    ``x``'s dtype (autocast has no meta device), with its autograd graph, made by
    ``torch.nn.functional.linear``; nothing is cast or recorded, and the manager is untouched."""
    tensors = {"input": x, "weight": weight, "bias": bias}
    off_meta = {key: str(t.device) for key, t in tensors.items() if t is not None and not t.is_meta}
    if off_meta:
        raise CastError(
            f"slot {handle.name!r}: some operands are on the meta device and some are not ({off_meta}); "
            "materialize the module first (model.to_empty(device=...), then initialize its parameters) "
            "and pass an input on that device, or pass a meta input to infer shapes"
        )
    b = None if bias is None else bias.to(x.dtype)
    return torch.nn.functional.linear(x, weight.to(x.dtype), b)


class Linear(WeightSlotModule, torch.nn.Linear):
    """``torch.nn.Linear`` with input, weight and gradient cast to FP8 by a manager.

    Forward: ``x`` and the weight are cast (the weight cast is cached until the
    weight or the scales change) and multiplied in FP8. Backward: the output
    gradient is cast and both products (input and weight gradients) run in FP8;
    the only activation saved is the FP8 input (the emulation backend, which
    multiplies in float32, also keeps a float32 copy of it until the backward,
    within its ``saved_copy_bytes``). Parameters and ``state_dict`` keys are
    those of ``torch.nn.Linear``.

    Args:
        in_features, out_features, bias: as in ``torch.nn.Linear``.
        manager: the manager that owns its scaling state.
        name: its slot name (default: ``"linear"``, ``"linear_1"``, ... unique
            in the manager); :func:`scalestate.nn.convert` uses module paths.
        device, dtype: of the parameters, as in ``torch.nn.Linear``; on
            ``"meta"`` a forward infers shapes only (nothing is cast or
            recorded) until ``to_empty(device=...)`` and an initialization
            such as :meth:`reset_parameters` materialize it.
        fp8_all_gather: under FSDP2 (``fully_shard``), all-gather the weight in
            FP8, cast with its slot's scale before the gather: half the bytes
            of a bf16 all-gather, the same numbers (see
            :mod:`scalestate.nn.fsdp`). The weight parameter is then an
            :class:`~scalestate.nn.fsdp.FP8AllGatherWeight`, which acts as a
            plain tensor outside FSDP. The manager must reduce across FSDP's
            shard group (its default, the world group, does).

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
        fp8_all_gather: bool = False,
    ) -> None:
        check_module_arguments(manager, fp8_all_gather)
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.bind_slot(manager, name, "linear", fp8_all_gather)

    def forward(self, x: Tensor) -> Tensor:
        """FP8 ``x @ weight.T + bias``."""
        return linear(x, self.weight, self.bias, self.handle)

    def extra_repr(self) -> str:
        extra = ", fp8_all_gather=True" if self.fp8_all_gather else ""
        return f"{super().extra_repr()}, slot={self.handle.name!r}{extra}"
