"""The dequantizations the emulation backend keeps (:meth:`EmulationBackend.keep_dequantized
<scalestate.backends.emulation.EmulationBackend.keep_dequantized>`).

A kept copy is the float32 dequantization of one FP8 tensor with one
``scale_inv``, kept while that FP8 data lives (the table holds the data
weakly) and served for the data and for its transpose. A *brief* copy is
written into a buffer its thread reuses: it serves that thread only, and is
forgotten when the next brief copy takes the buffer. A *saved* copy (of an
input saved for a backward) counts against a limit in bytes: keeping one
beyond it forgets the oldest saved copies first.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict

from torch import Tensor

from scalestate.backends.emulation_cpu import Scratch
from scalestate.quantized import Quantized

__all__ = ["KeptCopies"]


class KeptCopies:
    """FP8 data -> (its ``scale_inv``, its dequantization, the thread whose buffer holds it or None).

    A dictionary by the data's ``id``, each entry with a weak reference to
    the data whose callback removes it (a lookup costs a dictionary read, not
    the weak-reference objects of ``torch.utils.weak``).
    """

    def __init__(self) -> None:
        #: id(data) -> (weak reference to data, scale_inv, values, thread or None)
        self._kept: dict[int, tuple[weakref.ref[Tensor], Tensor, Tensor, int | None]] = {}
        #: The saved copies, oldest first: id(data) -> (the entry's weak reference, bytes); and their bytes.
        self._saved: OrderedDict[int, tuple[weakref.ref[Tensor], int]] = OrderedDict()
        self._saved_bytes = 0
        self._lock = threading.RLock()  # over the saved copies' accounting (a callback may run inside it)

    def __bool__(self) -> bool:
        return bool(self._kept)

    def _entry(self, data: Tensor) -> tuple[weakref.ref[Tensor], Tensor, Tensor, int | None] | None:
        """The entry of ``data`` itself (not of an earlier tensor whose ``id`` it took over), or None."""
        entry = self._kept.get(id(data))
        return entry if entry is not None and entry[0]() is data else None

    def _put(self, data: Tensor, scale_inv: Tensor, values: Tensor, thread: int | None) -> None:
        key = id(data)
        owner = weakref.ref(self)

        def forget(ref: weakref.ref[Tensor]) -> None:  # data died: drop its entry, if still its own
            copies = owner()
            if copies is not None:
                copies._drop(key, ref)

        self._drop(key, None)  # a copy of this data with another scale_inv
        self._kept[key] = (weakref.ref(data, forget), scale_inv, values, thread)

    def _drop(self, key: int, ref: weakref.ref[Tensor] | None) -> None:
        """Forget the entry under ``key`` (only if its weak reference is ``ref``, where given)."""
        with self._lock:
            entry = self._kept.get(key)
            if entry is None or (ref is not None and entry[0] is not ref):
                return
            del self._kept[key]
            saved = self._saved.get(key)
            if saved is not None and saved[0] is entry[0]:
                del self._saved[key]
                self._saved_bytes -= saved[1]

    def holds(self, data: Tensor, scale_inv: Tensor) -> bool:
        """Whether a copy of ``data`` with this very ``scale_inv`` is kept."""
        entry = self._entry(data)
        return entry is not None and entry[1] is scale_inv

    def keep(self, data: Tensor, scale_inv: Tensor, values: Tensor) -> None:
        """Keep ``values`` as the dequantization of ``data`` while it lives."""
        self._put(data, scale_inv, values, None)

    def keep_saved(self, data: Tensor, scale_inv: Tensor, values: Tensor, limit: int) -> None:
        """Keep ``values`` as :meth:`keep` does, counting its bytes against ``limit`` together with the other
        saved copies: the oldest are forgotten first until it fits (one larger than ``limit`` is not kept)."""
        size = values.numel() * values.element_size()
        if size > limit:
            return
        with self._lock:
            self._put(data, scale_inv, values, None)
            while self._saved and self._saved_bytes + size > limit:
                oldest, (ref, _) = next(iter(self._saved.items()))
                self._drop(oldest, ref)
            key = id(data)
            self._saved[key] = (self._kept[key][0], size)
            self._saved_bytes += size

    def nbytes(self) -> int:
        """The bytes of the copies kept outside reused buffers (not the brief ones)."""
        entries = list(self._kept.values())
        return sum(values.numel() * values.element_size() for _, _, values, thread in entries if thread is None)

    def keep_brief(self, data: Tensor, scale_inv: Tensor, values: Tensor, scratch: Scratch, name: str) -> None:
        """Keep ``values``, written into this thread's buffer ``name`` of ``scratch``, for this thread, and
        record that the buffer now holds ``data``'s copy. Call :meth:`take_buffer` (which forgets the copy the
        buffer held before) before writing ``values`` into it."""
        self._put(data, scale_inv, values, threading.get_ident())
        scratch.holders()[name] = weakref.ref(data)

    def take_buffer(self, scratch: Scratch, name: str) -> None:
        """Forget the brief copy this thread's buffer ``name`` holds, about to be overwritten."""
        previous = scratch.holders().pop(name, None)
        data = None if previous is None else previous()
        if data is not None:
            entry = self._entry(data)
            if entry is not None and entry[3] == threading.get_ident():
                self._drop(id(data), entry[0])

    def get(self, q: Quantized, brief: bool) -> Tensor | None:
        """The kept dequantization of ``q`` (per tensor): of its data, or the transpose of its data's
        (with ``brief``, also this thread's brief copies); None if there is none."""
        if q.tile is not None or not self._kept:
            return None
        data = q.data
        base = data if data._base is None else data._base
        kept = self._entry(base)
        if kept is None or kept[1] is not q.scale_inv:
            return None
        if kept[3] is not None and (not brief or kept[3] != threading.get_ident()):
            return None
        values = kept[2]
        if data.storage_offset() == base.storage_offset():
            if data.shape == base.shape and data.stride() == base.stride():
                return values
            if data.shape == base.shape[::-1] and data.stride() == base.stride()[::-1]:
                return values.t()
        return None
