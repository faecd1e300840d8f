"""`GroupedLinear`: the experts of a mixture-of-experts layer, one FP8 slot per expert.

A grouped layer holds ``E`` weights in one ``[E, out, in]`` parameter and
multiplies the tokens routed to each expert, ordered by expert, by that
expert's weight. Each expert is a slot of its own, named ``"<name>.<e>"``,
with the roles of :class:`scalestate.nn.Linear` (INPUT, WEIGHT,
GRAD_OUTPUT): expert ``e`` of a ``GroupedLinear`` is, bitwise, what an
``ss.nn.Linear(in, out, manager=m, name=f"{name}.{e}")`` holding
``weight[e]`` would be on that expert's tokens (outputs, both gradients,
histories and scales), in every recipe. An expert that receives no tokens
casts nothing and records nothing, so ``step()`` leaves its history and scale
as they were; under ``torch.distributed`` its slots are reduced like any
other (the manager's one all-reduce per step), so no rank ever waits on an
expert that ran elsewhere.

:func:`grouped_linear` is the functional form, on any ``[E, out, in]`` tensor
and a sequence of handles; :mod:`scalestate.integrations.transformers_moe`
builds Hugging Face experts on it.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from scalestate.backends import Backend
from scalestate.errors import ArgumentTypeError, ArgumentValueError, CastError
from scalestate.handle import ScalingHandle
from scalestate.manager import ScalingStateManager
from scalestate.nn.base import free_name
from scalestate.nn.function import backward_products, forward_product
from scalestate.quantized import Quantized
from scalestate.recipe import Role

__all__ = [
    "ExpertViews",
    "GroupedFP8LinearFunction",
    "GroupedLinear",
    "grouped_linear",
    "quantize_grouped",
    "register_experts",
]


class ExpertViews:
    """The per-expert views of one ``[E, out, in]`` weight that its casts read, made once.

    The weight-cast cache keys each cast on the very tensor cast (its
    identity, version and storage address). A fresh ``weight[e]`` at every
    forward would miss it every time; these views are made once per weight
    object and storage, and share the weight's version counter, so an
    optimizer step (or any in-place edit) invalidates their casts exactly as
    it does a ``torch.nn.Linear`` weight's. They are detached: the product's
    gradient reaches the parameter through the forward's own ``unbind``.
    """

    def __init__(self) -> None:
        self._source: weakref.ref[Tensor] | None = None
        self._data_ptr = -1
        self._views: tuple[Tensor, ...] = ()

    def of(self, weight: Tensor) -> tuple[Tensor, ...]:
        """``weight.detach().unbind(0)``, the same objects while ``weight`` is the same tensor at the same address."""
        if self._source is None or self._source() is not weight or self._data_ptr != weight.data_ptr():
            self._views = weight.detach().unbind(0)
            self._source, self._data_ptr = weakref.ref(weight), weight.data_ptr()
        return self._views

    def clear(self) -> None:
        """Forget the views (the next forward makes new ones, so their casts are made again)."""
        self._source, self._data_ptr, self._views = None, -1, ()


def register_experts(
    manager: ScalingStateManager, name: str, num_experts: int, *, reduce: bool = True, first: int = 0
) -> tuple[ScalingHandle, ...]:
    """Register one slot per expert, named ``"<name>.<e>"`` for ``e`` in ``first .. first + num_experts - 1``,
    each with every role of :class:`scalestate.nn.Linear`; ``reduce=False`` makes them rank-local
    (expert parallelism: experts that live on one rank only)."""
    return tuple(
        manager.register(f"{name}.{e}", roles=tuple(Role), reduce=reduce) for e in range(first, first + num_experts)
    )


def _group_sizes(group_sizes: Tensor | Sequence[int], n_experts: int, n_tokens: int, where: str) -> list[int]:
    """The token counts as Python ints, checked (a tensor is read once: one host synchronization)."""
    if isinstance(group_sizes, Tensor):
        if group_sizes.dim() != 1 or group_sizes.is_floating_point() or group_sizes.is_complex():
            raise ArgumentTypeError(
                f"{where}: group_sizes must be a 1-d integer tensor (tokens per expert); "
                f"got shape {tuple(group_sizes.shape)}, {group_sizes.dtype}"
            )
        sizes: list[int] = group_sizes.tolist()
    elif isinstance(group_sizes, Sequence) and all(
        isinstance(n, int) and not isinstance(n, bool) for n in group_sizes
    ):
        sizes = list(group_sizes)
    else:
        raise ArgumentTypeError(
            f"{where}: group_sizes must be a 1-d integer tensor or a sequence of ints; got {group_sizes!r}"
        )
    if len(sizes) != n_experts:
        raise ArgumentValueError(f"{where}: group_sizes has {len(sizes)} entries for {n_experts} experts")
    if any(n < 0 for n in sizes):
        raise ArgumentValueError(f"{where}: group_sizes must be non-negative; got {sizes}")
    if sum(sizes) != n_tokens:
        raise ArgumentValueError(
            f"{where}: group_sizes sums to {sum(sizes)}, but the input has {n_tokens} tokens; pass the "
            "tokens ordered by expert and the number routed to each (zeros for experts with none)"
        )
    return sizes


def quantize_grouped(
    handles: Sequence[ScalingHandle],
    x: Tensor,
    group_sizes: Tensor | Sequence[int],
    role: Role,
    *,
    transpose: bool = False,
) -> tuple[Quantized | None, ...]:
    """Cast each group of ``x``'s rows for ``role`` through its own handle: group ``g`` (rows
    ``sum(group_sizes[:g]) .. sum(group_sizes[:g + 1])``) as ``handles[g].quantize(x_g, role,
    transpose=transpose)`` would cast it, with the same bits and records.

    Where the backend takes grouped casts (see
    :class:`~scalestate.backends.GroupedCastRequest`) and the recipe scales per
    tensor, every group is cast in one backend call, with one
    accumulator update for all; otherwise, and for ``WEIGHT`` (whose casts are
    cached per tensor), one cast per group. Empty groups cast and record nothing.

    Args:
        handles: one per group, all of one manager, each registered with ``role``.
        x: ``(T, K)``, ordered by group.
        group_sizes: ``G`` non-negative row counts summing to ``T``.
        role: the role every group is cast for.
        transpose: also make each group's other orientation (see :meth:`ScalingHandle.quantize`).

    Returns:
        One :class:`~scalestate.Quantized` per group, ``None`` for an empty one.

    Raises:
        ArgumentTypeError, ArgumentValueError: bad handles or group sizes.
        CastError: ``x`` is not a 2-d floating-point tensor.
    """
    handles = tuple(handles)
    if not handles or not all(isinstance(h, ScalingHandle) for h in handles):
        raise ArgumentTypeError("quantize_grouped: handles must be a non-empty sequence of ScalingHandles")
    manager = handles[0].manager
    if any(h.manager is not manager for h in handles):
        raise ArgumentValueError("quantize_grouped: every handle must belong to one manager")
    if not isinstance(x, Tensor) or x.dim() != 2 or not x.is_floating_point():
        got = f"shape {tuple(x.shape)}, {x.dtype}" if isinstance(x, Tensor) else type(x).__name__
        raise CastError(f"quantize_grouped: x must be a 2-d floating-point tensor (rows by group); got {got}")
    sizes = _group_sizes(group_sizes, len(handles), x.shape[0], f"quantize_grouped {handles[0].name!r}...")
    return _cast_groups(handles, x, sizes, role, transpose)


def _cast_groups(
    handles: Sequence[ScalingHandle], x: Tensor, sizes: Sequence[int], role: Role, transpose: bool
) -> tuple[Quantized | None, ...]:
    """:func:`quantize_grouped` on checked arguments."""
    used = [g for g, n in enumerate(sizes) if n]
    out: list[Quantized | None] = [None] * len(sizes)
    if not used:
        return tuple(out)
    slots = [handles[g]._slot(role) for g in used]
    cast = handles[0].manager._cast_grouped(slots, x, [sizes[g] for g in used], transpose)
    for g, q in zip(used, cast, strict=True):
        out[g] = q
    return tuple(out)


class GroupedFP8LinearFunction(torch.autograd.Function):
    """Every used expert's ``x_e @ w_e.T + b_e`` from casts already made; backward casts the output
    gradient of all experts at once (:func:`quantize_grouped`) and runs each expert's two products as
    :class:`~scalestate.nn.function.FP8LinearFunction` does. Only FP8 tensors and scales are saved."""

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        used: tuple[int, ...],
        sizes: tuple[int, ...],
        qxs: list[Quantized],
        qws: list[Quantized],
        handles: tuple[ScalingHandle, ...],
        backend: Backend,
        out_dtype: torch.dtype,
    ) -> Tensor:
        outs: list[Tensor] = []
        tensors: list[Tensor] = []
        layouts: list[tuple[int, Any]] = []
        x_is_transposed = False
        for e, qx, qw in zip(used, qxs, qws, strict=True):
            out, x_saved, w_saved, x_is_transposed = forward_product(
                backend, qx, qw, out_dtype, None if bias is None else bias[e]
            )
            outs.append(out)
            for q in (x_saved, w_saved):
                flat, layout = q.flatten()
                tensors.extend(flat)
                layouts.append((len(flat), layout))
        ctx.save_for_backward(*tensors)
        ctx.layouts, ctx.used, ctx.sizes, ctx.handles, ctx.backend = layouts, used, sizes, handles, backend
        ctx.x_is_transposed = x_is_transposed
        ctx.shapes = (weight.shape, x.dtype, weight.dtype, None if bias is None else bias.dtype)
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        w_shape, x_dtype, w_dtype, b_dtype = ctx.shapes
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_x = grad_w = grad_b = None
        used, sizes = ctx.used, ctx.sizes
        if need_x or need_w:
            saved, at, ops = ctx.saved_tensors, 0, []
            for n, layout in ctx.layouts:
                ops.append(Quantized.unflatten(saved[at : at + n], layout))
                at += n
            qgs = _cast_groups([ctx.handles[e] for e in used], grad_out, sizes, Role.GRAD_OUTPUT, ctx.x_is_transposed)
            dtypes = (x_dtype if need_x else None, w_dtype if need_w else None)
            grads = [
                backward_products(ctx.backend, qg, ops[2 * i], ops[2 * i + 1], ctx.x_is_transposed, dtypes)
                for i, qg in enumerate(qgs)
                if qg is not None
            ]
            if need_x:
                parts = [gx for gx, _ in grads]
                grad_x = parts[0] if len(parts) == 1 else torch.cat(parts)  # type: ignore[arg-type]
            if need_w:
                grad_w = grad_out.new_zeros(w_shape, dtype=w_dtype)
                grad_w[list(used)] = torch.stack([gw for _, gw in grads])  # type: ignore[misc]
        if need_b:
            grad_b = grad_out.new_zeros((w_shape[0], w_shape[1]), dtype=b_dtype)
            for e, part in zip(used, grad_out.split(sizes), strict=True):  # type: ignore[no-untyped-call]
                grad_b[e] = part.sum(0, dtype=torch.float32).to(b_dtype)
        return grad_x, grad_w, grad_b, None, None, None, None, None, None, None


def grouped_linear(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    group_sizes: Tensor | Sequence[int],
    handles: Sequence[ScalingHandle],
    *,
    views: ExpertViews | None = None,
) -> Tensor:
    """Each expert's ``torch.nn.functional.linear`` on its own tokens, in FP8 through its own slots.

    Rows ``sum(group_sizes[:e]) .. sum(group_sizes[:e + 1])`` of ``x`` belong to
    expert ``e`` and are multiplied by ``weight[e]`` (plus ``bias[e]``) through
    ``handles[e]``, exactly as :func:`scalestate.nn.linear` would multiply them:
    the same casts, products and bits. The inputs of all experts are cast in one
    grouped cast, and so are their output gradients (see :func:`quantize_grouped`);
    each expert's weight cast is cached as a ``Linear`` weight's is. Experts with
    no tokens cast and record nothing; their weight gradient is zero.

    ``group_sizes`` is read on the host once per call (a tensor costs one
    device synchronization, as ``torch.nn.functional.grouped_mm``'s callers
    also pay to size its output).

    Args:
        x: ``(T, in_features)``, ordered by expert.
        weight: ``(E, out_features, in_features)``.
        bias: ``(E, out_features)`` or ``None``.
        group_sizes: ``E`` non-negative token counts summing to ``T`` (an integer
            tensor or a sequence of ints).
        handles: ``E`` handles, each with the roles INPUT, WEIGHT and GRAD_OUTPUT
            (see :func:`register_experts`), all of one manager.
        views: where the per-expert weight views are kept between calls (see
            :class:`ExpertViews`), so that each expert's weight cast is cached;
            without it every call casts every used expert's weight again.

    Returns:
        ``(T, out_features)``, rows in ``x``'s order.

    Raises:
        CastError: shapes that do not match.
        ArgumentTypeError, ArgumentValueError: bad ``group_sizes`` or ``handles``.
    """
    if not isinstance(x, Tensor) or not isinstance(weight, Tensor):
        raise ArgumentTypeError("grouped_linear: x and weight must be tensors")
    if weight.dim() != 3:
        raise CastError(
            f"grouped_linear: weight must be (num_experts, out_features, in_features); got shape {tuple(weight.shape)}"
        )
    n_experts, out_features, in_features = weight.shape
    handles = tuple(handles)
    if len(handles) != n_experts or not all(isinstance(h, ScalingHandle) for h in handles):
        raise ArgumentTypeError(
            f"grouped_linear: handles must be {n_experts} ScalingHandles, one per expert "
            f"(see ss.nn.register_experts); got {len(handles)}"
        )
    where = f"grouped_linear {handles[0].name!r}..." if handles else "grouped_linear"
    if any(h.manager is not handles[0].manager for h in handles):
        raise ArgumentValueError(f"{where}: every expert's handle must belong to one manager")
    if x.dim() != 2 or x.shape[1] != in_features:
        raise CastError(f"{where}: input must be (tokens, {in_features}); got shape {tuple(x.shape)}")
    if bias is not None and tuple(bias.shape) != (n_experts, out_features):
        raise CastError(f"{where}: bias must be ({n_experts}, {out_features}); got shape {tuple(bias.shape)}")
    sizes = _group_sizes(group_sizes, n_experts, x.shape[0], where)
    used = tuple(e for e, n in enumerate(sizes) if n)
    device_type = x.device.type
    out_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype
    if not used:
        return x.new_zeros((0, out_features), dtype=out_dtype)
    manager = handles[0].manager
    backend = manager.backend
    transpose = backend.wants_transposed(x.device) or manager.recipe.granularity(Role.INPUT) is not None
    # Compiled code bypasses the weight-cast cache: it casts fresh views (and traces no host state).
    keep = views is not None and not torch.compiler.is_compiling()
    cast_source = views.of(weight) if keep and views is not None else weight.detach().unbind(0)
    qxs = _cast_groups(handles, x, sizes, Role.INPUT, transpose)
    qws = [handles[e].quantize(cast_source[e], Role.WEIGHT, transpose=transpose) for e in used]
    out: Tensor = GroupedFP8LinearFunction.apply(  # type: ignore[no-untyped-call]
        x, weight, bias, used, tuple(sizes[e] for e in used), [qxs[e] for e in used], qws, handles,
        manager.backend, out_dtype,
    )
    return out


class GroupedLinear(torch.nn.Module):
    """``num_experts`` linear layers in one ``[E, out, in]`` weight, each expert cast to FP8 by its own slots.

    ``forward(x, group_sizes)`` takes the tokens ordered by expert and the
    number routed to each, and returns each expert's product on its tokens
    (see :func:`grouped_linear`). Expert ``e``'s slot is ``"<name>.<e>"``; the
    layer is, bitwise, ``num_experts`` :class:`scalestate.nn.Linear` layers
    named so, each on its expert's tokens.

    Args:
        num_experts, in_features, out_features: the weight is
            ``(num_experts, out_features, in_features)``.
        bias: a ``(num_experts, out_features)`` bias (default: none, as MoE experts have).
        manager: owns the experts' scaling state.
        name: the slots' prefix (default: ``"grouped_linear"``, ``"grouped_linear_1"``, ...).
        reduce: ``False`` registers the experts' slots rank-local (expert
            parallelism: each rank holds some experts, whose state no other rank has).
        first_expert: the global index of this layer's first expert (expert
            parallelism: a rank holding experts 4..7 of 8 passes 4, so that its
            slots are named as in the single-process model).
        device, dtype: of the parameters. Each expert's weight (and bias) is
            initialized as ``torch.nn.Linear`` initializes its own.

    Example:
        >>> import torch, scalestate as ss
        >>> m = ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation")
        >>> experts = ss.nn.GroupedLinear(4, 32, 16, manager=m, name="moe")
        >>> experts(torch.randn(10, 32), torch.tensor([3, 0, 5, 2])).shape
        torch.Size([10, 16])
        >>> [h.name for h in experts.handles]
        ['moe.0', 'moe.1', 'moe.2', 'moe.3']
    """

    def __init__(
        self,
        num_experts: int,
        in_features: int,
        out_features: int,
        bias: bool = False,
        *,
        manager: ScalingStateManager,
        name: str | None = None,
        reduce: bool = True,
        first_expert: int = 0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        if not isinstance(manager, ScalingStateManager):
            raise ArgumentTypeError(f"manager must be a ScalingStateManager; got {type(manager).__name__}")
        sizes = {"num_experts": num_experts, "in_features": in_features, "out_features": out_features}
        for label, value in sizes.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ArgumentValueError(f"GroupedLinear: {label} must be a positive int; got {value!r}")
        if not isinstance(first_expert, int) or isinstance(first_expert, bool) or first_expert < 0:
            raise ArgumentValueError(f"GroupedLinear: first_expert must be a non-negative int; got {first_expert!r}")
        super().__init__()
        self.num_experts, self.in_features, self.out_features = num_experts, in_features, out_features
        kwargs = {"device": device, "dtype": dtype}
        self.weight = torch.nn.Parameter(torch.empty(num_experts, out_features, in_features, **kwargs))  # type: ignore[arg-type]
        self.bias = torch.nn.Parameter(torch.empty(num_experts, out_features, **kwargs)) if bias else None  # type: ignore[arg-type]
        self.name = name if name is not None else free_name(manager, "grouped_linear")
        self.first_expert = first_expert
        self.handles = register_experts(manager, self.name, num_experts, reduce=reduce, first=first_expert)
        self.views = ExpertViews()
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Each expert's weight and bias initialized as ``torch.nn.Linear`` initializes its own."""
        if self.weight.is_meta:
            return
        bound = 1 / math.sqrt(self.in_features)
        with torch.no_grad():
            for e in range(self.num_experts):
                torch.nn.init.kaiming_uniform_(self.weight[e], a=math.sqrt(5))
                if self.bias is not None:
                    torch.nn.init.uniform_(self.bias[e], -bound, bound)

    def __setattr__(self, name: str, value: Any) -> None:
        """As ``torch.nn.Module``'s; a new ``weight`` drops the experts' cached weight casts."""
        super().__setattr__(name, value)
        if name == "weight" and "handles" in self.__dict__:
            self.invalidate_casts()

    def invalidate_casts(self) -> None:
        """Drop every expert's cached weight cast (after editing the weight through ``.data``)."""
        self.views.clear()
        for handle in self.handles:
            handle.invalidate_casts()

    def forward(self, x: Tensor, group_sizes: Tensor | Sequence[int]) -> Tensor:
        """FP8 ``x[rows of e] @ weight[e].T + bias[e]`` for every expert ``e``."""
        return grouped_linear(x, self.weight, self.bias, group_sizes, self.handles, views=self.views)

    def extra_repr(self) -> str:
        last = self.first_expert + self.num_experts - 1
        return (
            f"num_experts={self.num_experts}, in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, slots={self.name}.{self.first_expert}..{last}"
        )
