"""The scaling math, as pure functions over tensors.

Every function works on a single slot (0-d tensors, a 1-d history) or on
all slots at once (``[N]`` amaxes, an ``[N, H]`` history), with a fixed number
of tensor operations whatever ``N`` is, and never reads a value back to the
host. Backends may fuse these; the emulation backend calls them as they are.

The rules (per slot, per step):

* ``roll_history``: if the step's amax is ``> 0`` and finite, drop the oldest
  entry and append it (newest last); otherwise leave the history as it is.
* ``amax_from_history``: ``max(history)`` or the newest entry.
* ``scale_from_amax``: ``fp8_max / amax / 2**margin``; an infinite result
  becomes the float32 max; optionally rounded down to a power of two; never
  below the smallest normal float32; an amax that is zero or not finite keeps
  the previous scale.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

__all__ = [
    "FLOAT32_MAX",
    "FLOAT32_TINY",
    "amax_from_history",
    "is_usable_amax",
    "pow2_floor",
    "roll_history",
    "scale_from_amax",
    "update_scales",
]

FLOAT32_MAX = torch.finfo(torch.float32).max
FLOAT32_TINY = torch.finfo(torch.float32).tiny

Number = float | Tensor


def is_usable_amax(amax: Tensor) -> Tensor:
    """True where an amax may enter a history or yield a scale: ``> 0`` and finite."""
    return (amax > 0) & torch.isfinite(amax)


def roll_history(history: Tensor, amax: Tensor) -> Tensor:
    """Append ``amax`` to ``history`` (newest last) where it is usable.

    Args:
        history: ``[..., H]`` past amaxes, oldest first.
        amax: ``[...]`` the step's amax per slot (0 where the slot did not run).

    Returns:
        A new ``[..., H]`` tensor; rows whose amax is zero or not finite are unchanged.
    """
    rolled = torch.cat([history[..., 1:], amax.unsqueeze(-1).to(history.dtype)], dim=-1)
    return torch.where(is_usable_amax(amax).unsqueeze(-1), rolled, history)


def amax_from_history(
    history: Tensor, amax_compute: Literal["max", "most_recent"]
) -> Tensor:
    """The amax a scale is derived from: the history's max, or its newest entry."""
    if amax_compute == "max":
        return history.amax(dim=-1)
    return history[..., -1]


def pow2_floor(x: Tensor) -> Tensor:
    """Round positive finite values down to a power of two, exactly (via frexp)."""
    _, exponent = torch.frexp(x)
    return torch.ldexp(torch.ones_like(x), exponent - 1)


def scale_from_amax(
    amax: Tensor,
    fp8_max: Number,
    *,
    margin: int = 0,
    power_of_2: bool = False,
    previous: Number = 1.0,
) -> Tensor:
    """The scale that maps ``amax`` onto ``fp8_max``, with ``2**margin`` headroom.

    Args:
        amax: amax per slot (any shape), float32.
        fp8_max: largest finite value of the target format, a float or a
            tensor broadcastable to ``amax``.
        margin: the scale is divided by ``2**margin``.
        power_of_2: round the scale down to a power of two.
        previous: the scale kept where ``amax`` is zero or not finite.

    Returns:
        float32 scales, finite and ``> 0`` wherever ``previous`` is.
    """
    amax = amax.float()
    scale = torch.div(fp8_max, amax)
    if margin:
        scale = scale / (2.0**margin)
    scale = torch.where(torch.isinf(scale), FLOAT32_MAX, scale)
    if power_of_2:
        scale = pow2_floor(scale)
    scale = scale.clamp(min=FLOAT32_TINY)
    prev = previous if isinstance(previous, Tensor) else torch.full_like(scale, previous)
    return torch.where(is_usable_amax(amax), scale, prev)


def update_scales(
    history: Tensor,
    scales: Tensor,
    step_amax: Tensor,
    fp8_max: Tensor,
    *,
    amax_compute: Literal["max", "most_recent"],
    margin: int,
    power_of_2: bool,
) -> tuple[Tensor, Tensor]:
    """One step's update of every slot: roll histories, then derive scales.

    Args:
        history: ``[N, H]`` amax histories.
        scales: ``[N]`` current scales (kept where no usable amax exists).
        step_amax: ``[N]`` max-reduced amax of the step (0 where a slot did not run).
        fp8_max: ``[N]`` format maximum per slot.

    Returns:
        ``(new_history, new_scales)``.
    """
    new_history = roll_history(history, step_amax)
    amax = amax_from_history(new_history, amax_compute)
    new_scales = scale_from_amax(
        amax, fp8_max, margin=margin, power_of_2=power_of_2, previous=scales
    )
    return new_history, new_scales
