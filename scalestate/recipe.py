"""Recipes: how each FP8 cast is scaled.

A recipe is a frozen description; the state it implies (histories, scales)
lives in :class:`~scalestate.ScalingStateManager`. Variants are made with
:func:`attrs.evolve`::

    >>> import attrs, scalestate as ss
    >>> r = ss.DelayedScaling(history_len=16)
    >>> attrs.evolve(r, margin=1).margin
    1
"""

from __future__ import annotations

import enum
from typing import Any, Literal

import attrs
import torch

from scalestate._recipe_fields import (
    DescribedRepr,
    amax_floor_field,
    check_amax_compute,
    check_block,
    check_bool,
    check_history_len,
    check_margin,
)
from scalestate.errors import RecipeError
from scalestate.granularity import MX_BLOCK, Granularity, GranularityKind
from scalestate.math import ScaleRule
from scalestate.nvfp4 import NVFP4_BLOCK
from scalestate.quantized import FP8_MAX

__all__ = [
    "BlockScaling",
    "CurrentScaling",
    "DelayedScaling",
    "Direction",
    "Format",
    "Granularity",
    "GranularityKind",
    "MXFP8Scaling",
    "NVFP4Scaling",
    "Recipe",
    "Role",
    "RowwiseScaling",
    "fp8_max",
]


class Direction(enum.Enum):
    """Which pass a cast belongs to."""

    FORWARD = "forward"
    BACKWARD = "backward"


class Role(enum.Enum):
    """What a cast is: each role knows the pass it belongs to.

    ``INPUT`` and ``WEIGHT`` are cast in the forward pass (and again in a
    recompute); ``GRAD_OUTPUT`` is cast in the backward pass.
    """

    INPUT = "input"
    WEIGHT = "weight"
    GRAD_OUTPUT = "grad_output"

    @property
    def direction(self) -> Direction:
        """The pass this role is cast in."""
        return Direction.BACKWARD if self is Role.GRAD_OUTPUT else Direction.FORWARD


