"""The manager's cast path: classify each cast, pick its scale and record target, call the backend.

Eager casts of ``WEIGHT`` go through the weight-cast cache (one cast per
tensor version and scale epoch); debug mode keeps every forward amax for its
recompute check. Compiled code takes the plain path: the cache is bypassed
and the classification is made at trace time.

Every eager cast runs out of sight of selective activation checkpointing
(:func:`scalestate.sac.hidden_from_sac`): whether and how it runs depends on
the cache, the phase and debug mode, so SAC must neither number nor keep its
operations.

With ``collect_stats``, every recorded cast also adds what it did to its
elements (:func:`scalestate.diagnostics.cast_counts`) to the slot's counters,
on the device; recompute and evaluation casts count nothing, as they record
nothing. A cached weight cast counts at every training use that records it
(its counts are computed once per cast and scale epoch, then added).
"""

from __future__ import annotations

import torch
from torch import Tensor

from scalestate.backends import CastRequest
from scalestate.binding import BackendBinding, settle_during_trace
from scalestate.diagnostics import cast_counts
from scalestate.errors import CastError, PhaseError
from scalestate.phase import CastKind, classify, in_training_function_forward, read_signals
from scalestate.quantized import Quantized
from scalestate.recipe import Direction, Role
from scalestate.sac import hidden_from_sac
from scalestate.state import Slot, State

__all__ = ["Caster"]


