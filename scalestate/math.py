"""The scaling math, as pure functions over tensors.

Every function works on a single slot (0-d tensors, a 1-d history) or on
all slots at once (``[N]`` amaxes, an ``[N, H]`` history), with a fixed number
of tensor operations whatever ``N`` is, and never reads a value back to the
host. Backends may fuse these; the emulation backend calls them as they are.

The rules (per slot, per step):

* ``roll_history``: if the step's amax is ``> 0`` and finite, drop the oldest
  entry and append it (newest last); otherwise leave the history as it is.
* ``amax_from_history``: ``max(history)`` or the newest entry.
* non-finite step amaxes are counted per slot; under the ``"fallback"``
  policy the slot's history is zeroed first (see :func:`update_scales`).
* ``scale_from_amax``: ``fp8_max / max(amax, amax_floor) / 2**margin`` (a
  true float32 division; ``amax_floor`` is 0, no floor, unless the recipe sets
  one), clamped to ``[smallest normal float32, largest float32]`` (so an
  infinite result becomes the float32 max), then optionally rounded down to a
  power of two; an amax that is zero or not finite keeps the previous scale.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import attrs
import torch
from torch import Tensor

__all__ = [
    "FLOAT32_MAX",
    "FLOAT32_TINY",
    "ScaleRule",
    "abs_max",
    "abs_max_of_ends",
    "amax_from_history",
    "is_usable_amax",
    "nonfinite_mask",
    "pow2_floor",
    "ints_on",
    "roll_history",
    "scale_from_amax",
    "update_scales",
]

FLOAT32_MAX = torch.finfo(torch.float32).max
FLOAT32_TINY = torch.finfo(torch.float32).tiny
_EXPONENT_BITS = 0x7F800000

Number = float | Tensor


@attrs.frozen
class ScaleRule:
    """How a scale is derived from an amax: the part of a recipe the math needs.

    Example:
        >>> import torch
        >>> from scalestate.math import ScaleRule, scale_from_amax
        >>> scale_from_amax(torch.tensor(3.0), 448.0, ScaleRule(power_of_2=True))
        tensor(128.)
    """

    #: ``"max"``: scale from the largest amax in the history; ``"most_recent"``: the newest.
    amax_compute: Literal["max", "most_recent"] = "max"
    #: Headroom: the scale is divided by ``2**margin``.
    margin: int = 0
    #: Round each scale down to a power of two.
    power_of_2: bool = False
    #: Amaxes below it (but above 0) scale as if they were it: ``fp8_max / max(amax, amax_floor)``,
    #: in float32 (the floor rounded to the nearest float32). 0: no floor.
    amax_floor: float = 0.0


def abs_max(x: Tensor) -> Tensor:
    """``max|x|`` as a 0-d tensor of ``x``'s dtype: NaN if ``x`` holds one, 0 for an empty ``x``.

    Eager code reads it from ``torch.aminmax`` (one pass, nothing allocated:
    about half the time of ``x.abs().amax()`` on CPU) as the larger of
    ``max`` and ``-min``; compiled code as ``x.abs().amax()``, which the
    compiler fuses into the cast's own pass. Both are exact, so both give
    the same value (the ``abs`` of the result makes an all ``-0.0`` tensor's
    amax ``+0.0``, as ``abs().amax()`` does).

    Example:
        >>> import torch
        >>> from scalestate.math import abs_max
        >>> abs_max(torch.tensor([1.5, -3.0, 2.0]))
        tensor(3.)
    """
    if not x.numel():
        return x.new_zeros(())
    if torch.compiler.is_compiling():
        return x.abs().amax()
    return abs_max_of_ends(*torch.aminmax(x))


def abs_max_of_ends(low: Tensor, high: Tensor) -> Tensor:
    """``max|x|`` from ``x``'s smallest and largest elements (``torch.aminmax(x)``): the larger of ``high``
    and ``-low``, NaN if either is, and ``+0.0`` for zeros of either sign.

    Example:
        >>> import torch
        >>> from scalestate.math import abs_max_of_ends
        >>> abs_max_of_ends(torch.tensor(-3.0), torch.tensor(2.0))
        tensor(3.)
    """
    return torch.maximum(high, low.neg()).abs()


def is_usable_amax(amax: Tensor) -> Tensor:
    """True where an amax may enter a history or yield a scale: ``> 0`` and finite."""
    return (amax > 0) & (amax < float("inf"))


def nonfinite_mask(amax: Tensor) -> Tensor:
    """True where ``amax`` is NaN or infinite (three operations; ``torch.isfinite`` dispatches four)."""
    return ~(amax.abs() < float("inf"))


def roll_history(history: Tensor, amax: Tensor, *, out: Tensor | None = None) -> Tensor:
    """Append ``amax`` to ``history`` (newest last) where it is usable.

    Args:
        history: ``[..., H]`` past amaxes, oldest first.
        amax: ``[...]`` the step's amax per slot (0 where the slot did not run).
        out: where to write the result (may be ``history`` itself).

    Returns:
        The rolled ``[..., H]`` history; rows whose amax is zero or not finite are unchanged.
    """
    rolled = torch.cat([history[..., 1:], amax.unsqueeze(-1).to(history.dtype)], dim=-1)
    keep = is_usable_amax(amax).unsqueeze(-1)
    if out is None:
        return torch.where(keep, rolled, history)
    return torch.where(keep, rolled, history, out=out)


def ints_on(values: Sequence[int], device: torch.device) -> Tensor:
    """``values`` as an int64 tensor on ``device``, without a device synchronization: on an
    accelerator the host copy is pinned and copied asynchronously (a plain copy from pageable
    memory waits for the stream)."""
    host = torch.tensor(values, dtype=torch.int64)
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def amax_from_history(history: Tensor, amax_compute: Literal["max", "most_recent"]) -> Tensor:
    """The amax a scale is derived from: the history's max, or its newest entry."""
    if amax_compute == "max":
        return history.amax(dim=-1)
    return history[..., -1]


