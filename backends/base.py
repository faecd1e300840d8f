"""The backend interface: what the manager asks of a compute backend.

Design requirement: a backend knows nothing of phases, slots or steps. It casts
tensors to FP8 (reporting their amax), multiplies FP8 matrices, and applies the
per-step update to all slots at once. The manager owns every decision about
*which* scale a cast uses and *whether* its amax is recorded.

A backend is any object with these members; subclassing :class:`Backend` is
optional (it is a :class:`typing.Protocol`).
"""

from __future__ import annotations

from typing import Literal, Protocol, runtime_checkable

import attrs
import torch
from torch import Tensor

from scalestate.quantized import Quantized

__all__ = ["Backend", "CastSpec"]


@attrs.frozen
class CastSpec:
    """How one slot casts: target dtype and the recipe's scale rules."""

    #: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
    dtype: torch.dtype
    #: Largest finite value of ``dtype``.
    fp8_max: float
    #: Just-in-time scales are divided by ``2**margin``.
    margin: int = 0
    #: Just-in-time scales are rounded down to a power of two.
    power_of_2: bool = False


@runtime_checkable
class Backend(Protocol):
    """What a backend provides. See :mod:`scalestate.backends` for registration."""

    #: The name it is registered under.
    name: str

    def available(self, device: torch.device | None = None) -> tuple[bool, str]:
        """Whether it can run on ``device`` (default: where it would run), and why."""
        ...

    def quantize(
        self, x: Tensor, scale: Tensor, spec: CastSpec, jit: bool | Tensor
    ) -> tuple[Quantized, Tensor]:
        """Cast ``x`` to FP8; return the result and ``x``'s amax (0-d float32).

        Args:
            x: the tensor to cast (any float dtype, any shape).
            scale: 0-d float32, the slot's current scale.
            spec: target dtype and scale rules.
            jit: ``True`` to scale ``x`` from its own amax instead of ``scale``
                (see :func:`scalestate.math.scale_from_amax`, with ``scale`` as the
                previous value); a 0-d bool tensor decides on the device, with no sync.
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
        """``(a.data * a.scale_inv) @ (b.data * b.scale_inv) + bias`` in ``out_dtype``."""
        ...

    def update(
        self,
        history: Tensor,
        scales: Tensor,
        step_amax: Tensor,
        fp8_max: Tensor,
        *,
        amax_compute: Literal["max", "most_recent"],
        margin: int,
        power_of_2: bool,
    ) -> None:
        """The step update of every slot, in place, in a fixed number of operations.

        Rolls ``history`` ``[N, H]`` with ``step_amax`` ``[N]``, writes new
        ``scales`` ``[N]`` and zeroes ``step_amax``, exactly as
        :func:`scalestate.math.update_scales` specifies.
        """
        ...
