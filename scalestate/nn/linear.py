"""`Linear`: a drop-in ``torch.nn.Linear`` whose three GEMMs run in FP8."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from scalestate.backends import Backend
from scalestate.errors import ArgumentTypeError, CastError
from scalestate.handle import ScalingHandle
from scalestate.manager import ScalingStateManager
from scalestate.nn import tensor_parallel
from scalestate.nn.fsdp import plain_state_dict, quantize_weight, wrap_weight
from scalestate.quantized import Quantized
from scalestate.recipe import Role

__all__ = ["Linear", "linear"]



#: Casts the output gradient: ``cast_grad(dy, transpose) -> Quantized``.
GradCaster = Callable[[Tensor, bool], Quantized]


class _FP8Linear(torch.autograd.Function):
    """``y = x @ w.T + b`` with x and w already cast; backward casts ``dy`` with
    ``cast_grad`` and runs both of its products in FP8. Only FP8 tensors (and their
    scales) are saved. ``add_bias=False`` leaves the bias out of this rank's output
    (a partial sum that another rank adds it to) while still giving it its gradient.
    ``weight_transposed=True``: the ``weight`` parameter is stored ``(in, out)`` (``qw``
    is still its cast in the ``(out, in)`` orientation); its gradient is returned transposed."""

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        qx: Quantized,
        qw: Quantized,
        cast_grad: GradCaster,
        backend: Backend,
        out_dtype: torch.dtype,
        add_bias: bool = True,
        weight_transposed: bool = False,
    ) -> Tensor:
        ctx.weight_transposed = weight_transposed
        ctx.fine = qx.tile is not None
        if ctx.fine:
            # Each product takes its operands scaled along its own contraction axis:
            # x and w along in_features here; w along out_features and x along tokens later.
            out = _product(backend, qx.rowwise(), qw.rowwise().t(), out_dtype, bias if add_bias else None)
            ctx.x_is_transposed = True
            x_saved, w_saved = qx.columnwise(), qw  # backward needs x only along tokens
        else:
            out = _product(backend, qx, qw.t(), out_dtype, bias if add_bias else None)
            # The weight-gradient product needs x in the other layout: keep only that copy when the cast made it.
            ctx.x_is_transposed = qx.transposed is not None
            x_saved = qx if qx.other is None else Quantized.of(qx.other)
            w_saved = qw
        x_tensors, ctx.x_layout = x_saved.flatten()
        w_tensors, ctx.w_layout = w_saved.flatten()
        ctx.n_x = len(x_tensors)
        ctx.save_for_backward(*x_tensors, *w_tensors)
        ctx.cast_grad = cast_grad
        ctx.backend = backend
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        saved = ctx.saved_tensors
        qx = Quantized.unflatten(saved[: ctx.n_x], ctx.x_layout)
        qw = Quantized.unflatten(saved[ctx.n_x :], ctx.w_layout)
        cast_grad: GradCaster = ctx.cast_grad
        backend: Backend = ctx.backend
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_x = grad_w = grad_b = None
        if need_x or need_w:
            qg = cast_grad(grad_out, ctx.x_is_transposed)
            if ctx.fine:
                if need_x:  # dy @ w: both along out_features
                    grad_x = _product(backend, qg.rowwise(), qw.columnwise().t(), x_dtype)
                if need_w:  # dy.T @ x: both along tokens (qx is x.t() cast along its rows)
                    grad_w = _product(backend, qg.columnwise(), qx.t(), w_dtype)
            else:
                if need_x:
                    grad_x = _product(backend, qg, qw, x_dtype)
                if need_w:
                    grad_w = _product(backend, qg.t(), qx.t() if ctx.x_is_transposed else qx, w_dtype)
        if need_b:
            grad_b = grad_out.sum(0, dtype=torch.float32).to(b_dtype)
        if grad_w is not None and ctx.weight_transposed:
            grad_w = grad_w.t()  # the same values, in the parameter's (in, out) layout
        return grad_x, grad_w, grad_b, None, None, None, None, None, None, None


def _cast_grad(handle: ScalingHandle, grad_out: Tensor, transpose: bool) -> Quantized:
    return handle.quantize(grad_out, Role.GRAD_OUTPUT, transpose=transpose)


def _product(
    backend: Backend, a: Quantized, b: Quantized, out_dtype: torch.dtype, bias: Tensor | None = None
) -> Tensor:
    """The backend's FP8 product, with autocast off (the operands are FP8 and accumulate in
    float32); the autocast context is entered only where autocast is on, as it costs microseconds."""
    device_type = a.data.device.type
    if not torch.is_autocast_enabled(device_type):
        return backend.scaled_mm(a, b, out_dtype=out_dtype, bias=bias)
    with torch.autocast(device_type, enabled=False):
        return backend.scaled_mm(a, b, out_dtype=out_dtype, bias=bias)


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
    qx = handle.quantize(x2, Role.INPUT, transpose=transpose)
    if weight_transposed:
        # Cast the parameter itself (the cache keys on it), in both orientations, and take the
        # (out, in) one as data: the very layout a torch.nn.Linear weight's cast has.
        qw = quantize_weight(handle, weight, transpose=True).t()
        if not transpose:
            qw = qw.rowwise()
    else:
        qw = quantize_weight(handle, weight, transpose=transpose)
    # torch types Function.apply as untyped; its result here is the forward's Tensor
    cast_grad = functools.partial(_cast_grad, handle)
    if weight_transposed:
        out: Tensor = _FP8Linear.apply(  # type: ignore[no-untyped-call]
            x2, weight, bias, qx, qw, cast_grad, backend, out_dtype, True, True
        )
    else:
        out = _FP8Linear.apply(x2, weight, bias, qx, qw, cast_grad, backend, out_dtype)  # type: ignore[no-untyped-call]
    return out if x.dim() == 2 else out.reshape(*x.shape[:-1], out_features)


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


class WeightSlotModule(torch.nn.Module):
    """What an FP8 module with one ``weight`` parameter shares (``Linear``, ``Conv1D``):
    its slot, its FP8 all-gather wrapping, and dropping its cached cast when FSDP2 sets the weight."""

    handle: ScalingHandle
    #: Whether FSDP2 all-gathers the weight in FP8 (fixed at construction).
    fp8_all_gather: bool

    def bind_slot(self, manager: ScalingStateManager, name: str | None, default: str, fp8_all_gather: bool) -> None:
        """Register the slot (``name``, or ``default`` made unique) and wrap the weight for an FP8 all-gather."""
        self.handle = manager.register(name if name is not None else _free_name(manager, default), roles=tuple(Role))
        self.fp8_all_gather = fp8_all_gather
        if fp8_all_gather:
            # setattr: subclasses type `weight` as their bases do (Tensor, Parameter); this works on each
            setattr(self, "weight", wrap_weight(self.get_parameter("weight"), self.handle))  # noqa: B010
            # torch leaves register_state_dict_post_hook untyped
            self.register_state_dict_post_hook(plain_state_dict)  # type: ignore[no-untyped-call]

    def __setattr__(self, name: str, value: Any) -> None:
        """As ``torch.nn.Module``'s; a new ``weight`` drops the slot's cached weight cast.

        FSDP2 sets the weight at every all-gather and reshard (a module that
        overrides ``__setattr__`` gets the call), and refills the unsharded
        weight in place with its version counter preserved: without this, a
        cast cached before an in-place edit of the sharded weight could be
        reused. The FP8 all-gather keys its casts on the shard instead.
        """
        super().__setattr__(name, value)
        if name == "weight" and not self.__dict__.get("fp8_all_gather", True):
            self.handle.invalidate_casts()


class Linear(WeightSlotModule, torch.nn.Linear):
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


def check_module_arguments(manager: object, fp8_all_gather: object) -> None:
    """The checks of an FP8 module's ``manager`` and ``fp8_all_gather`` arguments.

    Raises:
        ArgumentTypeError: ``manager`` is not a manager, or ``fp8_all_gather`` not a bool.
        CastError: ``fp8_all_gather=True`` with a fine-grained recipe.
    """
    if not isinstance(manager, ScalingStateManager):
        raise ArgumentTypeError(f"manager must be a ScalingStateManager; got {type(manager).__name__}")
    if not isinstance(fp8_all_gather, bool):
        raise ArgumentTypeError(f"fp8_all_gather must be True or False; got {fp8_all_gather!r}")
    if fp8_all_gather and manager.recipe.granularity(Role.WEIGHT) is not None:
        raise CastError(
            f"fp8_all_gather=True casts each FSDP shard with its slot's one per-tensor scale; "
            f"{type(manager.recipe).__name__} scales rows, tiles or blocks. Use fp8_all_gather=False "
            "with this recipe (FSDP2 then gathers the high-precision weight), or a per-tensor recipe"
        )


def _free_name(manager: ScalingStateManager, base: str) -> str:
    taken = manager.handles
    if base not in taken:
        return base
    i = 1
    while f"{base}_{i}" in taken:
        i += 1
    return f"{base}_{i}"