def pow2_floor(x: Tensor) -> Tensor:
    """Round positive normal float32 values down to a power of two, exactly.

    Keeps the exponent bits and clears the mantissa (one bitwise operation).
    Only defined for positive finite *normal* float32 values (``>=``
    :data:`FLOAT32_TINY`), which is what :func:`scale_from_amax` passes it.
    """
    bits = torch.bitwise_and(x.contiguous().view(torch.int32), _EXPONENT_BITS)
    return bits.view(torch.float32)


def scale_from_amax(
    amax: Tensor,
    fp8_max: Number,
    rule: ScaleRule = ScaleRule(),
    *,
    previous: Number = 1.0,
    out: Tensor | None = None,
) -> Tensor:
    """The scale that maps ``amax`` onto ``fp8_max``, with ``2**rule.margin`` headroom.

    A positive ``amax`` below ``rule.amax_floor`` is raised to it before the
    division, as torchao's dynamic scaling does (its floor is ``1e-12``). The
    division is float32's, correctly rounded, with the floor as its nearest
    float32 ``F``. torchao divides in float64 and rounds once to float32,
    which gives the same bits for every amax above the floor (a float64
    quotient of two float32 values rounds to the correctly rounded float32
    one); below it, the two agree when ``fp8_max / F`` and ``fp8_max / floor``
    round to the same float32, as they do for ``1e-12`` and both FP8 formats.

    Args:
        amax: amax per slot (any shape), float32.
        fp8_max: largest finite value of the target format, a float or a
            tensor broadcastable to ``amax``.
        rule: margin, power-of-two rounding and amax floor (``amax_compute`` is not used here).
        previous: the scale kept where ``amax`` is zero or not finite.
        out: where to write the result (may be ``previous`` itself).

    Returns:
        float32 scales in ``[FLOAT32_TINY, FLOAT32_MAX]`` wherever ``amax`` is
        usable, ``previous`` elsewhere.
    """
    divisor = amax.float()
    if rule.amax_floor:
        divisor = divisor.clamp(min=rule.amax_floor)  # NaN stays NaN; zero is kept below, as "no amax"
    scale = torch.div(fp8_max, divisor)  # a true division, not reciprocal * fp8_max
    if rule.margin:
        scale = scale / (2.0**rule.margin)
    scale = scale.clamp(FLOAT32_TINY, FLOAT32_MAX)
    if rule.power_of_2:
        scale = pow2_floor(scale)
    usable = is_usable_amax(amax)
    kept = previous if isinstance(previous, Tensor) else torch.full_like(scale, previous)
    if out is None:
        return torch.where(usable, scale, kept)
    return torch.where(usable, scale, kept, out=out)


def update_scales(
    history: Tensor,
    scales: Tensor,
    step_amax: Tensor,
    fp8_max: Tensor,
    rule: ScaleRule,
    *,
    in_place: bool = False,
    nonfinite_counts: Tensor | None = None,
    forget_nonfinite: bool = False,
) -> tuple[Tensor, Tensor]:
    """One step's update of every slot: count non-finite amaxes, roll histories, derive scales.

    Args:
        history: ``[N, H]`` amax histories.
        scales: ``[N]`` current scales (kept where no usable amax exists).
        step_amax: ``[N]`` max-reduced amax of the step (0 where a slot did not run).
        fp8_max: ``[N]`` format maximum per slot.
        rule: how scales follow from the history.
        in_place: write the results into ``history`` and ``scales`` (their
            storage never changes) instead of new tensors.
        nonfinite_counts: ``[N]`` int64 counters, incremented in place where
            ``step_amax`` is NaN or infinite.
        forget_nonfinite: where ``step_amax`` is NaN or infinite, zero the
            history first (the slot then scales just in time until a finite
            step gives it history again: the ``"fallback"`` policy). Otherwise
            such a slot keeps its history and scale (``"skip"``).

    Returns:
        ``(new_history, new_scales)`` (``history`` and ``scales`` themselves when ``in_place``).
    """
    if nonfinite_counts is not None or forget_nonfinite:
        bad = nonfinite_mask(step_amax)
        if nonfinite_counts is not None:
            nonfinite_counts.add_(bad)
        if forget_nonfinite:
            forget = bad.unsqueeze(-1)
            history = history.masked_fill_(forget, 0.0) if in_place else history.masked_fill(forget, 0.0)
    new_history = roll_history(history, step_amax, out=history if in_place else None)
    amax = amax_from_history(new_history, rule.amax_compute)
    new_scales = scale_from_amax(amax, fp8_max, rule, previous=scales, out=scales if in_place else None)
    return new_history, new_scales
