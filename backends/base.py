"""The backend interface: what the manager asks of a compute backend.

Design requirement: a backend knows nothing of phases, slots or steps. The
manager decides, for every cast, which scale it uses, whether its amax is
recorded and where; it hands the backend one :class:`CastRequest` that says
all of that, so that a backend can do the whole cast in one pass over the
tensor: read it, find its amax, scale and round it, max the amax into the
slot's accumulator, and write the transposed copy a GEMM needs. Once per
optimizer step the manager hands it one :class:`StepUpdate` for all slots.

A backend is any object with the members of :class:`Backend`; subclassing it
is optional (it is a :class:`typing.Protocol`). The emulation backend is the
readable reference of every rule below.

One member is optional and not part of the runtime check:
``supports(recipe, device) -> tuple[bool, str]`` (see :class:`SupportsRecipe`),
whether the backend runs a recipe's casts and products on a device. A manager
asks it (through :func:`scalestate.backends.supports`) when it binds its
backend to a device, and fails at once when the answer is no; a backend
without it is taken to run per-tensor recipes wherever it is available, and
no fine-grained ones.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol, runtime_checkable

import attrs
import torch
from torch import Tensor

from scalestate.granularity import NVFP4_KINDS, Granularity, granularity_label
from scalestate.math import ScaleRule
from scalestate.nvfp4 import TENSOR_MAX
from scalestate.quantized import FP4_DTYPE, Quantized
from scalestate.recipe import NVFP4Scaling, Recipe, Role, fp8_max

__all__ = [
    "HOST_READ_OP",
    "Backend",
    "CastRequest",
    "CastSpec",
    "GroupedCastRequest",
    "GroupedOperand",
    "GroupedRows",
    "StepUpdate",
    "SupportsDeviceGroups",
    "SupportsGroupedCast",
    "SupportsRecipe",
    "cast_spec",
    "granularity_label",
    "group_spans",
    "recipe_granularities",
    "rows_then_zeros",
]

#: The keyword arguments of ``torch.library.custom_op`` for an operator that reads group sizes on the host
#: when it runs (a device synchronization on a GPU): tagged ``torch.Tag.cudagraph_unsafe`` where this torch
#: has the tag, so that CUDA graphs (``mode="reduce-overhead"``) leave it out of their capture.
HOST_READ_OP: dict[str, Any] = (
    {"tags": (torch.Tag.cudagraph_unsafe,)} if hasattr(torch.Tag, "cudagraph_unsafe") else {}
)


def group_spans(offsets: Tensor, *, skip_empty: bool = False) -> list[tuple[int, int, int]]:
    """``(group, start, end)`` of every group (``skip_empty``: of every group with rows) from ``offsets``:
    the ``[G]`` ends, as ``torch.nn.functional.grouped_mm`` takes them, read on the host (the operators
    that run groups one by one; see :data:`HOST_READ_OP`)."""
    ends: list[int] = offsets.tolist()
    spans = enumerate(zip([0, *ends[:-1]], ends, strict=True))
    return [(g, start, end) for g, (start, end) in spans if end > start or not skip_empty]


def rows_then_zeros(parts: list[Tensor], rows: int, cols: int, like: Tensor, dtype: torch.dtype) -> Tensor:
    """The groups' rows one after another, then zeros up to ``rows`` (group sizes summing to fewer rows
    than the operand: the shape an operator promised); ``like``'s device."""
    done = sum(part.shape[0] for part in parts)
    if done < rows:
        parts = [*parts, like.new_zeros((rows - done, cols), dtype=dtype)]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


@attrs.frozen
class CastSpec:
    """How one slot casts: target dtype and the rule of just-in-time scales. Fixed per slot."""

    #: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2`` (NVFP4: ``torch.float4_e2m1fn_x2``).
    dtype: torch.dtype
    #: Largest finite value of ``dtype`` (448 or 57344).
    fp8_max: float
    #: Margin and power-of-two rounding of just-in-time scales.
    rule: ScaleRule = attrs.field(factory=ScaleRule)
    #: ``None``: one scale per tensor. Else the fine-grained cast of the
    #: recipe's role (one scale per row, tile, block or MX block; see
    #: :mod:`scalestate.finegrained`), always scaled just in time; or NVFP4's
    #: blocks (:mod:`scalestate.nvfp4`), whose per-tensor level follows
    #: ``scale`` and ``jit`` as a per-tensor cast's scale does.
    granularity: Granularity | None = None
    #: NVFP4: the columnwise orientation (along tokens) is Hadamard-transformed
    #: with the request's ``signs``.
    hadamard: bool = False
    #: NVFP4: round stochastically with the request's ``sr_key``.
    stochastic: bool = False

    @property
    def nvfp4(self) -> bool:
        """Whether this is an NVFP4 cast (E2M1 data, two levels of scales)."""
        return self.granularity is not None and self.granularity.kind in NVFP4_KINDS


