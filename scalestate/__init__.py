"""scalestate: the scaling state of FP8 training in PyTorch.

One :class:`ScalingStateManager` owns every FP8 scale and amax history of a
model, with explicit phases, so that activation checkpointing, microbatching
and resume behave exactly like plain training. Compute lives in pluggable
backends (:mod:`scalestate.backends`); reference FP8 modules in
:mod:`scalestate.nn`.

Example:
    >>> import torch, scalestate as ss
    >>> manager = ss.ScalingStateManager(ss.DelayedScaling(history_len=16), backend="emulation")
    >>> handle = manager.register("blocks.0.fc1", roles=(ss.Role.INPUT, ss.Role.WEIGHT, ss.Role.GRAD_OUTPUT))
    >>> q = handle.quantize(torch.randn(4, 8), ss.Role.INPUT)
    >>> q.data.dtype
    torch.float8_e4m3fn
"""

from __future__ import annotations

from scalestate import (
    backends,
    errors,
    nn,  # nn builds on the manager above
)
from scalestate.atomic import atomic_save
from scalestate.diagnostics import RiskFlag, ScalingStats, SlotStats
from scalestate.handle import ScalingHandle
from scalestate.manager import ScalingStateManager
from scalestate.nonfinite import NonFinitePolicy
from scalestate.phase import Phase
from scalestate.quantized import Quantized
from scalestate.recipe import (
    BlockScaling,
    CurrentScaling,
    DelayedScaling,
    Direction,
    Format,
    MXFP8Scaling,
    NVFP4Scaling,
    Recipe,
    Role,
    RowwiseScaling,
)
from scalestate.recompute import checkpoint
from scalestate.report import stats_from_state_dict

__version__ = "0.2.0"

__all__ = [
    "BlockScaling",
    "CurrentScaling",
    "DelayedScaling",
    "Direction",
    "Format",
    "MXFP8Scaling",
    "NVFP4Scaling",
    "NonFinitePolicy",
    "Phase",
    "Quantized",
    "Recipe",
    "RiskFlag",
    "Role",
    "RowwiseScaling",
    "ScalingHandle",
    "ScalingStateManager",
    "ScalingStats",
    "SlotStats",
    "atomic_save",
    "backends",
    "checkpoint",
    "errors",
    "nn",
    "stats_from_state_dict",
]
