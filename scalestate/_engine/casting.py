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
elements (`scalestate._engine.counting.cast_counts`) to the slot's counters,
on the device; recompute and evaluation casts count nothing, as they record
nothing. A cached weight cast counts at every training use that records it
(its counts are computed once per cast and scale epoch, then added).

A cast of a shard (:class:`ShardCast`: ``quantize(..., amax=...)``) is scaled
and recorded as the whole tensor would be: the manager derives a just-in-time
scale from the whole tensor's amax itself, hands the backend a cast with that
fixed scale and nothing to record, and maxes the whole tensor's amax into the
record target. Its counts are summed over the shard groups (one all-reduce of
four integers per group), so that they are the whole tensor's. A cast made
ahead of its use (``ahead_of_use=True``) records and counts nothing: the use,
a later cast of the same tensor, does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import attrs
import torch
from torch import Tensor

from scalestate._engine.binding import BackendBinding, settle_during_trace
from scalestate._engine.counting import cast_counts
from scalestate._engine.state import Slot, State
from scalestate.backends import CastRequest, GroupedCastRequest, SupportsGroupedCast
from scalestate.errors import ArgumentTypeError, ArgumentValueError, CastError, PhaseError
from scalestate.math import ints_on, scale_from_amax
from scalestate.phase import CastKind, classify, in_training_function_forward, read_signals
from scalestate.quantized import Quantized
from scalestate.recipe import Direction, Role
from scalestate.sac import hidden_from_sac

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["Caster", "ShardCast"]

#: What ``quantize(..., amax=...)`` takes: the whole tensor's amax, or a function returning it.
WholeAmax = Tensor | Callable[[], Tensor]


@attrs.frozen
class ShardCast:
    """What a cast of one shard knows of the whole tensor (see :meth:`ScalingHandle.quantize`)."""

    #: The whole tensor's amax, or a function that returns it, called only for a just-in-time scale.
    amax: WholeAmax
    #: The process groups whose ranks hold the other shards: cast statistics are summed over each.
    groups: tuple[ProcessGroup, ...] = ()

    @classmethod
    def of(
        cls, where: str, amax: WholeAmax | None, shard_group: ProcessGroup | Sequence[ProcessGroup] | None
    ) -> ShardCast | None:
        """The shard description of a handle's ``quantize`` arguments (``None``: a whole tensor)."""
        if amax is None:
            if shard_group is not None:
                raise ArgumentValueError(
                    f"{where}: shard_group= was given without amax=; pass the whole tensor's amax "
                    "(max-reduced over the shard group) with it, or neither for a whole tensor"
                )
            return None
        if not isinstance(amax, Tensor) and not callable(amax):
            raise ArgumentTypeError(
                f"{where}: amax must be a tensor (the whole tensor's amax) or a function returning one; "
                f"got {type(amax).__name__}"
            )
        if shard_group is None:
            groups: tuple[ProcessGroup, ...] = ()
        elif isinstance(shard_group, (list, tuple)):
            groups = tuple(shard_group)
        else:
            groups = (shard_group,)  # type: ignore[assignment]  # a ProcessGroup
        return cls(amax, groups)


def _where(slot: Slot) -> str:
    return f"slot {slot.name!r} {slot.role.name}"  # what a cast error names


