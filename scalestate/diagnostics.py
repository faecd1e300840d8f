"""Diagnostics of the scaling state: per-slot statistics, risk flags, and the counts behind them.

:meth:`ScalingStateManager.stats() <scalestate.ScalingStateManager.stats>`
returns a :class:`ScalingStats`: one :class:`SlotStats` per slot (name and
role), and :meth:`ScalingStats.flat` for any logger. The definitions:

``amax``
    The newest entry of the slot's amax history: the amax of the last step
    whose amax was ``> 0`` and finite (a step that did not run the slot, or
    saw a non-finite amax, adds no entry). 0 if there is none yet.
``amax_max``
    The largest entry of the history (what ``amax_compute="max"`` scales from).
``headroom_bits``
    ``log2(fp8_max / (amax * scale))`` with the slot's current ``scale``: how
    many doublings of the newest amax the current scale takes before it
    saturates. ``+inf`` when ``amax`` is 0 (nothing recorded yet). Under
    delayed scaling it is at least the recipe's ``margin``; under the
    just-in-time recipes every cast scales from its own tensor (or tile), so
    the value only shows the rounding of the scale (0 to 1 bit) and is no risk.
``uncovered_bits``
    Delayed scaling: how far the amax outgrew what its history covered.
    For each history entry, the step that recorded it was cast with a scale
    made from the entries before it, which represents values up to
    ``fp8_max / scale``; the entry exceeded that by ``o = log2(entry * scale
    / fp8_max)`` bits (its largest values were clipped by that much), beyond
    the format's own rounding by ``o - r`` (``r``: 0.093 bits for E4M3,
    0.193 for E5M2, a clip no larger than rounding to the format loses).
    ``uncovered_bits`` sums ``o - r`` over the newest entries, back to the
    first one with ``o <= r``: one large jump, or a growth kept up over
    several steps. 0 when the newest entry fit. Entries older than the
    history are not known; for ``amax_compute="max"`` the visible ones stand
    for the window a step scaled from, so the value is an upper bound.
``step_amax``
    The amax recorded since the last step (what the next ``step()`` adds to
    the history); 0 between steps.
``nonfinite_steps``
    Steps whose amax was NaN or infinite (see
    :meth:`~scalestate.ScalingStateManager.nonfinite_counts`).
``saturated_fraction``, ``underflow_fraction``, ``cast_elements``
    Only with ``ScalingStateManager(..., collect_stats=True)``; see
    :data:`COUNT_FIELDS` for what is counted (over a step's recorded casts; a
    recompute or evaluation cast never counts).

A :class:`RiskFlag` marks a slot that needs a look; the diagnostics guide
(``docs/diagnostics.md``) says what to do about each.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterator, Mapping, Sequence

import attrs
import torch
from torch import Tensor

from scalestate.math import scale_from_amax
from scalestate.recipe import Recipe, Role, fp8_max

__all__ = ["COUNT_FIELDS", "RiskFlag", "ScalingStats", "SlotStats", "build_stats"]

#: Above this many bits of :attr:`SlotStats.uncovered_bits` a delayed-scaling slot is flagged
#: :attr:`RiskFlag.LOW_HEADROOM`; above this many bits of clipping beyond rounding in the last step
#: (counted), :attr:`RiskFlag.SATURATED`. One bit: the amax more than doubled past its scale's range.
LOW_HEADROOM_BITS = 1.0

#: Bits by which an amax may exceed its scale's range and lose no more than the format's own rounding
#: does: a clip to ``1 - eps/2`` of the value (E4M3: 6.25%, 0.093 bits; E5M2: 12.5%, 0.193 bits).
_ROUNDING_BITS = {
    fp8_max(dtype): -math.log2(1 - torch.finfo(dtype).eps / 2) for dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
}
#: NVFP4 (its slots' maximum is 448 * 6, what the per-tensor scale maps amaxes onto): E2M1's top step, 6 to 4,
#: a clip to 3/4 of the value above 5 (0.415 bits).
_ROUNDING_BITS[448.0 * 6.0] = -math.log2(0.75)

#: The columns of the per-slot counters, in order (int64, summed over a step's recorded casts).
COUNT_FIELDS = ("elements", "saturated", "nonzero_inputs", "nonzero_codes")


class RiskFlag(enum.Enum):
    """Why a slot may need attention (see the diagnostics guide for what to do)."""

    #: Delayed scaling: ``uncovered_bits > 1``: the amax outgrew the range of the scales its
    #: recent steps were cast with by more than a doubling (beyond the format's own rounding),
    #: so those casts clipped its largest values.
    LOW_HEADROOM = "low-headroom"
    #: Delayed scaling, statistics on: the last step's casts clipped values at the format's max
    #: (``saturated_fraction > 0``), by more than a doubling beyond the format's own rounding.
    SATURATED = "saturated"
    #: Some step saw a NaN or infinite amax (``nonfinite_steps > 0``).
    NONFINITE = "non-finite"
    #: After at least one step, the history holds no amax: the slot never recorded a usable one
    #: (it did not run in a training phase, cast only zeros, or saw only non-finite amaxes);
    #: its scale has never moved from 1.
    NO_AMAX = "no-amax"
    #: Delayed scaling, history of 2 or more: every entry is filled and equal, so the scale has
    #: not moved over the whole window (expected of a frozen weight).
    CONSTANT = "constant"
    #: Casts were recorded (``step_amax > 0``) but ``step()`` never ran (iteration 0), or a live
    #: manager saw a sign of a forgotten ``step()`` (the diagnostics guide, "A forgotten step").
    NO_STEP = "no-step"


@attrs.frozen
class SlotStats:
    """The statistics of one slot (one name and role); see :mod:`scalestate.diagnostics`."""

    #: The registered name (e.g. ``"blocks.0.fc1"``).
    name: str
    #: The role of its casts.
    role: Role
    #: Current scale (the multiplier of the next step's casts under delayed scaling).
    scale: float
    #: Newest amax in the history (0: none yet).
    amax: float
    #: Largest amax in the history.
    amax_max: float
    #: ``log2(fp8_max / (amax * scale))``; ``+inf`` when ``amax`` is 0.
    headroom_bits: float
    #: Steps with a NaN or infinite amax.
    nonfinite_steps: int
    #: The format's largest value for this role (448 for E4M3, 57344 for E5M2).
    fp8_max: float
    #: The amax history, oldest first (0 marks an entry not filled yet).
    amax_history: tuple[float, ...]
    #: Elements cast by the last completed step's recorded casts; ``None`` when statistics are off.
    cast_elements: int | None = None
    #: Fraction of those elements clipped at ``fp8_max``; ``None`` when statistics are off or
    #: the slot recorded no cast in the last completed step.
    saturated_fraction: float | None = None
    #: Fraction of their non-zero elements that the cast flushed to zero (0.0 if none was
    #: non-zero); ``None`` as for ``saturated_fraction``.
    underflow_fraction: float | None = None
    #: What may need a look, in :class:`RiskFlag` order.
    flags: tuple[RiskFlag, ...] = ()
    #: The amax recorded since the last step, not yet in the history (0: none; NaN or
    #: ``+inf`` where a cast saw one).
    step_amax: float = 0.0
    #: How far the amax outgrew its history, in bits: over the trailing run of steps whose amax
    #: exceeded the largest value the scale of its step represents by more than the format's
    #: rounding, the sum of those excesses (0: the newest step fit; always 0 for just-in-time recipes).
    uncovered_bits: float = 0.0

    def flat(self, prefix: str = "scalestate") -> dict[str, float]:
        """``{"<prefix>/<name>/<role>/<stat>": value}``; the fractions only where they are known."""
        base = f"{prefix}/{self.name}/{self.role.value}/"
        out = {
            base + "scale": self.scale,
            base + "amax": self.amax,
            base + "amax_max": self.amax_max,
            base + "headroom_bits": self.headroom_bits,
            base + "nonfinite_steps": float(self.nonfinite_steps),
            base + "uncovered_bits": self.uncovered_bits,
        }
        if self.saturated_fraction is not None:
            out[base + "saturated_fraction"] = self.saturated_fraction
        if self.underflow_fraction is not None:
            out[base + "underflow_fraction"] = self.underflow_fraction
        return out


class ScalingStats(Mapping[str, Mapping[Role, SlotStats]]):
    """Statistics of every slot: ``stats[name][role]`` is a :class:`SlotStats`.

    A read-only snapshot, in the slots' registration order (state dict order
    when made from one). Iterating yields names, like ``nonfinite_counts()``.

    Example:
        >>> import torch, scalestate as ss
        >>> manager = ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation", collect_stats=True)
        >>> layer = ss.nn.Linear(8, 8, manager=manager)
        >>> with manager.forward():
        ...     loss = layer(torch.full((2, 8), 2.0)).sum()
        >>> with manager.backward():
        ...     loss.backward()
        >>> manager.step()
        >>> s = manager.stats()
        >>> s[layer.handle.name][ss.Role.INPUT].amax, s[layer.handle.name][ss.Role.INPUT].saturated_fraction
        (2.0, 0.0)
        >>> sorted(s.flat())[0]
        'scalestate/linear/grad_output/amax'
    """

    def __init__(self, slots: Sequence[SlotStats], *, iteration: int, recipe: Recipe, collect_stats: bool) -> None:
        table: dict[str, dict[Role, SlotStats]] = {}
        for s in slots:
            table.setdefault(s.name, {})[s.role] = s
        self._table = table
        self._slots = tuple(slots)
        self._iteration = iteration
        self._recipe = recipe
        self._collect = collect_stats

    @property
    def iteration(self) -> int:
        """The manager's :attr:`~scalestate.ScalingStateManager.iteration` when the snapshot was taken."""
        return self._iteration

    @property
    def recipe(self) -> Recipe:
        """The recipe of the slots."""
        return self._recipe

    @property
    def collect_stats(self) -> bool:
        """Whether cast statistics (the fractions) were collected."""
        return self._collect

    def __getitem__(self, name: str) -> Mapping[Role, SlotStats]:
        return self._table[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._table)

    def __len__(self) -> int:
        return len(self._table)

    def slots(self) -> tuple[SlotStats, ...]:
        """Every slot's statistics, one per (name, role), in order."""
        return self._slots

    def at_risk(self) -> tuple[SlotStats, ...]:
        """The slots with at least one :class:`RiskFlag`."""
        return tuple(s for s in self._slots if s.flags)

    def flat(self, prefix: str = "scalestate") -> dict[str, float]:
        """Every statistic as ``{"<prefix>/<name>/<role>/<stat>": float}``, for any logger.

        ``<role>`` is the :class:`~scalestate.Role` value (``input``, ``weight``,
        ``grad_output``); ``<stat>`` is one of ``scale``, ``amax``,
        ``amax_max``, ``headroom_bits``, ``nonfinite_steps``,
        ``uncovered_bits``, and, where known, ``saturated_fraction`` and
        ``underflow_fraction``. Pass it to
        ``SummaryWriter.add_scalar`` key by key, or to ``wandb.log`` whole.
        """
        out: dict[str, float] = {}
        for s in self._slots:
            out.update(s.flat(prefix))
        return out

    def __repr__(self) -> str:
        risky = len(self.at_risk())
        return f"<ScalingStats(step={self._iteration}, slots={len(self._slots)}, at_risk={risky})>"


