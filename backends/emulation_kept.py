"""The dequantizations the emulation backend keeps (:meth:`EmulationBackend.keep_dequantized
<scalestate.backends.emulation.EmulationBackend.keep_dequantized>`).

A kept copy is the float32 dequantization of one FP8 tensor with one
``scale_inv``, kept while that FP8 data lives (the table holds the data
weakly) and served for the data and for its transpose. A *brief* copy is
written into a buffer its thread reuses: it serves that thread only, and is
forgotten when the next brief copy takes the buffer.
"""

from __future__ import annotations

import threading
import weakref

from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from scalestate.backends.emulation_cpu import Scratch
from scalestate.quantized import Quantized

__all__ = ["KeptCopies"]


class KeptCopies:
    """FP8 data -> (its ``scale_inv``, its dequantization, the thread whose buffer holds it or None)."""

    def __init__(self) -> None:
        self._kept: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def __bool__(self) -> bool:
        return bool(self._kept)

    def holds(self, data: Tensor, scale_inv: Tensor) -> bool:
        """Whether a copy of ``data`` with this very ``scale_inv`` is kept."""
        kept = self._kept.get(data)  # type: ignore[no-untyped-call]  # untyped in torch
        return kept is not None and kept[0] is scale_inv

    def keep(self, data: Tensor, scale_inv: Tensor, values: Tensor) -> None:
        """Keep ``values`` as the dequantization of ``data`` while it lives."""
        self._kept[data] = (scale_inv, values, None)

    def keep_brief(self, data: Tensor, scale_inv: Tensor, values: Tensor, scratch: Scratch, name: str) -> None:
        """Keep ``values``, written into this thread's buffer ``name`` of ``scratch``, for this thread, and
        record that the buffer now holds ``data``'s copy. Call :meth:`take_buffer` (which forgets the copy the
        buffer held before) before writing ``values`` into it."""
        self._kept[data] = (scale_inv, values, threading.get_ident())
        scratch.holders()[name] = weakref.ref(data)

    def take_buffer(self, scratch: Scratch, name: str) -> None:
        """Forget the brief copy this thread's buffer ``name`` holds, about to be overwritten."""
        previous = scratch.holders().pop(name, None)
        data = None if previous is None else previous()
        if data is not None:
            entry = self._kept.get(data)  # type: ignore[no-untyped-call]  # untyped in torch
            if entry is not None and entry[2] == threading.get_ident():
                del self._kept[data]

    def get(self, q: Quantized, brief: bool) -> Tensor | None:
        """The kept dequantization of ``q`` (per tensor): of its data, or the transpose of its data's
        (with ``brief``, also this thread's brief copies); None if there is none."""
        if q.tile is not None or not self._kept:
            return None
        data = q.data
        base = data if data._base is None else data._base
        kept = self._kept.get(base)  # type: ignore[no-untyped-call]  # untyped in torch
        if kept is None or kept[0] is not q.scale_inv:
            return None
        if kept[2] is not None and (not brief or kept[2] != threading.get_ident()):
            return None
        values: Tensor = kept[1]
        if data.storage_offset() == base.storage_offset():
            if data.shape == base.shape and data.stride() == base.stride():
                return values
            if data.shape == base.shape[::-1] and data.stride() == base.stride()[::-1]:
                return values.t()
        return None