def cast_spec(recipe: Recipe, role: Role) -> CastSpec:
    """How ``role``'s slots cast under ``recipe`` (NVFP4: ``fp8_max`` is 2688, what ``S_enc`` maps amaxes onto)."""
    if isinstance(recipe, NVFP4Scaling):
        return CastSpec(
            FP4_DTYPE, TENSOR_MAX, recipe.rule, recipe.granularity(role), recipe.hadamard(role), recipe.stochastic(role)
        )
    dtype = recipe.format.dtype(role)
    return CastSpec(dtype, fp8_max(dtype), recipe.rule, recipe.granularity(role))


class CastRequest(NamedTuple):
    """One cast, fully decided by the manager.

    The result is a :class:`~scalestate.Quantized`:
    ``Quantized.of(Orientation(data, scale, scale_inv), other)`` (see
    :class:`~scalestate.quantized.Orientation`) with
    ``data = saturate(x * scale)`` rounded to nearest even in ``spec.dtype``
    (values beyond ``±spec.fp8_max`` become ``±spec.fp8_max``; NaN stays NaN),
    ``scale_inv = torch.reciprocal(scale)``, and both scales fresh tensors,
    never views of the state (which changes at the next step). ``other`` is
    ``None``, or with ``transpose`` the orientation of ``data.t()`` made
    contiguous, with the same scales.

    Fine-grained casts (``spec.granularity`` set) scale every row, tile or
    block from its own amax (``scale`` and ``jit`` are then ignored), exactly
    as :func:`scalestate.finegrained.quantize` does, and return a ``Quantized``
    whose orientations carry their ``tile``; ``transpose`` then asks for the
    other orientation (the quantization of ``x.t()`` along its own rows, with
    scales and a tile of its own). ``record`` takes the max over the whole
    tensor.

    NVFP4 casts (``spec.nvfp4``) are :func:`scalestate.nvfp4.quantize_nvfp4`
    with the per-tensor scale ``S_enc`` chosen from ``scale`` and ``jit`` as a
    per-tensor cast's scale is (the just-in-time one is
    ``scalestate.nvfp4.tensor_scale(amax, 1.0, spec.rule)``), ``signs`` and
    ``sr_key``; ``record`` takes ``max|x|`` (before any transform).
    """

    #: The tensor to cast (any float dtype, any shape; detached). Computed in float32.
    x: Tensor
    #: Target dtype and just-in-time rule.
    spec: CastSpec
    #: 0-d float32 view of the slot's current scale; read it, never write it.
    scale: Tensor
    #: ``False``: cast with ``scale``. ``True``: cast with the scale of ``x``'s own
    #: amax, ``scalestate.math.scale_from_amax(amax, spec.fp8_max, spec.rule,
    #: previous=scale)``. A 0-d bool tensor: decide per the tensor, on the device
    #: (no host sync).
    jit: bool | Tensor
    #: ``None``: record nothing. Else a 0-d float32 view of the slot's step
    #: accumulator: replace it, in place, by ``maximum(record, amax(|x|))``
    #: (NaN propagates), in the same pass as the cast where the backend can.
    record: Tensor | None = None
    #: Also produce ``transposed`` (2-d ``x`` only), in the same pass where the backend can:
    #: ``x.t()`` quantized along its rows (for per-tensor scales, ``data.t()`` made contiguous).
    transpose: bool = False
    #: NVFP4 with ``spec.hadamard``: the 16 float32 signs of the random Hadamard transform
    #: of the columnwise orientation (the manager's; read them, never write them).
    signs: Tensor | None = None
    #: NVFP4 with ``spec.stochastic``: the 0-d int64 key of this cast's random stream
    #: (:func:`scalestate.nvfp4.random_bits`), fixed by the manager per slot, iteration and cast.
    sr_key: Tensor | None = None


