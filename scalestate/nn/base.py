"""What the FP8 modules of `scalestate.nn` share: a module base with one weight slot, and its cast.

:class:`WeightSlotModule` is the base of ``ss.nn.Linear`` and of the layers the
integrations build (transformers' ``Conv1D``, torchao's ``Float8Linear``): it
registers the slot, wraps the weight for an FP8 all-gather under FSDP2, and
drops the cached weight cast when FSDP2 sets the weight. :func:`quantize_weight`
is the weight cast of every product, whether FSDP2 gathered the weight in FP8
or not. :func:`free_name` and :func:`check_module_arguments` serve the module
constructors and the converters.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import Tensor

from scalestate.errors import ArgumentTypeError, CastError
from scalestate.handle import ScalingHandle
from scalestate.manager import ScalingStateManager
from scalestate.nn.fsdp import FP8AllGatherWeight, plain_state_dict, wrap_weight
from scalestate.nn.fsdp_gathered import GatheredFP8Weight
from scalestate.quantized import Quantized
from scalestate.recipe import Role

__all__ = ["WeightSlotModule", "check_module_arguments", "free_name", "quantize_weight"]


class WeightSlotModule(torch.nn.Module):
    """What an FP8 module with one ``weight`` parameter shares (``Linear``, ``Conv1D``):
    its slot, its FP8 all-gather wrapping, and dropping its cached cast when FSDP2 sets the weight."""

    handle: ScalingHandle
    #: Whether FSDP2 all-gathers the weight in FP8 (fixed at construction).
    fp8_all_gather: bool

    def bind_slot(self, manager: ScalingStateManager, name: str | None, default: str, fp8_all_gather: bool) -> None:
        """Register the slot (``name``, or ``default`` made unique) and wrap the weight for an FP8 all-gather."""
        self.handle = manager.register(name if name is not None else free_name(manager, default), roles=tuple(Role))
        self.fp8_all_gather = fp8_all_gather
        if fp8_all_gather:
            # setattr: subclasses type `weight` as their bases do (Tensor, Parameter); this works on each
            setattr(self, "weight", wrap_weight(self.get_parameter("weight"), self.handle))  # noqa: B010
            # torch leaves register_state_dict_post_hook untyped
            self.register_state_dict_post_hook(plain_state_dict)  # type: ignore[no-untyped-call]

    def __setattr__(self, name: str, value: Any) -> None:
        """As ``torch.nn.Module``'s; a new ``weight`` drops the slot's cached weight cast.

        FSDP2 sets the weight at every all-gather and reshard (a module that
        overrides ``__setattr__`` gets the call), and refills the unsharded
        weight in place with its version counter preserved: without this, a
        cast cached before an in-place edit of the sharded weight could be
        reused. The FP8 all-gather keys its casts on the shard instead.
        """
        super().__setattr__(name, value)
        if name == "weight" and not self.__dict__.get("fp8_all_gather", True):
            self.handle.invalidate_casts()


def check_module_arguments(manager: object, fp8_all_gather: object) -> None:
    """The checks of an FP8 module's ``manager`` and ``fp8_all_gather`` arguments.

    Raises:
        ArgumentTypeError: ``manager`` is not a manager, or ``fp8_all_gather`` not a bool.
        CastError: ``fp8_all_gather=True`` with a fine-grained recipe.
    """
    if not isinstance(manager, ScalingStateManager):
        raise ArgumentTypeError(f"manager must be a ScalingStateManager; got {type(manager).__name__}")
    if not isinstance(fp8_all_gather, bool):
        raise ArgumentTypeError(f"fp8_all_gather must be True or False; got {fp8_all_gather!r}")
    if fp8_all_gather and manager.recipe.granularity(Role.WEIGHT) is not None:
        raise CastError(
            f"fp8_all_gather=True casts each FSDP shard with its slot's one per-tensor scale; "
            f"{type(manager.recipe).__name__} scales rows, tiles or blocks. Use fp8_all_gather=False "
            "with this recipe (FSDP2 then gathers the high-precision weight), or a per-tensor recipe"
        )


def quantize_weight(handle: ScalingHandle, weight: Tensor, *, transpose: bool = False) -> Quantized:
    """The FP8 weight of a product: the FP8 all-gather's output if FSDP made one, else a cast.

    In every case the WEIGHT slot is accounted for exactly as by
    ``handle.quantize(weight, Role.WEIGHT)``.
    """
    if isinstance(weight, GatheredFP8Weight):
        return weight.quantized(transpose=transpose)
    if isinstance(weight, FP8AllGatherWeight):  # not sharded: cast the values it wraps
        weight = weight.wrapped
    return handle.quantize(weight, Role.WEIGHT, transpose=transpose)


#: Per manager and base name, the suffix below which every ``base_<i>`` is taken (names are never
#: unregistered, so the search for a free one starts there): constant time per default name.
_NEXT_SUFFIX: weakref.WeakKeyDictionary[ScalingStateManager, dict[str, int]] = weakref.WeakKeyDictionary()


def free_name(manager: ScalingStateManager, base: str) -> str:
    """``base``, or ``base_1``, ``base_2``, ... : the first name not yet registered with ``manager``.

    Amortized constant time: the search resumes where the last one for ``base`` stopped.
    """
    taken = manager.handles
    if base not in taken:
        return base
    hints = _NEXT_SUFFIX.setdefault(manager, {})
    i = hints.get(base, 1)
    while f"{base}_{i}" in taken:
        i += 1
    hints[base] = i
    return f"{base}_{i}"