class Format(enum.Enum):
    """FP8 formats. ``HYBRID`` is E4M3 in the forward pass and E5M2 in the backward."""

    E4M3 = "e4m3"
    E5M2 = "e5m2"
    HYBRID = "hybrid"

    def __repr__(self) -> str:
        """``Format.HYBRID``, as it is written, so that a recipe's repr reads as code."""
        return f"Format.{self.name}"

    def dtype(self, role: Role) -> torch.dtype:
        """The torch float8 dtype that casts of ``role`` use under this format."""
        if self is Format.E4M3 or (self is Format.HYBRID and role.direction is Direction.FORWARD):
            return torch.float8_e4m3fn
        return torch.float8_e5m2


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of a float8 dtype (E4M3: 448, E5M2: 57344)."""
    try:
        return FP8_MAX[dtype]
    except KeyError:
        raise RecipeError(
            f"expected torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}"
        ) from None


def _check_format(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, Format):
        allowed = ", ".join(f"Format.{f.name}" for f in Format)
        raise RecipeError(f"{attribute.name} must be one of {allowed}; got {value!r}")


@attrs.frozen(repr=False)
class DelayedScaling(DescribedRepr):
    """Scale each cast from the amax history of earlier steps.

    Between two ``step()`` calls every cast of a slot uses one scale; the amax
    values observed in the meantime are max-reduced and rolled into the
    history at ``step()``. A slot with no history yet (before its first
    ``step()``) is scaled just in time from each tensor it casts.

    Example:
        >>> import scalestate as ss
        >>> ss.DelayedScaling(history_len=16, amax_compute="max", margin=0)
        DelayedScaling(history_len=16, amax_compute='max', margin=0, format=Format.HYBRID, power_of_2=False)
    """

    #: Number of past steps whose amax is kept per slot (newest last).
    history_len: int = attrs.field(default=16, validator=check_history_len)
    #: ``"max"``: scale from the largest amax in the history; ``"most_recent"``:
    #: from the newest one.
    amax_compute: Literal["max", "most_recent"] = attrs.field(
        default="max", validator=check_amax_compute
    )
    #: Headroom: the scale is divided by ``2**margin``.
    margin: int = attrs.field(default=0, validator=check_margin)
    #: FP8 format of forward and backward casts.
    format: Format = attrs.field(default=Format.HYBRID, validator=_check_format)
    #: Round each scale down to a power of two (exact rescaling, no mantissa error).
    power_of_2: bool = attrs.field(default=False, validator=check_bool)
    #: Amaxes below it (but above 0) scale as if they were it: ``fp8_max /
    #: max(amax, amax_floor)``. ``0.0`` (default): no floor, the scale follows
    #: the amax down to the smallest one (up to the float32 maximum). torchao's
    #: dynamic scaling floors at ``1e-12``. Shown in the repr and saved in the
    #: manager's state only when set.
    amax_floor: float = amax_floor_field()

    @property
    def delayed(self) -> bool:
        """True: scales come from the history of earlier steps."""
        return True

    @property
    def rule(self) -> ScaleRule:
        """How scales follow from amaxes under this recipe."""
        return ScaleRule(
            amax_compute=self.amax_compute, margin=self.margin, power_of_2=self.power_of_2, amax_floor=self.amax_floor
        )

    def granularity(self, role: Role) -> Granularity | None:
        """``None``: one scale per tensor."""
        return None


class _JustInTime:
    """What every just-in-time recipe shares: no history to scale from.

    The manager still records each slot's per-step amax (the max over the
    whole tensor, whatever the granularity) and keeps the last one, for
    inspection, the non-finite policy and checkpoint parity.
    """

    power_of_2: bool

    @property
    def delayed(self) -> bool:
        """False: every cast is scaled from the tensor itself."""
        return False

    @property
    def history_len(self) -> int:
        """One entry: the last step's amax, for inspection."""
        return 1

    @property
    def amax_compute(self) -> Literal["most_recent"]:
        """The kept entry is the last step's amax."""
        return "most_recent"

    @property
    def margin(self) -> int:
        """No headroom: the tensor's own amax is known exactly."""
        return 0

    @property
    def rule(self) -> ScaleRule:
        """How scales follow from amaxes under this recipe."""
        return ScaleRule(amax_compute="most_recent", margin=0, power_of_2=self.power_of_2)


@attrs.frozen(repr=False)
class CurrentScaling(DescribedRepr, _JustInTime):
    """Scale each cast just in time from the tensor being cast.

    Every cast computes the tensor's amax first and derives its scale from it;
    nothing carries over between steps except the last step's amax, which is
    kept for inspection.

    Example:
        >>> import scalestate as ss
        >>> ss.CurrentScaling(power_of_2=True).power_of_2
        True
        >>> ss.CurrentScaling(amax_floor=1e-12)  # torchao's dynamic scaling, bit for bit
        CurrentScaling(format=Format.HYBRID, power_of_2=False, amax_floor=1e-12)
    """

    #: FP8 format of forward and backward casts.
    format: Format = attrs.field(default=Format.HYBRID, validator=_check_format)
    #: Round each scale down to a power of two.
    power_of_2: bool = attrs.field(default=False, validator=check_bool)
    #: Amaxes below it (but above 0) scale as if they were it, as in
    #: :attr:`DelayedScaling.amax_floor`. ``0.0`` (default): no floor;
    #: ``1e-12``: torchao's dynamic scaling.
    amax_floor: float = amax_floor_field()

    @property
    def rule(self) -> ScaleRule:
        """How scales follow from amaxes under this recipe."""
        return ScaleRule(amax_compute="most_recent", margin=0, power_of_2=self.power_of_2, amax_floor=self.amax_floor)

    def granularity(self, role: Role) -> Granularity | None:
        """``None``: one scale per tensor."""
        return None