class GroupedCastRequest(NamedTuple):
    """One cast of every group of a tensor's rows, each group for a slot of its own (the experts of a
    mixture-of-experts layer), fully decided by the manager. Per-tensor specs only.

    The rows of the 2-d ``x`` split into ``len(sizes)`` consecutive groups of
    ``sizes[g]`` rows (each at least one). Group ``g`` is cast exactly as
    ``CastRequest(x_g, spec, scale[g], jit_g, record[g], transpose)`` would be,
    where ``jit_g`` is ``jit`` (a bool) or ``jit[g]`` (a ``[G]`` bool tensor):
    the result is one :class:`~scalestate.Quantized` per group, in order, with
    the same bits. ``record``, if given, takes ``maximum(record[g], amax(|x_g|))``
    in place for each group (NaN propagates), so that every group's amax reaches
    its own slot. A backend casts all groups in one call, with a fixed number of
    operations for the scales and the data where it can (see
    :meth:`EmulationBackend.cast_grouped
    <scalestate.backends.emulation.EmulationBackend.cast_grouped>`).
    """

    #: The rows to cast, ``(T, K)``, any float dtype (detached). Computed in float32.
    x: Tensor
    #: Target dtype and just-in-time rule, shared by every group (``spec.granularity`` is ``None``).
    spec: CastSpec
    #: Rows per group, each ``>= 1``, summing to ``T``; for
    #: :meth:`SupportsDeviceGroups.cast_grouped_rows`, a ``[G]`` integer tensor on ``x``'s device.
    sizes: tuple[int, ...] | Tensor
    #: ``[G]`` float32: each group's slot scale (a copy; read it).
    scale: Tensor
    #: As :attr:`CastRequest.jit`, for every group (a bool), or per group (a ``[G]`` bool tensor).
    jit: bool | Tensor
    #: ``None``: record nothing. Else ``[G]`` float32 accumulators, maxed in place.
    record: Tensor | None = None
    #: Also produce each group's ``transposed`` orientation (``data_g.t()`` made contiguous).
    transpose: bool = False


@runtime_checkable
class SupportsGroupedCast(Protocol):
    """An optional member of a backend: grouped casts (see :class:`GroupedCastRequest`).

    A manager hands a backend that has it one request per role and grouped
    layer; one without it gets one :class:`CastRequest` per group instead, with
    the same bits.
    """

    def cast_grouped(self, request: GroupedCastRequest) -> tuple[Quantized, ...]:
        """Cast every group of ``request.x``'s rows (see :class:`GroupedCastRequest`)."""
        ...


class GroupedRows(NamedTuple):
    """All groups of a grouped cast in one tensor: what :meth:`SupportsDeviceGroups.cast_grouped_rows` returns.

    Group ``g``'s rows of ``data`` are bitwise its cast by :class:`GroupedCastRequest`'s
    rules, and its scale is ``scale[g]``; the group sizes never leave the device.
    """

    #: ``(T, K)`` FP8: every row, cast with its group's scale.
    data: Tensor
    #: ``[G]`` float32 scales (one per group, also for an empty group, whose value is then unused).
    scale: Tensor
    #: ``[G]`` float32, ``1 / scale``.
    scale_inv: Tensor
    #: ``[T]`` int64: the group of each row.
    group_of_row: Tensor


class GroupedOperand(NamedTuple):
    """One operand of :meth:`SupportsDeviceGroups.grouped_scaled_mm`: FP8 data and its inverse scales.

    ``scale_inv`` broadcasts over ``data``: ``(T, 1)`` for rows each scaled by
    their group's scale, ``(1, T)`` for such rows transposed, ``(G, 1, 1)``
    for one scale per group of a 3-d operand.
    """

    data: Tensor
    scale_inv: Tensor


@runtime_checkable
class SupportsDeviceGroups(Protocol):
    """An optional member of a backend: grouped casts and products whose group sizes stay on the device.

    Compiled code cannot read group sizes on the host without a guard on
    every value (a recompilation for every new routing pattern); with these
    members a grouped layer runs the same operations whatever its sizes. A
    backend without them, or whose :meth:`grouped_products` is false on the
    device, gets grouped layers that compile once per pattern of sizes.
    """

    def cast_grouped_rows(self, request: GroupedCastRequest) -> GroupedRows:
        """:class:`GroupedCastRequest`'s casts with ``request.sizes`` a ``[G]`` integer tensor on the
        device (zeros allowed: an empty group records ``maximum(record[g], 0)``), in one tensor."""
        ...

    def grouped_products(self, device: torch.device) -> bool:
        """Whether :meth:`grouped_scaled_mm` gives, on ``device``, the bits of this backend's own
        :meth:`Backend.scaled_mm` of each group."""
        ...

    def grouped_scaled_mm(
        self,
        a: GroupedOperand,
        b: GroupedOperand,
        offsets: Tensor,
        *,
        out_dtype: torch.dtype,
        bias: Tensor | None = None,
    ) -> Tensor:
        """The product of each group, as ``torch.nn.functional.grouped_mm`` groups them by ``offsets``
        (``[G]`` int32 ends): a 2-d ``a`` ``(T, K)`` by a 3-d ``b`` ``(G, K, N)`` gives ``(T, N)``, rows
        by group; a 2-d ``a`` ``(M, T)`` by a 2-d ``b`` ``(T, N)`` gives ``(G, M, N)``, ``T`` by group
        (zeros for an empty group). Each group's product has the bits of :meth:`Backend.scaled_mm`,
        with ``bias[g]`` (a ``(G, N)`` bias, 3-d ``b`` only) as its ``bias``."""
        ...