class Caster:
    """Casts for one manager's state through its backend binding."""

    def __init__(self, state: State, binding: BackendBinding, *, delayed: bool) -> None:
        self._state = state
        self._binding = binding
        self._delayed = delayed
        #: collect_stats, fixed for the manager's life (read once: the cast path pays a flag test only).
        self._stats = state.stats
        #: The state rows of each group of slots cast together, on the device, by (device, rows).
        self._rows: dict[tuple[object, ...], Tensor] = {}
        #: Per weight row: (epoch, elements, counts) of its cached cast (collect_stats only).
        self._weight_counts: dict[int, tuple[int, int | Tensor, Tensor]] = {}

    def cast(
        self, slot: Slot, x: Tensor, transpose: bool, shard: ShardCast | None = None, ahead: bool = False
    ) -> Quantized:
        """A handle's cast: classify it, then cast through the backend (see ScalingHandle.quantize)."""
        if not isinstance(x, Tensor) or not x.is_floating_point():
            got = x.dtype if isinstance(x, Tensor) else type(x).__name__
            raise CastError(f"{_where(slot)}: expected a floating-point tensor; got {got}")
        if transpose and x.dim() != 2:
            raise CastError(f"{_where(slot)}: transpose=True needs a 2-d tensor; got shape {tuple(x.shape)}")
        if shard is not None and slot.spec.granularity is not None:
            raise CastError(
                f"{_where(slot)}: amax= (a shard cast with the whole tensor's amax) needs per-tensor scales; this "
                "recipe scales rows, tiles or blocks, which a shard would split. Cast the whole tensor, "
                "or use ss.DelayedScaling or ss.CurrentScaling"
            )
        if torch.compiler.is_compiling():
            settle_during_trace(self._binding, x.device)
            return self._cast(slot, x, transpose, shard, ahead, compiling=True)
        # Out of sight of selective checkpointing (see scalestate.sac): whether and how this
        # cast runs depends on the cache, the phase and debug mode, not only on the region.
        with hidden_from_sac():
            if not self._binding.ready or x.device != self._state.device:
                self._binding.settle(x.device)
            return self._cast(slot, x, transpose, shard, ahead, compiling=False)

    def cast_grouped(self, slots: Sequence[Slot], x: Tensor, sizes: Sequence[int], transpose: bool) -> list[Quantized]:
        """Casts of consecutive row groups of ``x`` (``sizes``, each ``>= 1``), group ``g`` for ``slots[g]``.

        One :class:`GroupedCastRequest` where the backend takes it and nothing
        sets the slots apart (per-tensor scales, a forward-or-backward role
        other than WEIGHT, eager, no debug mode or statistics); otherwise one
        :meth:`cast` per group. The same bits and records either way.
        """
        if slots[0].role is Role.WEIGHT or not self._groups_alike(slots, x):
            return self._cast_each(slots, x, sizes, transpose)
        with hidden_from_sac():  # as every eager cast (see cast)
            out = self._grouped(slots, x, sizes, transpose, self._kind(slots[0], False, False))
        return self._cast_each(slots, x, sizes, transpose) if out is None else out

    def cast_weights(
        self, slots: Sequence[Slot], weight: Tensor, experts: Sequence[int], views: Sequence[Tensor], transpose: bool
    ) -> list[Quantized]:
        """The weight casts of ``slots``, ``views[g]`` (``weight[experts[g]]``) for ``slots[g]``, each through the
        weight-cast cache as :meth:`cast` makes it; a training forward casts the weights not cached in one
        :class:`GroupedCastRequest` (one request of the whole ``weight`` when none is), with the same bits."""
        st = self._state
        if not self._groups_alike(slots, weight) or self._kind(slots[0], False, False) is not CastKind.RECORD:
            return [self.cast(slot, v, transpose) for slot, v in zip(slots, views, strict=True)]
        out: list[Quantized | None] = [None] * len(slots)
        misses = []
        for g, (slot, view) in enumerate(zip(slots, views, strict=True)):
            if st.casts.get(slot, view, st.epoch) is not None:
                out[g] = self.cast(slot, view, transpose)  # a hit: the cache's own accounting
            else:
                misses.append(g)
        if len(misses) > 1:
            for g in misses:
                if st.casts.modified_in_place(slots[g], views[g], st.epoch):
                    st.watch.weight_updated(slots[g].row)
            picked = [experts[g] for g in misses]
            whole = picked == list(range(weight.shape[0]))
            x = weight.detach() if whole else weight.detach().index_select(0, ints_on(picked, weight.device))
            rows = views[0].shape[0]
            with hidden_from_sac():
                cast = self._grouped(
                    [slots[g] for g in misses], x.reshape(-1, x.shape[-1]), [rows] * len(misses), transpose,
                    CastKind.RECORD,
                )
            if cast is not None:
                for g, q in zip(misses, cast, strict=True):
                    st.casts.put(slots[g], views[g], st.epoch, q, None)
                    out[g] = q
        return [
            q if q is not None else self.cast(slot, v, transpose) for q, slot, v in zip(out, slots, views, strict=True)
        ]

    def _groups_alike(self, slots: Sequence[Slot], x: Tensor) -> bool:
        """Whether grouped casts of ``slots`` can go as one request: eager, no debug mode or statistics,
        one per-tensor spec, a floating-point ``x``."""
        return not (
            len(slots) < 2 or torch.compiler.is_compiling() or self._state.checker is not None
            or not x.is_floating_point() or not self.one_per_tensor_spec(slots)
        )

    def one_per_tensor_spec(self, slots: Sequence[Slot]) -> bool:
        """Whether ``slots`` share one per-tensor spec and no statistics are kept: what a grouped request needs."""
        spec = slots[0].spec
        return not self._stats and spec.granularity is None and all(slot.spec == spec for slot in slots)

    def group_jit(self, slots: Sequence[Slot], *, compiling: bool) -> bool | Tensor:
        """A grouped request's ``jit``: one bool where every slot's is that bool, else a ``[G]`` bool tensor."""
        st = self._state
        jits = [st.jit(slot, delayed=self._delayed, compiling=compiling) for slot in slots]
        if all(j is True for j in jits) or all(j is False for j in jits):
            return jits[0]
        # a fill, not a copy from the host, for the slots decided on the host
        return torch.stack([
            torch.full((), j, dtype=torch.bool, device=st.device) if isinstance(j, bool) else j for j in jits
        ])

    def _grouped(
        self, slots: Sequence[Slot], x: Tensor, sizes: Sequence[int], transpose: bool, kind: CastKind
    ) -> list[Quantized] | None:
        """One grouped request of 2-d ``x``'s row groups (``None``: the backend takes none)."""
        st = self._state
        if not self._binding.ready or x.device != st.device:
            self._binding.settle(x.device)
        backend = self._binding.backend
        if x.dim() != 2 or not isinstance(backend, SupportsGroupedCast):
            return None
        key = (st.device, *(slot.row for slot in slots))
        rows = self._rows.get(key)
        if rows is None:  # one layer's slots: the same rows at every call (slots never move)
            rows = self._rows[key] = ints_on([slot.row for slot in slots], st.device)
        record = st.step_amax.index_select(0, rows) if kind is CastKind.RECORD else None
        request = GroupedCastRequest(x.detach(), slots[0].spec, tuple(sizes), st.scales.index_select(0, rows),
                                     self.group_jit(slots, compiling=False), record, transpose)
        out = list(backend.cast_grouped(request))
        if record is not None:
            st.step_amax.index_copy_(0, rows, record)
            for slot in slots:
                st.note_recorded(slot)
        return out

    def _cast_each(self, slots: Sequence[Slot], x: Tensor, sizes: Sequence[int], transpose: bool) -> list[Quantized]:
        """The grouped cast as one :meth:`cast` per group."""
        parts = x.split(list(sizes))  # type: ignore[no-untyped-call]  # torch leaves Tensor.split untyped
        return [self.cast(slot, part, transpose) for slot, part in zip(slots, parts, strict=True)]

    def _cast(
        self, slot: Slot, x: Tensor, transpose: bool, shard: ShardCast | None, ahead: bool, *, compiling: bool
    ) -> Quantized:
        st = self._state
        kind = self._kind(slot, ahead, compiling)
        if slot.role is Role.WEIGHT and not compiling:
            return self._cast_weight(slot, x, kind, transpose, shard)
        if st.checker is not None and not compiling and kind in (CastKind.RECORD, CastKind.RECOMPUTE):
            q, amax = self._cast_keeping_amax(slot, x, transpose, shard)
            self._record(slot, kind, amax)
            if kind is CastKind.RECORD and self._stats:
                st.add_counts(slot, *self._counts(slot, x, q, shard))
            return q
        # Eager casts reuse views made once; compiled code reads through the row's index tensor (RowViews).
        scale, acc = st.read_row(slot) if compiling else st.views_of(slot)
        record = acc if kind is CastKind.RECORD else None
        q = self._run(slot, x, transpose, scale, record, shard, compiling=compiling)
        if record is not None:
            if compiling:
                st.write_accumulator(slot, record)
            else:
                st.note_recorded(slot)
            if self._stats:
                st.add_counts(slot, *self._counts(slot, x, q, shard))
        return q

    def _run(
        self,
        slot: Slot, x: Tensor, transpose: bool, scale: Tensor, record: Tensor | None, shard: ShardCast | None,
        *, compiling: bool,
    ) -> Quantized:
        """The backend's cast of ``x`` with the slot's ``scale`` (or one just in time), recording into ``record``.

        A shard is cast with the scale of the whole tensor: the manager derives
        it from the whole tensor's amax (as the backend would from a whole
        tensor) and records that amax itself; a lazy amax not needed for the
        scale is not asked for, and the shard's own amax is recorded.
        """
        st = self._state
        lazy = shard is not None and not isinstance(shard.amax, Tensor)
        jit = st.jit(slot, delayed=self._delayed, compiling=compiling, host=lazy)
        x = x.detach() if x.requires_grad else x
        whole = None if shard is None else self._whole_amax(slot, shard, jit)
        if whole is None:
            spec = slot.spec
            if spec.hadamard or spec.stochastic:  # NVFP4's randomness, drawn from the manager's state
                signs = st.random.signs if spec.hadamard else None
                key = st.random.sr_key(slot.row) if spec.stochastic else None
                return self._binding.backend.cast(CastRequest(x, spec, scale, jit, record, transpose, signs, key))
            return self._binding.backend.cast(CastRequest(x, spec, scale, jit, record, transpose))
        if jit is not False:
            own = scale_from_amax(whole, slot.spec.fp8_max, slot.spec.rule, previous=scale)
            scale = own if jit is True else torch.where(jit, own, scale)
        q = self._binding.backend.cast(CastRequest(x, slot.spec, scale, False, None, transpose))
        if record is not None:
            torch.maximum(record, whole, out=record)
        return q

    def _whole_amax(self, slot: Slot, shard: ShardCast, jit: bool | Tensor) -> Tensor | None:
        """The whole tensor's amax as a 0-d float32 tensor on the state's device (``None``: a lazy one not needed)."""
        value = shard.amax
        if not isinstance(value, Tensor):
            if jit is False:
                return None
            value = value()
        where = _where(slot)
        if not isinstance(value, Tensor) or value.numel() != 1 or not value.is_floating_point():
            got = f"shape {tuple(value.shape)}, {value.dtype}" if isinstance(value, Tensor) else type(value).__name__
            raise CastError(
                f"{where}: amax must be one floating-point value (the whole tensor's amax, e.g. a 0-d float32 "
                f"tensor); got {got}"
            )
        if value.device != self._state.device:
            raise CastError(
                f"{where}: amax is on {value.device}, the manager's state on {self._state.device}; "
                "reduce the amax on the device the shard is cast on"
            )
        return value.detach().reshape(()).float()

    def _counts(self, slot: Slot, x: Tensor, q: Quantized, shard: ShardCast | None) -> tuple[int | Tensor, Tensor]:
        """What a recorded cast did to its elements; for a shard, summed over its groups (the whole tensor's)."""
        signs = self._state.random.signs if slot.spec.hadamard else None
        elements, counts = cast_counts(x, q, slot.spec.fp8_max, signs)
        if shard is None or not shard.groups:
            return elements, counts
        import torch.distributed as dist

        packed = torch.cat([counts.new_full((1,), elements), counts])
        for group in shard.groups:
            dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
        return packed[0], packed[1:]

    def _kind(self, slot: Slot, ahead: bool, compiling: bool) -> CastKind:
        """What the cast counts as: made ahead of its use, or classified (backward roles always record)."""
        if ahead:
            return CastKind.AHEAD
        return self._classify(slot, compiling) if slot.forward else CastKind.RECORD

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

    def _cast_keeping_amax(
        self, slot: Slot, x: Tensor, transpose: bool, shard: ShardCast | None
    ) -> tuple[Quantized, Tensor]:
        """An eager cast that records its amax into a fresh 0-d tensor (for the cache and debug mode)."""
        amax = torch.zeros((), dtype=torch.float32, device=self._state.device)
        return self._run(slot, x, transpose, self._state.views_of(slot)[0], amax, shard, compiling=False), amax

    def _cast_weight(
        self, slot: Slot, x: Tensor, kind: CastKind, transpose: bool, shard: ShardCast | None
    ) -> Quantized:
        """Weights are cast once per (tensor version, scale epoch); every training use records.

        A training cast writes its amax straight into the slot's accumulator in
        the backend's pass; later uses in the epoch have nothing to add. A cast
        made in recompute, evaluation or ahead of its use (or in debug mode,
        which compares every amax) keeps its amax aside for the training uses
        that hit it. A shard's cast hits only for the same whole-tensor amax.
        """
        st = self._state
        whole = None if shard is None else shard.amax
        entry = st.casts.get(slot, x, st.epoch, whole)
        usable = entry is not None and (not transpose or entry.quantized.transposed is not None)
        if entry is not None and usable and (entry.amax is not None or st.checker is None):
            if entry.amax is not None:
                self._record(slot, kind, entry.amax)
            elif kind is CastKind.RECORD:
                st.note_recorded(slot)
            if kind is CastKind.RECORD and self._stats:
                self._count_weight(slot, x, entry.quantized, shard)
            # What was asked for, whatever the cast held: a recompute that misses gets the same.
            return entry.quantized if transpose else entry.quantized.rowwise()
        if self._stats:
            self._weight_counts.pop(slot.row, None)  # a new cast: counts of the old one no longer apply
        if kind is CastKind.RECORD and st.casts.modified_in_place(slot, x, st.epoch):
            st.watch.weight_updated(slot.row)  # updated within a step: an optimizer step without step()?
        if kind is CastKind.RECORD and st.checker is None:
            scale, acc = st.views_of(slot)
            q = self._run(slot, x, transpose, scale, acc, shard, compiling=False)
            st.casts.put(slot, x, st.epoch, q, None, whole)
            st.note_recorded(slot)
        else:
            q, amax = self._cast_keeping_amax(slot, x, transpose, shard)
            st.casts.put(slot, x, st.epoch, q, amax, whole)
            self._record(slot, kind, amax)
        if kind is CastKind.RECORD and self._stats:
            self._count_weight(slot, x, q, shard)
        return q

    def _count_weight(self, slot: Slot, x: Tensor, q: Quantized, shard: ShardCast | None) -> None:
        """Add a training use of a (cached) weight cast to the slot's counters, counting it once per epoch."""
        st = self._state
        known = self._weight_counts.get(slot.row)
        if known is None or known[0] != st.epoch:
            known = self._weight_counts[slot.row] = (st.epoch, *self._counts(slot, x, q, shard))
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
