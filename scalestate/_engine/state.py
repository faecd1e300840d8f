"""The one mutable object behind a manager: slot buffers and step bookkeeping."""

from __future__ import annotations

import attrs
import torch
from torch import Tensor

from scalestate._engine.cache import WeightCastCache
from scalestate._engine.debug import RecomputeChecker
from scalestate._engine.randomness import Randomness
from scalestate._engine.rows import RowViews
from scalestate._engine.stepwatch import StepWatch
from scalestate.backends.base import CastSpec, StepUpdate
from scalestate.errors import SlotError
from scalestate.math import ScaleRule
from scalestate.phase import PhaseStack
from scalestate.recipe import Direction, Role

__all__ = ["Slot", "State"]

#: Rows of the first allocation; capacity doubles from there.
_FIRST_CAPACITY = 16


@attrs.frozen(eq=False)
class Slot:
    """One (name, role) pair: a row of every buffer.

    Handles hold slots as opaque references and hand them back to their
    manager; only the manager and its :class:`State` read the fields.
    """

    name: str
    role: Role
    spec: CastSpec
    row: int
    #: The role is cast in the forward pass (INPUT, WEIGHT).
    forward: bool
    #: Reduced across the ranks of the manager's group at each step (False: rank-local).
    reduce: bool = True


