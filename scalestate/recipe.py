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

from scalestate.errors import RecipeError
from scalestate.granularity import MX_BLOCK, Granularity, GranularityKind
from scalestate.math import FLOAT32_MAX, FLOAT32_TINY, ScaleRule
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


def _check_bool(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, bool):
        raise RecipeError(f"{attribute.name} must be True or False; got {value!r}")


def _check_history_len(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RecipeError(f"{attribute.name} must be an int >= 1; got {value!r}")


def _check_margin(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 64:
        raise RecipeError(f"{attribute.name} must be an int in [0, 64]; got {value!r}")


def _check_block(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65536:
        raise RecipeError(f"{attribute.name} must be an int in [1, 65536]; got {value!r}")


def _check_amax_compute(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value not in ("max", "most_recent"):
        raise RecipeError(f"{attribute.name} must be 'max' or 'most_recent'; got {value!r}")


def _as_float(value: object) -> object:
    """An int amax floor as the float it means (``0`` and ``-0.0`` are ``0.0``); anything else as it
    is, for the validator to judge."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value) + 0.0
    return value


def _check_amax_floor(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, float) or not (value == 0.0 or FLOAT32_TINY <= value <= FLOAT32_MAX):
        raise RecipeError(
            f"{attribute.name} must be 0.0 (no floor) or a float from 2**-126 to {FLOAT32_MAX:.6g} (a normal "
            f"float32: the scale math runs in float32), e.g. 1e-12 as torchao's dynamic scaling; got {value!r}"
        )


#: ``metadata`` key of a recipe field added after recipes were first saved: such a field is left
#: out of the recipe's repr and of the manager's saved recipe while it holds its default, so that
#: states and reprs made before it existed stay valid and unchanged.
_OMITTED_AT_DEFAULT = "scalestate.omitted_at_default"


def described_fields(recipe: object) -> dict[str, Any]:
    """The fields that describe ``recipe`` (an attrs recipe), in order: every field but one added
    since recipes were first saved (``amax_floor``) while it holds its default."""
    cls: Any = type(recipe)
    out: dict[str, Any] = {}
    for field in attrs.fields(cls):
        value = getattr(recipe, field.name)
        if field.metadata.get(_OMITTED_AT_DEFAULT) and value == field.default:
            continue
        out[field.name] = value
    return out


def _amax_floor_field() -> Any:
    return attrs.field(
        default=0.0, converter=_as_float, validator=_check_amax_floor, metadata={_OMITTED_AT_DEFAULT: True}
    )


class _DescribedRepr:
    """A repr of the fields that describe the recipe (see :func:`described_fields`)."""

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={value!r}" for name, value in described_fields(self).items())
        return f"{type(self).__name__}({fields})"


@attrs.frozen(repr=False)
class DelayedScaling(_DescribedRepr):
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
    history_len: int = attrs.field(default=16, validator=_check_history_len)
    #: ``"max"``: scale from the largest amax in the history; ``"most_recent"``:
    #: from the newest one.
    amax_compute: Literal["max", "most_recent"] = attrs.field(
        default="max", validator=_check_amax_compute
    )
    #: Headroom: the scale is divided by ``2**margin``.
    margin: int = attrs.field(default=0, validator=_check_margin)
    #: FP8 format of forward and backward casts.
    format: Format = attrs.field(default=Format.HYBRID, validator=_check_format)
    #: Round each scale down to a power of two (exact rescaling, no mantissa error).
    power_of_2: bool = attrs.field(default=False, validator=_check_bool)
    #: Amaxes below it (but above 0) scale as if they were it: ``fp8_max /
    #: max(amax, amax_floor)``. ``0.0`` (default): no floor, the scale follows
    #: the amax down to the smallest one (up to the float32 maximum). torchao's
    #: dynamic scaling floors at ``1e-12``. Shown in the repr and saved in the
    #: manager's state only when set.
    amax_floor: float = _amax_floor_field()

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
class CurrentScaling(_DescribedRepr, _JustInTime):
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
    power_of_2: bool = attrs.field(default=False, validator=_check_bool)
    #: Amaxes below it (but above 0) scale as if they were it, as in
    #: :attr:`DelayedScaling.amax_floor`. ``0.0`` (default): no floor;
    #: ``1e-12``: torchao's dynamic scaling.
    amax_floor: float = _amax_floor_field()

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
    power_of_2: bool = attrs.field(default=False, validator=_check_bool)

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
    block: int = attrs.field(default=128, validator=_check_block)
    #: Round each scale down to a power of two.
    power_of_2: bool = attrs.field(default=True, validator=_check_bool)

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


Recipe = DelayedScaling | CurrentScaling | RowwiseScaling | BlockScaling | MXFP8Scaling
"""Any recipe: the type of ``ScalingStateManager``'s ``recipe`` argument.

Per tensor: :class:`DelayedScaling` (from the amax history of earlier steps) and
:class:`CurrentScaling` (from the tensor, just in time). Fine-grained, just in
time: :class:`RowwiseScaling`, :class:`BlockScaling`, :class:`MXFP8Scaling`.
"""

RECIPES: tuple[type, ...] = (DelayedScaling, CurrentScaling, RowwiseScaling, BlockScaling, MXFP8Scaling)
"""Every recipe class (what ``ScalingStateManager`` accepts)."""