@attrs.frozen
class RowwiseScaling(_JustInTime):
    """One scale per row along each GEMM's contraction dimension, just in time.

    Each role is cast in both orientations where a GEMM needs them (see
    docs/recipes.md): ``x`` with one scale per row of ``x``, and ``x.t()``
    with one per row of ``x.t()``.

    Example:
        >>> import scalestate as ss
        >>> ss.RowwiseScaling().granularity(ss.Role.WEIGHT)
        Granularity(kind=<GranularityKind.ROW: 'row'>, block=0, power_of_2=False)
    """

    #: FP8 format of forward and backward casts.
    format: Format = attrs.field(default=Format.E4M3, validator=_check_format)
    #: Round each scale down to a power of two.
    power_of_2: bool = attrs.field(default=False, validator=check_bool)

    def granularity(self, role: Role) -> Granularity:
        """One scale per row, for every role."""
        return Granularity(GranularityKind.ROW, 0, self.power_of_2)


@attrs.frozen
class BlockScaling(_JustInTime):
    """DeepSeek-V3-style blocks: ``1 x block`` tiles for INPUT and GRAD_OUTPUT, ``block x block`` for WEIGHT.

    Per tile ``scale = fp8_max / amax_tile`` (rounded down to a power of two
    when ``power_of_2``); a tile whose amax is zero or not finite gets scale 1.

    Example:
        >>> import scalestate as ss
        >>> r = ss.BlockScaling()
        >>> [str(r.granularity(role).kind) for role in (ss.Role.INPUT, ss.Role.WEIGHT, ss.Role.GRAD_OUTPUT)]
        ['tile', 'block', 'tile']
    """

    #: FP8 format of forward and backward casts.
    format: Format = attrs.field(default=Format.E4M3, validator=_check_format)
    #: Elements per tile along a row, and rows and columns per weight block.
    block: int = attrs.field(default=128, validator=check_block)
    #: Round each scale down to a power of two.
    power_of_2: bool = attrs.field(default=True, validator=check_bool)

    def granularity(self, role: Role) -> Granularity:
        """Tiles for activations and gradients, square blocks for weights."""
        kind = GranularityKind.BLOCK if role is Role.WEIGHT else GranularityKind.TILE
        return Granularity(kind, self.block, self.power_of_2)


@attrs.frozen
class MXFP8Scaling(_JustInTime):
    """OCP MXFP8: one E8M0 power of two per 32 consecutive elements along the contraction dimension.

    ``e = ceil(log2(amax_block / fp8_max))`` (rounded up so that no element
    saturates, as NVIDIA's MXFP8 pre-training recipe does, not the OCP spec's
    floor); ``scale_inv = 2**e`` as ``torch.float8_e8m0fnu``, ``scale = 2**-e``.

    Example:
        >>> import scalestate as ss
        >>> ss.MXFP8Scaling().granularity(ss.Role.INPUT)
        Granularity(kind=<GranularityKind.MX: 'mx'>, block=32, power_of_2=True)
    """

    #: FP8 format of forward and backward casts.
    format: Format = attrs.field(default=Format.E4M3, validator=_check_format)

    @property
    def power_of_2(self) -> bool:  # type: ignore[override]  # a field in the other recipes
        """True: E8M0 factors are powers of two."""
        return True

    def granularity(self, role: Role) -> Granularity:
        """32-element blocks along rows, for every role."""
        return Granularity(GranularityKind.MX, MX_BLOCK, True)


