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

from scalestate.errors import ArgumentTypeError, ArgumentValueError, CastError
from scalestate.handle import ScalingHandle
from scalestate.manager import ScalingStateManager
from scalestate.nn.base import free_name
from scalestate.nn.grouped_cast import GroupedFP8LinearFunction, cast_groups, check_group_sizes
from scalestate.nn.grouped_device import device_grouped_linear
from scalestate.recipe import Role

__all__ = ["ExpertViews", "GroupedLinear", "grouped_linear", "register_experts"]


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

    def __reduce__(self) -> tuple[type[ExpertViews], tuple[()]]:
        """A copy (``torch.save``, ``copy.deepcopy``) starts empty: the views are derived from the weight."""
        return ExpertViews, ()

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
    grouped cast, and so are their output gradients (see :func:`quantize_grouped`)
    and the weights not already cached; each expert's weight cast is cached as a
    ``Linear`` weight's is. Experts with no tokens cast and record nothing; their
    weight gradient is zero.

    In eager code ``group_sizes`` is read on the host once per call (a tensor
    costs one device synchronization, as ``torch.nn.functional.grouped_mm``'s
    callers also pay to size its output). In compiled code a tensor stays on
    the device where the recipe and backend allow (see
    :mod:`scalestate.nn.grouped_device` and :mod:`scalestate.nn.grouped_opaque`):
    one graph for every routing.

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
    device_type = x.device.type
    out_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype
    if isinstance(group_sizes, Tensor) and torch.compiler.is_compiling():
        fixed = device_grouped_linear(x, weight, bias, group_sizes, handles, out_dtype, where)
        if fixed is not None:
            return fixed
    sizes = check_group_sizes(group_sizes, n_experts, x.shape[0], where)
    used = tuple(e for e, n in enumerate(sizes) if n)
    if not used:
        return x.new_zeros((0, out_features), dtype=out_dtype)
    manager = handles[0].manager
    backend = manager.backend
    transpose = backend.wants_transposed(x.device) or manager.recipe.granularity(Role.INPUT) is not None
    # Compiled code bypasses the weight-cast cache: it casts fresh views (and traces no host state).
    keep = views is not None and not torch.compiler.is_compiling()
    cast_source = views.of(weight) if keep and views is not None else weight.detach().unbind(0)
    qxs = cast_groups(handles, x, sizes, Role.INPUT, transpose)
    qws = manager._cast_weights(
        [handles[e]._slot(Role.WEIGHT) for e in used], weight, used, [cast_source[e] for e in used], transpose
    )
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