def build_stats(
    recipe: Recipe,
    iteration: int,
    slots: Sequence[tuple[str, Role]],
    history: Tensor,
    scales: Tensor,
    fp8_max: Tensor,
    nonfinite: Tensor,
    counts: Tensor | None,
    step_amax: Tensor | None = None,
    *,
    step_overdue: bool = False,
) -> ScalingStats:
    """A :class:`ScalingStats` from a state's rows (reads them back to the host: a device sync).

    Args:
        recipe: the slots' recipe (decides which flags apply).
        iteration: steps taken.
        slots: ``(name, role)`` per row.
        history: ``[N, H]`` float32 amax histories.
        scales: ``[N]`` float32 scales.
        fp8_max: ``[N]`` float32 format maxima.
        nonfinite: ``[N]`` int64 non-finite step counts.
        counts: ``[N, 4]`` int64 counters of the last completed step (:data:`COUNT_FIELDS`),
            or ``None`` when statistics are off.
        step_amax: ``[N]`` float32 amaxes recorded since the last step (``None``: zeros).
        step_overdue: the manager saw the signs of a forgotten ``step()``
            (the diagnostics guide, "A forgotten step"): slots with a pending amax are flagged
            :attr:`RiskFlag.NO_STEP` whatever the iteration.
    """
    n = len(slots)
    # No -1 in the shapes: a manager with no slots has zero rows, and -1 cannot be inferred from 0 elements.
    history = history.reshape(n, history.shape[-1])
    pending = step_amax.reshape(n, 1) if step_amax is not None else scales.new_zeros(n, 1)
    excess = _excess_bits(history, fp8_max.reshape(n), recipe)  # [n, H - 1] float64, NaN: not known
    uncovered = _trailing_sum(excess)
    newest = excess[:, -1:] if excess.shape[1] else excess.new_full((n, 1), math.nan)
    columns = [history, scales.reshape(n, 1), fp8_max.reshape(n, 1), pending]
    floats = torch.cat(columns, dim=1).tolist()
    growth = torch.cat([uncovered.reshape(n, 1), newest], dim=1).tolist()
    steps = nonfinite.tolist()
    tallies = counts.tolist() if counts is not None else None
    out = []
    for i, (name, role) in enumerate(slots):
        *hist, scale, fmax, amax_pending = floats[i]
        stat = _slot_stats(name, role, tuple(hist), scale, fmax, int(steps[i]), None if tallies is None else tallies[i])
        stat = attrs.evolve(stat, step_amax=amax_pending, uncovered_bits=growth[i][0])
        out.append(attrs.evolve(stat, flags=_flags(stat, recipe, iteration, step_overdue, growth[i][1])))
    return ScalingStats(out, iteration=iteration, recipe=recipe, collect_stats=counts is not None)