def _check_global_scale(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value not in ("current", "delayed"):
        raise RecipeError(f"{attribute.name} must be 'current' or 'delayed'; got {value!r}")


@attrs.frozen
class NVFP4Scaling:
    """NVFP4: E2M1 data, one E4M3 scale per 16 elements, one float32 scale per tensor.

    Every role is scaled along each product's own contraction axis (as the
    fine-grained recipes are); the numerics are in :mod:`scalestate.nvfp4`
    and docs/recipes.md. The per-tensor level ``S_enc = 2688 / amax`` is
    scaled just in time from each tensor (``global_scale="current"``) or
    from the slot's amax history (``"delayed"``, with ``history_len``,
    ``amax_compute`` and ``margin`` as in :class:`DelayedScaling`; a slot
    with no history yet is scaled just in time), which saves a pass over
    the tensor.

    ``rht``: the weight-gradient operands (``x`` and ``dy`` along tokens)
    go through a random Hadamard transform first, whose 16 signs are
    manager state. ``stochastic_rounding``: gradient casts round
    stochastically, from a counter-based generator keyed by the manager's
    seed, the slot, the iteration and the cast's ordinal in the step. Both
    are saved and restored with the manager's state.

    Example:
        >>> import scalestate as ss
        >>> r = ss.NVFP4Scaling(global_scale="delayed", history_len=4)
        >>> r.granularity(ss.Role.WEIGHT), r.delayed
        (Granularity(kind=<GranularityKind.NVFP4_2D: 'nvfp4_2d'>, block=16, power_of_2=False), True)
    """

    #: ``"current"``: the per-tensor scale comes from each tensor's own amax;
    #: ``"delayed"``: from the slot's amax history (just in time until its first step).
    global_scale: Literal["current", "delayed"] = attrs.field(default="current", validator=_check_global_scale)
    #: Past steps' amaxes kept per slot (newest last); the delayed per-tensor scale derives from them.
    history_len: int = attrs.field(default=16, validator=check_history_len)
    #: ``"max"`` or ``"most_recent"``, as in :class:`DelayedScaling` (delayed only).
    amax_compute: Literal["max", "most_recent"] = attrs.field(default="max", validator=check_amax_compute)
    #: Headroom of the delayed per-tensor scale: divided by ``2**margin``.
    margin: int = attrs.field(default=0, validator=check_margin)
    #: ``16 x 16`` weight blocks (a weight and its transpose quantize to the same values); else ``1 x 16``.
    weight_2d: bool = attrs.field(default=True, validator=check_bool)
    #: Random Hadamard transform of the weight-gradient operands (16 tokens at a time).
    rht: bool = attrs.field(default=True, validator=check_bool)
    #: Stochastic rounding of gradient casts (``GRAD_OUTPUT``).
    stochastic_rounding: bool = attrs.field(default=True, validator=check_bool)

    @property
    def delayed(self) -> bool:
        """True with ``global_scale="delayed"``: per-tensor scales come from the history."""
        return self.global_scale == "delayed"

    @property
    def power_of_2(self) -> bool:
        """False: block scales are E4M3 values, not powers of two."""
        return False

    @property
    def rule(self) -> ScaleRule:
        """How the per-tensor scale ``S_enc`` follows from the history (delayed) or the last amax (current)."""
        if self.delayed:
            return ScaleRule(amax_compute=self.amax_compute, margin=self.margin)
        return ScaleRule(amax_compute="most_recent")

    def granularity(self, role: Role) -> Granularity:
        """``1 x 16`` blocks, or ``16 x 16`` for weights with ``weight_2d``."""
        kind = GranularityKind.NVFP4_2D if role is Role.WEIGHT and self.weight_2d else GranularityKind.NVFP4
        return Granularity(kind, NVFP4_BLOCK, False)

    def hadamard(self, role: Role) -> bool:
        """Whether ``role``'s columnwise orientation (along tokens) is Hadamard-transformed."""
        return self.rht and role is not Role.WEIGHT

    def stochastic(self, role: Role) -> bool:
        """Whether ``role``'s casts round stochastically (gradients only)."""
        return self.stochastic_rounding and role is Role.GRAD_OUTPUT


Recipe = DelayedScaling | CurrentScaling | RowwiseScaling | BlockScaling | MXFP8Scaling | NVFP4Scaling
"""Any recipe: the type of ``ScalingStateManager``'s ``recipe`` argument.

Per tensor: :class:`DelayedScaling` (from the amax history of earlier steps) and
:class:`CurrentScaling` (from the tensor, just in time). Fine-grained, just in
time: :class:`RowwiseScaling`, :class:`BlockScaling`, :class:`MXFP8Scaling`. Four-bit:
:class:`NVFP4Scaling` (block scales just in time, the per-tensor level current or delayed).
"""

RECIPES: tuple[type, ...] = (
    DelayedScaling, CurrentScaling, RowwiseScaling, BlockScaling, MXFP8Scaling, NVFP4Scaling,
)
"""Every recipe class (what ``ScalingStateManager`` accepts)."""
