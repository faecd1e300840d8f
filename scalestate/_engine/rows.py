"""Per-row handles on the state's buffers, made outside compiled code.

Eager casts use 0-d views of a row's scale and accumulator, made once per
buffer allocation. Compiled code reads a row through that row's own
one-element index tensor. The index is then an input of the graph, not a
literal in it, so the same cast in every layer of one shape generates one
kernel source, which inductor compiles once. A literal row would make a
different kernel per layer (``in_ptr[row * H + H - 1]``), each compiled
again.
"""

from __future__ import annotations

import torch
from torch import Tensor

from scalestate.backends.base import CastSpec

__all__ = ["RowViews", "newest_at", "read_at", "write_at"]


def _indexed(spec: CastSpec) -> bool:
    """Whether compiled code reads a row of ``spec`` through its index tensor: per-tensor specs only
    (inductor 2.13 fails to generate some block casts given an indexed scale; the others read views)."""
    return spec.granularity is None


def read_at(buffer: Tensor, index: Tensor) -> Tensor:
    """Compiled code: the row ``index`` (a ``[1]`` int64 tensor) of a ``[capacity]`` buffer, as a 0-d copy."""
    return buffer.index_select(0, index).reshape(())


def newest_at(history: Tensor, index: Tensor) -> Tensor:
    """Compiled code: the newest entry of row ``index`` of the ``[capacity, H]`` history, 0-d."""
    return history.index_select(0, index)[0, -1]


def write_at(buffer: Tensor, index: Tensor, value: Tensor) -> None:
    """Compiled code: store 0-d ``value`` into row ``index`` of a ``[capacity]`` buffer (see :func:`read_at`)."""
    buffer.index_copy_(0, index, value.reshape(1))


class RowViews:
    """Each row's index tensor (made with the buffers) and its eager views (made on first use)."""

    def __init__(self, capacity: int = 0, device: torch.device | None = None) -> None:
        self._capacity, self._device = capacity, device
        # One base split into [1] views: made here, never inside a traced region,
        # where a new tensor would be traced as a constant.
        ids = torch.arange(capacity, device=device)
        self._index: tuple[Tensor, ...] = ids.split(1) if capacity else ()  # type: ignore[no-untyped-call]
        self._views: list[tuple[Tensor, Tensor]] = []

    def __reduce__(self) -> tuple[type[RowViews], tuple[int, torch.device | None]]:
        """A copy makes its index and views again (they are derived from the capacity and the buffers)."""
        return RowViews, (self._capacity, self._device)

    def index(self, row: int) -> Tensor:
        """``[1]`` int64 tensor holding ``row``, on the buffers' device."""
        return self._index[row]

    def read(self, row: int, spec: CastSpec, scales: Tensor, step_amax: Tensor) -> tuple[Tensor, Tensor]:
        """Compiled code: ``row``'s scale and accumulator, 0-d: copies read through the row's index
        (:meth:`write` stores the accumulator back), or views where the spec is not indexed."""
        if not _indexed(spec):
            return scales[row], step_amax[row]
        index = self._index[row]
        return read_at(scales, index), read_at(step_amax, index)

    def write(self, row: int, spec: CastSpec, step_amax: Tensor, value: Tensor) -> None:
        """Compiled code: store an accumulator :meth:`read` returned (a view needs nothing)."""
        if _indexed(spec):
            write_at(step_amax, self._index[row], value)

    def newest(self, row: int, spec: CastSpec, history: Tensor) -> Tensor:
        """Compiled code: ``row``'s newest history entry, 0-d, read as :meth:`read` reads."""
        if not _indexed(spec):
            return history[row, -1]
        return newest_at(history, self._index[row])

    def views(self, row: int, rows: int, scales: Tensor, step_amax: Tensor) -> tuple[Tensor, Tensor]:
        """0-d views of ``row``'s scale and accumulator (made for every row below ``rows`` at once)."""
        views = self._views
        if len(views) <= row:
            views.extend((scales[r], step_amax[r]) for r in range(len(views), rows))
        return views[row]