def _excess_bits(history: Tensor, fmax: Tensor, recipe: Recipe) -> Tensor:
    """``[N, H - 1]`` float64: per history entry after the first, the bits by which it exceeded the range
    of its step's scale beyond the format's rounding (``o - r`` of :mod:`scalestate.diagnostics`).

    The scale of the step that recorded entry ``j`` is remade from the entries before it, as the
    step made it (:func:`scalestate.math.scale_from_amax`, the recipe's margin and rounding). NaN
    where it is not known: just-in-time recipes, an empty entry, or a step scaled just in time.
    """
    n, h = history.shape
    if not recipe.delayed or h < 2:
        return torch.full((n, max(h - 1, 0)), math.nan, dtype=torch.float64, device=history.device)
    rule = recipe.rule
    before = torch.cummax(history, dim=1).values[:, :-1] if rule.amax_compute == "max" else history[:, :-1]
    scale = scale_from_amax(before, fmax.reshape(n, 1), rule, previous=math.nan)
    entry = history[:, 1:].double()
    over = torch.log2(entry * scale.double() / fmax.double().reshape(n, 1))
    rounding = torch.tensor([_ROUNDING_BITS.get(float(m), 0.0) for m in fmax.tolist()], dtype=torch.float64)
    known = (entry > 0) & (before > 0)
    return torch.where(known, over - rounding.to(over.device).reshape(n, 1), math.nan)


