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
from scalestate.nn.grouped import ExpertViews, GroupedLinear, grouped_linear, register_experts
from scalestate.nn.grouped_cast import quantize_grouped, sort_by_expert
from scalestate.nn.linear import Linear, linear

__all__ = [
    "ConversionFn",
    "ConversionRequest",
    "ExpertViews",
    "GroupedLinear",
    "Linear",
    "convert",
    "grouped_linear",
    "linear",
    "quantize_grouped",
    "register_conversion",
    "register_experts",
    "registered_conversions",
    "sort_by_expert",
    "unregister_conversion",
]
