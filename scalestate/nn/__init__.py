"""Reference FP8 modules built on :class:`scalestate.ScalingStateManager`, and model conversion."""

from __future__ import annotations

from scalestate.nn.convert import (
    ConversionFn,
    ConversionRequest,
    convert,
    register_conversion,
    registered_conversions,
    unregister_conversion,
)
from scalestate.nn.linear import Linear, linear

__all__ = [
    "ConversionFn",
    "ConversionRequest",
    "Linear",
    "convert",
    "linear",
    "register_conversion",
    "registered_conversions",
    "unregister_conversion",
]