def _trailing_sum(excess: Tensor) -> Tensor:
    """``[N]``: the sum of the positive ``excess`` entries at the end of each row, back to the first
    entry that is not positive (NaN is not)."""
    positive = excess > 0
    run = torch.flip(torch.cumprod(torch.flip(positive, dims=[1]).to(torch.int64), dim=1), dims=[1]).bool()
    return torch.where(run, excess, 0.0).sum(dim=1)


def _slot_stats(
    name: str, role: Role, hist: tuple[float, ...], scale: float, fmax: float, steps: int, tally: list[int] | None
) -> SlotStats:
    amax = hist[-1] if hist else 0.0
    amax_max = max(hist, default=0.0)
    headroom = math.log2(fmax / (amax * scale)) if amax > 0 else math.inf
    elements = saturated = underflow = None
    if tally is not None:
        elements, n_saturated, nonzero_inputs, nonzero_codes = (int(v) for v in tally)
        if elements:
            saturated = n_saturated / elements
            underflow = (nonzero_inputs - nonzero_codes) / nonzero_inputs if nonzero_inputs else 0.0
    return SlotStats(
        name=name, role=role, scale=scale, amax=amax, amax_max=amax_max, headroom_bits=headroom,
        nonfinite_steps=steps, fp8_max=fmax, amax_history=hist, cast_elements=elements,
        saturated_fraction=saturated, underflow_fraction=underflow,
    )


def _flags(
    s: SlotStats, recipe: Recipe, iteration: int, step_overdue: bool, newest_excess: float
) -> tuple[RiskFlag, ...]:
    delayed = recipe.delayed
    pending = s.step_amax != 0.0  # > 0, +inf or NaN (NaN != 0): casts were recorded since the last step
    found = {
        RiskFlag.LOW_HEADROOM: delayed and s.uncovered_bits > LOW_HEADROOM_BITS,
        RiskFlag.SATURATED: delayed and bool(s.saturated_fraction) and newest_excess > LOW_HEADROOM_BITS,
        RiskFlag.NONFINITE: s.nonfinite_steps > 0,
        RiskFlag.NO_AMAX: iteration > 0 and s.amax_max <= 0,
        RiskFlag.CONSTANT: delayed and len(s.amax_history) >= 2 and s.amax_history[0] > 0
        and all(h == s.amax_history[0] for h in s.amax_history),
        RiskFlag.NO_STEP: pending and (iteration == 0 or step_overdue),
    }
    return tuple(flag for flag in RiskFlag if found[flag])
