"""The weight-cast cache: one cast per (weight, version, scale epoch)."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import attrs
import torch
from torch import Tensor

from scalestate.quantized import Quantized

if TYPE_CHECKING:
    from scalestate._engine.state import Slot

__all__ = ["CachedCast", "WeightCastCache"]


@attrs.frozen(eq=False)
class CachedCast:
    """A weight cast, valid while the weight and the scale epoch are unchanged."""

    source: weakref.ref[Tensor]
    data_ptr: int
    version: int
    epoch: int
    quantized: Quantized
    #: 0-d amax of the weight, kept for training uses when the cast itself
    #: recorded nothing; ``None`` when the cast wrote it into the slot's
    #: accumulator (which only grows within an epoch: later uses add nothing).
    amax: Tensor | None
    #: For a shard: the whole tensor's amax it was cast with (a tensor or a function; ``None``: a whole tensor).
    whole: object = None

    def matches(self, x: Tensor, epoch: int, whole: object = None) -> bool:
        """True if ``x`` is the very tensor cast, unmodified, in this epoch (a shard: with the same whole amax)."""
        return (
            self.epoch == epoch
            and self.source() is x
            and self.whole is whole
            and self.version == x._version
            and self.data_ptr == x.data_ptr()
        )


class WeightCastCache:
    """Cached weight casts, one per slot.

    A weight is cast once per scale epoch (the scales change only at a step or
    a load) and reused by every microbatch, recompute and evaluation pass
    until it changes: PyTorch's version counter sees every in-place update
    (optimizer steps, ``load_state_dict``, ``copy_``), and the tensor's
    identity and storage address see a replaced parameter. Two writes escape
    them: an edit through ``.data``, and FSDP2's all-gather, which refills
    the unsharded weight in place with its version counter preserved, often
    at the same address. ``manager.invalidate_casts()`` and
    ``handle.invalidate_casts()`` cover them (``ss.nn.Linear`` calls the
    latter whenever FSDP2 swaps its weight).

    A new scale epoch voids every entry by its epoch, without a sweep (a step
    costs the same however many weights are cached); a stale entry is
    released when its weight is cast again, or by ``invalidate_casts()``.
    """

    def __init__(self) -> None:
        self._entries: dict[int, CachedCast] = {}

    def __reduce__(self) -> tuple[type[WeightCastCache], tuple[()]]:
        """A copy starts empty: the casts are derived data, keyed by the original tensors
        (a copy recasts each weight once, recording it again: the max is unchanged)."""
        return WeightCastCache, ()

    def get(self, slot: Slot, x: Tensor, epoch: int, whole: object = None) -> CachedCast | None:
        """The cached cast of ``x`` for ``slot`` if still valid, else ``None`` (``whole``: see CachedCast)."""
        entry = self._entries.get(slot.row)
        return entry if entry is not None and entry.matches(x, epoch, whole) else None

    def modified_in_place(self, slot: Slot, x: Tensor, epoch: int) -> bool:
        """True if the cast of ``slot`` in this epoch was of this very tensor, which has since been
        modified in place (its version counter moved): an optimizer step within one scale epoch."""
        entry = self._entries.get(slot.row)
        return (
            entry is not None
            and entry.epoch == epoch
            and entry.source() is x
            and entry.version != x._version
        )

    def put(
        self, slot: Slot, x: Tensor, epoch: int, quantized: Quantized, amax: Tensor | None, whole: object = None
    ) -> None:
        """Remember a cast of ``x`` (``amax=None``: it was recorded into the slot's accumulator);
        inference tensors (which track no version) are not kept."""
        if torch.is_inference_mode_enabled() or x.is_inference():
            return
        self._entries[slot.row] = CachedCast(weakref.ref(x), x.data_ptr(), x._version, epoch, quantized, amax, whole)

    def forget(self, slot: Slot) -> None:
        """Forget the cast of ``slot``, if any."""
        self._entries.pop(slot.row, None)

    def clear(self) -> None:
        """Forget every cast."""
        self._entries.clear()