class Caster:
    """Casts for one manager's state through its backend binding."""

    def __init__(self, state: State, binding: BackendBinding, *, delayed: bool) -> None:
        self._state = state
        self._binding = binding
        self._delayed = delayed
        #: collect_stats, fixed for the manager's life (read once: the cast path pays a flag test only).
        self._stats = state.stats
        #: Per weight row: (epoch, elements, counts) of its cached cast (collect_stats only).
        self._weight_counts: dict[int, tuple[int, int, Tensor]] = {}

    def cast(self, slot: Slot, x: Tensor, transpose: bool) -> Quantized:
        """A handle's cast: classify it, then cast through the backend (see ScalingHandle.quantize)."""
        if not isinstance(x, Tensor) or not x.is_floating_point():
            raise CastError(
                f"slot {slot.name!r} {slot.role.name}: expected a floating-point tensor; "
                f"got {x.dtype if isinstance(x, Tensor) else type(x).__name__}"
            )
        if transpose and x.dim() != 2:
            raise CastError(
                f"slot {slot.name!r} {slot.role.name}: transpose=True needs a 2-d tensor; got shape {tuple(x.shape)}"
            )
        if torch.compiler.is_compiling():
            settle_during_trace(self._binding, x.device)
            return self._cast(slot, x, transpose, compiling=True)
        # Out of sight of selective checkpointing (see scalestate.sac): whether and how this
        # cast runs depends on the cache, the phase and debug mode, not only on the region.
        with hidden_from_sac():
            if not self._binding.ready or x.device != self._state.device:
                self._binding.settle(x.device)
            return self._cast(slot, x, transpose, compiling=False)

    def _cast(self, slot: Slot, x: Tensor, transpose: bool, *, compiling: bool) -> Quantized:
        st = self._state
        kind = self._classify(slot, compiling) if slot.forward else CastKind.RECORD
        if slot.role is Role.WEIGHT and not compiling:
            return self._cast_weight(slot, x, kind, transpose)
        if st.checker is not None and not compiling and kind is not CastKind.EVALUATION:
            q, amax = self._cast_keeping_amax(slot, x, transpose)
            self._record(slot, kind, amax)
            if kind is CastKind.RECORD and self._stats:
                st.add_counts(slot, *cast_counts(x, q, slot.spec.fp8_max))
            return q
        # Eager casts reuse views made once; compiled code derives them from the buffers itself.
        scale, acc = (st.scale_of(slot), st.accumulator_of(slot)) if compiling else st.views_of(slot)
        record = acc if kind is CastKind.RECORD else None
        jit = st.jit(slot, delayed=self._delayed, compiling=compiling)
        request = CastRequest(x.detach() if x.requires_grad else x, slot.spec, scale, jit, record, transpose)
        q = self._binding.backend.cast(request)
        if record is not None:
            if not compiling:
                st.note_recorded(slot)
            if self._stats:
                st.add_counts(slot, *cast_counts(x, q, slot.spec.fp8_max))
        return q

    def _classify(self, slot: Slot, compiling: bool) -> CastKind:
        signals = read_signals(self._state.phases.phase, compiling=compiling)
        kind = classify(Direction.FORWARD, signals, None if compiling else in_training_function_forward)
        if kind is CastKind.MISPLACED:
            raise PhaseError(
                f"{slot.role.name} cast of slot {slot.name!r} in the BACKWARD phase, outside autograd's "
                "backward: call begin_forward() before a new forward pass, begin_recompute() "
                "before recomputing one, or run an evaluation pass under torch.no_grad()"
            )
        return kind

    def _cast_keeping_amax(self, slot: Slot, x: Tensor, transpose: bool) -> tuple[Quantized, Tensor]:
        """An eager cast that records its amax into a fresh 0-d tensor (for the cache and debug mode)."""
        amax = torch.zeros((), dtype=torch.float32, device=self._state.device)
        return self._eager_cast(slot, x, transpose, amax), amax

    def _eager_cast(self, slot: Slot, x: Tensor, transpose: bool, record: Tensor | None) -> Quantized:
        st = self._state
        jit = st.jit(slot, delayed=self._delayed, compiling=False)
        request = CastRequest(x.detach(), slot.spec, st.views_of(slot)[0], jit, record, transpose)
        return self._binding.backend.cast(request)

    def _cast_weight(self, slot: Slot, x: Tensor, kind: CastKind, transpose: bool) -> Quantized:
        """Weights are cast once per (tensor version, scale epoch); every training use records.

        A training cast writes its amax straight into the slot's accumulator in
        the backend's pass; later uses in the epoch have nothing to add. A cast
        made in recompute or evaluation (or in debug mode, which compares every
        amax) keeps its amax aside for the training uses that hit it.
        """
        st = self._state
        entry = st.casts.get(slot, x, st.epoch)
        usable = entry is not None and (not transpose or entry.quantized.transposed is not None)
        if entry is not None and usable and (entry.amax is not None or st.checker is None):
            if entry.amax is not None:
                self._record(slot, kind, entry.amax)
            elif kind is CastKind.RECORD:
                st.note_recorded(slot)
            if kind is CastKind.RECORD and self._stats:
                self._count_weight(slot, x, entry.quantized)
            # What was asked for, whatever the cast held: a recompute that misses gets the same.
            return entry.quantized if transpose else entry.quantized.rowwise()
        if self._stats:
            self._weight_counts.pop(slot.row, None)  # a new cast: counts of the old one no longer apply
        if kind is CastKind.RECORD and st.casts.modified_in_place(slot, x, st.epoch):
            st.watch.weight_updated(slot.row)  # updated within a step: an optimizer step without step()?
        if kind is CastKind.RECORD and st.checker is None:
            q = self._eager_cast(slot, x, transpose, st.views_of(slot)[1])
            st.casts.put(slot, x, st.epoch, q, None)
            st.note_recorded(slot)
        else:
            q, amax = self._cast_keeping_amax(slot, x, transpose)
            st.casts.put(slot, x, st.epoch, q, amax)
            self._record(slot, kind, amax)
        if kind is CastKind.RECORD and self._stats:
            self._count_weight(slot, x, q)
        return q

    def _count_weight(self, slot: Slot, x: Tensor, q: Quantized) -> None:
        """Add a training use of a (cached) weight cast to the slot's counters, counting it once per epoch."""
        st = self._state
        known = self._weight_counts.get(slot.row)
        if known is None or known[0] != st.epoch:
            known = self._weight_counts[slot.row] = (st.epoch, *cast_counts(x, q, slot.spec.fp8_max))
        st.add_counts(slot, known[1], known[2])

    def _record(self, slot: Slot, kind: CastKind, amax: Tensor) -> None:
        """Account for a cast whose amax is known: max it in if recorded; feed debug mode."""
        st = self._state
        if kind is CastKind.RECORD:
            acc = st.views_of(slot)[1]
            torch.maximum(acc, amax, out=acc)
            st.note_recorded(slot)
        if st.checker is not None and slot.forward:
            if kind is CastKind.RECORD:
                st.checker.forward(slot, float(amax))
            elif kind is CastKind.RECOMPUTE:
                st.checker.recompute(slot, float(amax), st.iteration)