class State:
    """Slot buffers and the bookkeeping of a step, owned by one manager.

    Every kind of per-slot value lives in one contiguous float32 buffer with a
    row per slot (``[capacity, H]`` histories, ``[capacity]`` scales, step
    accumulators and format maxima); the properties :attr:`history`,
    :attr:`scales`, :attr:`step_amax` and :attr:`fp8_max` are views of the
    rows in use. Registration fills free rows, doubling the capacity when
    none is left (amortized O(1) per slot). Once :meth:`freeze` has run (at the
    first step) buffers never move again, so CUDA graphs and external views
    stay valid; a registration that would need more rows then raises,
    unless capacity was reserved beforehand.
    """

    def __init__(
        self,
        device: torch.device,
        history_len: int,
        *,
        debug: bool = False,
        stats: bool = False,
        seed: int = 0,
        draws: bool = False,
    ) -> None:
        self._device = device
        self._history_len = history_len
        self._capacity = 0
        self._slots: list[Slot] = []
        self._history = self._alloc(0, history_len)
        self._scales = self._alloc(0, fill=1.0)
        self._step_amax = self._alloc(0)
        self._fp8_max = self._alloc(0)
        self._nonfinite = self._alloc_counts(0)
        #: NVFP4's seed, RHT signs and stochastic-rounding counters.
        self._random = Randomness(device, seed, counting=draws)
        #: Cast statistics (COUNT_FIELDS per row): this step's, and the last completed step's.
        self._stats = bool(stats)
        self._counts = self._alloc_counts(0, 4)
        self._last_counts = self._alloc_counts(0, 4)
        self._frozen = False
        #: Per-row index tensors (compiled code) and views (eager casts) of the buffers.
        self._rows = RowViews()
        self._pinned = False
        self._iteration = 0
        self._epoch = 0
        #: False until the first step or load: every row is then without history.
        self._may_have_history = False
        #: Rows known to have history (a row never loses it).
        self._with_history: set[int] = set()
        #: Names whose forward / backward casts were recorded in this step.
        self._forward_recorded: set[str] = set()
        self._backward_recorded: set[str] = set()
        self._phases = PhaseStack()
        self._watch = StepWatch()
        self._casts = WeightCastCache()
        self._checker = RecomputeChecker() if debug else None

    # ------------------------------------------------------- bookkeeping
    @property
    def pinned(self) -> bool:
        """True once a tensor was cast: the device is then fixed (until an explicit move)."""
        return self._pinned

    def pin(self) -> None:
        """Fix the device."""
        self._pinned = True

    @property
    def iteration(self) -> int:
        """Number of step() calls (restored by a load)."""
        return self._iteration

    @property
    def epoch(self) -> int:
        """Bumped whenever scales may change (step, load); weight casts are valid for one epoch."""
        return self._epoch

    @property
    def phases(self) -> PhaseStack:
        """Per-thread phases and open blocks."""
        return self._phases

    @property
    def watch(self) -> StepWatch:
        """The signs of a forgotten step() since the last one."""
        return self._watch

    @property
    def casts(self) -> WeightCastCache:
        """Cached weight casts."""
        return self._casts

    @property
    def random(self) -> Randomness:
        """NVFP4's seed, RHT signs and stochastic-rounding counters."""
        return self._random

    @property
    def checker(self) -> RecomputeChecker | None:
        """Debug mode's check that recomputes reproduce their forward (None outside debug mode)."""
        return self._checker

    def note_recorded(self, slot: Slot) -> None:
        """A cast of ``slot`` was recorded in this step."""
        (self._forward_recorded if slot.forward else self._backward_recorded).add(slot.name)
        self._watch.recorded(slot.forward)

    @property
    def recorded_since_step(self) -> bool:
        """True if any cast was recorded since the last step."""
        return bool(self._forward_recorded or self._backward_recorded)

    def backward_only(self) -> list[str]:
        """Names recorded in this step by backward casts only, sorted."""
        return sorted(self._backward_recorded - self._forward_recorded)

    # ------------------------------------------------------------ buffers
    def _alloc(self, rows: int, cols: int | None = None, *, fill: float = 0.0) -> Tensor:
        shape = (rows,) if cols is None else (rows, cols)
        return torch.full(shape, fill, dtype=torch.float32, device=self._device)

    def _alloc_counts(self, rows: int, cols: int | None = None) -> Tensor:
        shape = (rows,) if cols is None else (rows, cols if self._stats else 0)
        return torch.zeros(shape, dtype=torch.int64, device=self._device)

    @property
    def device(self) -> torch.device:
        """Where the buffers live."""
        return self._device

    @property
    def history_len(self) -> int:
        """Columns of the history buffer."""
        return self._history_len

    @property
    def capacity(self) -> int:
        """Rows allocated (at least the number of slots)."""
        return self._capacity

    @property
    def slots(self) -> tuple[Slot, ...]:
        """Every slot, in row order."""
        return tuple(self._slots)

    def __len__(self) -> int:
        return len(self._slots)

    @property
    def history(self) -> Tensor:
        """``[N, H]`` view of the histories in use, newest last."""
        return self._history[: len(self._slots)]

    @property
    def scales(self) -> Tensor:
        """``[N]`` view of the current scales."""
        return self._scales[: len(self._slots)]

    @property
    def step_amax(self) -> Tensor:
        """``[N]`` view of the amaxes recorded since the last step."""
        return self._step_amax[: len(self._slots)]

    @property
    def fp8_max(self) -> Tensor:
        """``[N]`` view of each slot's format maximum."""
        return self._fp8_max[: len(self._slots)]

    @property
    def nonfinite(self) -> Tensor:
        """``[N]`` int64 view of the number of steps with a non-finite amax, per slot."""
        return self._nonfinite[: len(self._slots)]

    @property
    def stats(self) -> bool:
        """Whether casts are counted (``collect_stats``)."""
        return self._stats

    @property
    def last_counts(self) -> Tensor:
        """``[N, 4]`` int64 cast statistics of the last completed step (empty when not collected)."""
        return self._last_counts[: len(self._slots)]

    def add_counts(self, slot: Slot, elements: int | Tensor, counts: Tensor) -> None:
        """Add one recorded cast's statistics (see `scalestate._engine.counting.cast_counts`) to this step's."""
        row = self._counts[slot.row]
        row[0].add_(elements)
        row[1:].add_(counts)

    def scale_of(self, slot: Slot) -> Tensor:
        """0-d view of ``slot``'s scale."""
        return self._scales[slot.row]

    def views_of(self, slot: Slot) -> tuple[Tensor, Tensor]:
        """0-d views of ``slot``'s scale and step accumulator, made once per buffer allocation (eager casts)."""
        return self._rows.views(slot.row, len(self._slots), self._scales, self._step_amax)

    def read_row(self, slot: Slot) -> tuple[Tensor, Tensor]:
        """Compiled code: ``slot``'s scale and accumulator (see RowViews.read)."""
        return self._rows.read(slot.row, slot.spec, self._scales, self._step_amax)

    def row_index(self, slot: Slot) -> Tensor:
        """``[1]`` int64 tensor of ``slot``'s row: compiled code indexes with it (a graph input, not a constant)."""
        return self._rows.index(slot.row)

    def write_accumulator(self, slot: Slot, value: Tensor) -> None:
        """Compiled code: store an accumulator read by :meth:`read_row`."""
        self._rows.write(slot.row, slot.spec, self._step_amax, value)

    def history_of(self, slot: Slot) -> Tensor:
        """``[H]`` view of ``slot``'s history."""
        return self._history[slot.row]

    def step_update(self, rule: ScaleRule, *, count: bool, forget: bool) -> StepUpdate:
        """The buffers in use, as a backend's step update (``count``: non-finite amaxes;
        ``forget``: their histories, the fallback policy)."""
        counts = self.nonfinite if count else None
        return StepUpdate(self.history, self.scales, self.step_amax, self.fp8_max, rule, counts, forget)

    # ------------------------------------------------------- registration
    def reserve(self, rows: int) -> None:
        """Make room for ``rows`` slots in all (moving the buffers, so only before the first step)."""
        if rows <= self._capacity:
            return
        if self._frozen:
            raise SlotError(
                f"cannot grow the state to {rows} slots after the first step(): its buffers hold "
                f"{self._capacity} rows and never move once training has started (CUDA graphs and "
                "external views depend on their addresses). Register every slot before the first "
                f"step(), or call manager.reserve({rows}) (or more) before it"
            )
        n, capacity = len(self._slots), max(self._capacity, _FIRST_CAPACITY)
        while capacity < rows:
            capacity *= 2
        history = self._alloc(capacity, self._history_len)
        scales = self._alloc(capacity, fill=1.0)
        step_amax = self._alloc(capacity)
        fp8_max = self._alloc(capacity)
        nonfinite = self._alloc_counts(capacity)
        nonfinite[:n] = self._nonfinite[:n]
        self._random.grow(capacity, n)
        if self._stats:  # without collect_stats the counters stay empty: growth costs nothing more
            counts, last_counts = self._alloc_counts(capacity, 4), self._alloc_counts(capacity, 4)
            counts[:n], last_counts[:n] = self._counts[:n], self._last_counts[:n]
            self._counts, self._last_counts = counts, last_counts
        history[:n] = self._history[:n]
        scales[:n] = self._scales[:n]
        step_amax[:n] = self._step_amax[:n]
        fp8_max[:n] = self._fp8_max[:n]
        self._history, self._scales, self._step_amax, self._fp8_max = history, scales, step_amax, fp8_max
        self._nonfinite = nonfinite
        self._capacity = capacity
        self._rows = RowViews(capacity, self._device)

    def add(self, name: str, specs: dict[Role, CastSpec], *, reduce: bool = True) -> dict[Role, Slot]:
        """New rows for ``name``'s roles (zero history, scale 1): their slots, by role."""
        first = len(self._slots)
        if first + len(specs) > self._capacity:
            self.reserve(first + len(specs))
        added = {}
        for i, (role, spec) in enumerate(specs.items()):
            slot = Slot(name, role, spec, first + i, role.direction is Direction.FORWARD, reduce)
            self._fp8_max[slot.row] = spec.fp8_max
            self._random.add(slot.row, name, role.value)
            self._slots.append(slot)
            added[role] = slot
        return added

    def freeze(self) -> None:
        """From now on the buffers never move (called at the first step)."""
        self._frozen = True

    def to(self, device: torch.device) -> None:
        """Move every buffer to ``device`` (values kept; an explicit move, frozen or not)."""
        self._history = self._history.to(device)
        self._scales = self._scales.to(device)
        self._step_amax = self._step_amax.to(device)
        self._fp8_max = self._fp8_max.to(device)
        self._nonfinite = self._nonfinite.to(device)
        self._random.to(device)
        self._counts = self._counts.to(device)
        self._last_counts = self._last_counts.to(device)
        self._device = device
        self._rows = RowViews(self._capacity, device)
        self._casts.clear()

    # ------------------------------------------------------------- values
    def jit(self, slot: Slot, *, delayed: bool, compiling: bool, host: bool = False) -> bool | Tensor:
        """Whether a cast of ``slot`` scales from its own tensor.

        Always for current scaling; for delayed scaling while the slot has no
        history (its newest entry is 0). Decided on the host where that is
        free (before any step, on the CPU, or once known), else on the device
        with no sync; always on the device while compiling, so that no host
        value becomes a guard. ``host=True`` (eager only): decided on the host
        on every device, reading the newest entry there while the slot is not
        known to have history (a device sync on GPUs; once known, it stays
        known until a load or a step that may forget histories).
        """
        if not delayed:
            return True
        if compiling:
            return self._rows.newest(slot.row, slot.spec, self._history) <= 0
        if not self._may_have_history:
            return True
        if slot.row in self._with_history:
            return False
        newest = self._history[slot.row, -1]
        if self._device.type != "cpu" and not host:
            return newest <= 0
        if float(newest) > 0:
            self._with_history.add(slot.row)
            return False
        return True

    def load(
        self,
        history: Tensor,
        scales: Tensor,
        step_amax: Tensor,
        iteration: int,
        nonfinite: Tensor | None = None,
        ordinals: Tensor | None = None,
    ) -> None:
        """Overwrite the values of every slot in place (already validated and ordered);
        what was recorded since the last step is replaced by the loaded ``step_amax``."""
        self.history.copy_(history)
        self.scales.copy_(scales)
        self.step_amax.copy_(step_amax)
        if nonfinite is not None:
            self.nonfinite.copy_(nonfinite)
        self._random.load(iteration, ordinals, len(self._slots))
        if self._stats:  # cast statistics are not saved: a load starts them afresh
            self._counts.zero_()
            self._last_counts.zero_()
        self._iteration = iteration
        self._with_history.clear()
        self._forget_recorded()
        self._new_epoch()

    def end_step(self, *, histories_may_vanish: bool = False) -> None:
        """Forget the step's bookkeeping after the buffers were updated.

        ``histories_may_vanish``: the step may have zeroed histories (the
        fallback policy), so which rows have history must be read again.
        """
        self._iteration += 1
        self._random.end_step()
        self._forget_recorded()
        if self._stats:
            self._last_counts.copy_(self._counts)
            self._counts.zero_()
        if histories_may_vanish:
            self._with_history.clear()
        self._new_epoch()

    def discard(self) -> None:
        """Drop everything recorded since the last step, as if it had not run."""
        self.step_amax.zero_()
        self._random.discard()
        if self._stats:
            self._counts.zero_()
        self._forget_recorded()
        self._new_epoch()

    def _forget_recorded(self) -> None:
        self._forward_recorded.clear()
        self._backward_recorded.clear()
        self._watch.reset()

    def _new_epoch(self) -> None:
        """Scales may have changed: weight casts (void by their epoch, not swept: see
        WeightCastCache) and debug mode's pending amaxes are void."""
        self._epoch += 1
        self._may_have_history = True
        if self._checker is not None:
            self._checker.clear()