class StepUpdate(NamedTuple):
    """The end-of-step update of every slot, applied in place.

    Exactly :func:`scalestate.math.update_scales` (count non-finite amaxes,
    forget their histories under the fallback policy, roll ``history`` with
    ``step_amax``, derive new ``scales``); then zero ``step_amax``. The tensors
    are the state's own buffers: write them in place (their storage must not
    change), in a fixed number of operations whatever ``N`` is, with no host sync.
    """

    #: ``[N, H]`` float32 amax histories, newest last.
    history: Tensor
    #: ``[N]`` float32 scales.
    scales: Tensor
    #: ``[N]`` float32 max-reduced amaxes of the step (0 where a slot did not run).
    step_amax: Tensor
    #: ``[N]`` float32 format maximum per slot.
    fp8_max: Tensor
    #: How scales follow from the history.
    rule: ScaleRule
    #: ``[N]`` int64 counters: add 1, in place, where ``step_amax`` is NaN or
    #: infinite (``None``: nothing to count).
    nonfinite_counts: Tensor | None = None
    #: Where ``step_amax`` is NaN or infinite, zero the history before rolling
    #: (the ``"fallback"`` policy); otherwise such a slot keeps its history and scale.
    forget_nonfinite: bool = False


@runtime_checkable
class Backend(Protocol):
    """What a backend provides. See :mod:`scalestate.backends` for registration."""

    #: The name it is registered under.
    name: str

    # Optional, not checked at run time (see SupportsRecipe):
    # def supports(self, recipe: Recipe, device: torch.device | str | None = None) -> tuple[bool, str]

    def available(self, device: torch.device | None = None) -> tuple[bool, str]:
        """Whether it can run on ``device`` (default: where it would run), and why.

        The reason is shown to users verbatim: name the missing capability.
        Answer without running tensor operations (this may be asked during a
        checkpointed region, where an extra operation would be recorded).
        """
        ...

    def cast(self, request: CastRequest) -> Quantized:
        """Cast ``request.x`` to FP8 as the request says (see :class:`CastRequest`)."""
        ...

    def wants_transposed(self, device: torch.device) -> bool:
        """Whether :meth:`scaled_mm` on ``device`` needs operands in the other layout.

        Modules then ask casts for ``transposed`` copies (made in the same
        pass), instead of leaving the product to copy its operands.
        """
        ...

    def scaled_mm(
        self,
        a: Quantized,
        b: Quantized,
        *,
        out_dtype: torch.dtype,
        bias: Tensor | None = None,
    ) -> Tensor:
        """``(a.data * a.scale_inv) @ (b.data * b.scale_inv) + bias`` in ``out_dtype`` (2-d operands)."""
        ...

    def update(self, update: StepUpdate) -> None:
        """Apply the step update of every slot in place (see :class:`StepUpdate`)."""
        ...


@runtime_checkable
class SupportsRecipe(Protocol):
    """The optional member of a backend: which recipes it runs where.

    Not part of :class:`Backend` (backends written without it keep working);
    :func:`scalestate.backends.supports` asks it when present.
    """

    def supports(self, recipe: Recipe, device: torch.device | str | None = None) -> tuple[bool, str]:
        """Whether every cast and product of ``recipe`` runs on ``device`` (default: where it would run), and why.

        The reason is shown to users verbatim: when the answer is no, name the
        recipe's granularity (``"1 x 128 tiles"``), the device, and what would
        run it. A backend that computes some products another way (a fallback)
        answers yes and says so. Answer without running tensor operations,
        like :meth:`Backend.available` (a manager asks when it binds to a
        device, which may be inside a checkpointed region).
        """
        ...


def recipe_granularities(recipe: Recipe) -> dict[Role, Granularity | None]:
    """The granularity of each role's casts under ``recipe`` (``None``: one scale per tensor)."""
    return {role: recipe.granularity(role) for role in Role}
