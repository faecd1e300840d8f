"""Reference FP8 modules built on :class:`scalestate.ScalingStateManager`."""

from __future__ import annotations

from scalestate.nn.convert import convert
from scalestate.nn.linear import Linear, linear

__all__ = ["Linear", "convert", "linear"]
