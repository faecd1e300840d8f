"""Reading saved scaling state: find a manager's state in a checkpoint, tabulate it, plot it.

What ``scalestate inspect`` and ``scalestate plot`` run. A checkpoint file
may hold a manager's state dict itself (``torch.save(manager.state_dict(),
f)``) or any nesting of dicts and lists with one inside
(``{"model": ..., "fp8": manager.state_dict()}``): a manager state is
recognized by its keys (see :mod:`scalestate.persist`), and addressed by a
dotted path of keys (list items by their index), e.g. ``"fp8"`` or
``"trainer.scaling"``.
"""

from __future__ import annotations

import math
import re
import zipfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from scalestate.diagnostics import RiskFlag, ScalingStats, SlotStats
from scalestate.errors import MissingDependencyError, ScaleStateError, StateDictError
from scalestate.persist import is_state_dict, read_format_version, recipe_from_dict
from scalestate.recipe import Role

__all__ = [
    "expert_groups",
    "find_states",
    "load_checkpoint",
    "plot_stats",
    "select_state",
    "stats_from_state_dict",
    "stats_table",
]

#: What each flag means, in one line (the table's legend).
FLAG_HELP = {
    RiskFlag.LOW_HEADROOM: (
        "the amax outgrew the range of its recent steps' scales by over 1 bit beyond rounding: "
        "those casts clipped its largest values (delayed scaling)"
    ),
    RiskFlag.SATURATED: "the last step's casts clipped values at the format's max, by over 1 bit beyond rounding",
    RiskFlag.NONFINITE: "some steps saw a NaN or infinite amax",
    RiskFlag.NO_AMAX: "no amax recorded in any training step: the scale never moved from 1",
    RiskFlag.CONSTANT: "the same amax over the whole history: the scale has not moved (normal for a frozen weight)",
    RiskFlag.NO_STEP: "casts were recorded but manager.step() never ran: the scales are still 1",
}


def stats_from_state_dict(state_dict: Mapping[str, Any]) -> ScalingStats:
    """The :class:`~scalestate.ScalingStats` of a saved manager state (no manager needed).

    The state is validated exactly as ``load_state_dict`` validates it, by
    loading it into a fresh CPU manager of the saved recipe with the saved
    slots. Cast statistics are not saved, so the fractions are ``None``.

    Raises:
        StateDictError: the dict is not a valid manager state.

    Example:
        >>> import torch, scalestate as ss
        >>> m = ss.ScalingStateManager(ss.DelayedScaling(history_len=2), backend="emulation")
        >>> h = m.register("fc", roles=(ss.Role.INPUT,))
        >>> with m.forward():
        ...     _ = h.quantize(torch.tensor([1.0, -4.0]), ss.Role.INPUT)
        >>> m.step()
        >>> ss.stats_from_state_dict(m.state_dict())["fc"][ss.Role.INPUT].amax
        4.0
    """
    from scalestate.manager import ScalingStateManager  # the manager builds on this module's types

    if not is_state_dict(state_dict):
        raise StateDictError(
            "expected a state dict made by ScalingStateManager.state_dict() (keys format_version, recipe, "
            f"iteration, slots, amax_history, scale, step_amax, ...); got {_describe(state_dict)}"
        )
    read_format_version(state_dict)  # first: the recipe of an unreadable version may not parse
    recipe = recipe_from_dict(state_dict["recipe"])
    slots = state_dict["slots"]
    roles: dict[str, list[Role]] = {}
    try:
        for name, role in slots:
            roles.setdefault(name, []).append(Role(role))
    except (TypeError, ValueError):
        raise StateDictError(f"slots must be a list of [name, role] pairs of Role values; got {slots!r}") from None
    manager = ScalingStateManager(recipe, backend="emulation", device="cpu", group=None)
    try:
        for name, named_roles in roles.items():
            manager.register(name, named_roles)
    except ScaleStateError as exc:
        raise StateDictError(f"the saved slots cannot be registered: {exc}") from None
    manager.load_state_dict(state_dict)
    return manager.stats()


def load_checkpoint(path: str | Path, *, weights_only: bool = True) -> Any:
    """``torch.load(path, map_location="cpu", weights_only=weights_only)``, with errors a user can act on.

    Raises:
        StateDictError: no such file, a directory, or not a file ``torch.load`` reads.
    """
    p = Path(path)
    if not p.exists():
        raise StateDictError(f"{path}: no such file")
    if p.is_dir():
        raise StateDictError(
            f"{path} is a directory; pass a file saved with torch.save (a torch.distributed.checkpoint "
            "directory is not read: load it into a manager and torch.save(manager.state_dict(), ...))"
        )
    if p.stat().st_size == 0:
        raise StateDictError(f"{path} is empty (0 bytes): a write that stopped at once leaves such a file")
    with p.open("rb") as f:
        magic = f.read(4)
    if magic != b"PK\x03\x04" and magic[:1] != b"\x80":  # torch.save writes a zip; before 1.6, a pickle
        raise StateDictError(f"{path}: not a file saved by torch.save (it is neither a zip archive nor a pickle)")
    try:
        return torch.load(p, map_location="cpu", weights_only=weights_only)
    except Exception as exc:  # torch.load raises many kinds: pickle, zip, unpickler errors
        text = str(exc)
        blocked = re.search(r"Unsupported global: GLOBAL ([\w.]+)", text)
        if weights_only and blocked:
            raise StateDictError(
                f"{path} holds objects other than tensors and plain containers (first: {blocked.group(1)}), "
                "which torch.load(weights_only=True) refuses; if you trust the file, pass --unsafe-load"
            ) from None
        sentence = _first_sentence(text)
        reason = f"{type(exc).__name__}: {sentence}" if sentence else type(exc).__name__
        damage = _damage(p, zipped=magic == b"PK\x03\x04", reason=reason)
        raise StateDictError(
            f"{path} {damage}; load an earlier copy (scalestate.atomic.atomic_save writes checkpoint files "
            "that a crash in the middle of the write cannot tear)"
        ) from None


def _damage(path: Path, *, zipped: bool, reason: str) -> str:
    """What is wrong with a file that ``torch.load`` could not read, as far as its structure shows."""
    size = f"{path.stat().st_size:,} bytes"
    if zipped and not zipfile.is_zipfile(path):
        return (
            f"is truncated ({size}): it begins as the zip archive torch.save writes, but the archive's "
            "closing directory is missing, as when a write stops before the end"
        )
    if zipped:
        try:
            with zipfile.ZipFile(path) as archive:
                bad = archive.testzip()
        except (zipfile.BadZipFile, OSError, EOFError, ValueError):  # what a damaged archive raises
            bad = None
        if bad is not None:
            return f"is corrupt ({size}): the record {bad!r} of its zip archive fails its checksum"
    # A pickle (torch before 1.6) has no structure to check; a sound zip may still hold damaged records.
    return f"is truncated or corrupt ({size}): torch.load cannot read it ({reason})"


def _first_sentence(text: str, limit: int = 160) -> str:
    """The first sentence of the last non-empty line of ``text``, cut at a word if longer than ``limit``."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return ""
    sentence = re.split(r"(?<=\.)\s", lines[-1], maxsplit=1)[0].rstrip(".")
    if len(sentence) <= limit:
        return sentence
    return sentence[:limit].rsplit(" ", 1)[0] + " ..."


def find_states(obj: Any, path: str = "") -> Iterator[tuple[str, Mapping[str, Any]]]:
    """Every manager state dict in ``obj`` (dicts and lists at any depth), as ``(dotted path, dict)``.

    The path of ``obj`` itself is ``""``; a state inside a manager state is not looked for.
    """
    if is_state_dict(obj):
        yield path, obj
        return
    if isinstance(obj, Mapping):
        items: Iterator[tuple[object, Any]] = iter(obj.items())
    elif isinstance(obj, (list, tuple)):
        items = iter(enumerate(obj))
    else:
        return
    for key, value in items:
        yield from find_states(value, f"{path}.{key}" if path else str(key))


def select_state(obj: Any, key: str | None = None) -> tuple[str, Mapping[str, Any]]:
    """The one manager state in ``obj``, or the one at the dotted path ``key``: ``(path, state dict)``.

    A path step matches a dict key (keys that contain dots are matched whole)
    or a list index.

    Raises:
        StateDictError: ``key`` leads nowhere or not to a manager state; none found; or more
            than one found and no ``key`` given (the message lists their paths).
    """
    if key is not None:
        target = _follow(obj, key)
        if not is_state_dict(target):
            raise StateDictError(f"--key {key!r} holds {_describe(target)}, not a scalestate manager state")
        return key, target
    found = list(find_states(obj))
    if not found:
        raise StateDictError(
            f"no scalestate manager state found in {_describe(obj)} (looked for a dict with the keys "
            "format_version, recipe and slots at any depth)"
        )
    if len(found) > 1:
        paths = ", ".join(repr(p or "<top level>") for p, _ in found)
        raise StateDictError(f"found {len(found)} scalestate manager states, at {paths}; choose one with --key PATH")
    return found[0]


def _follow(obj: Any, key: str) -> Any:
    """The value at dotted path ``key`` in ``obj``, matching the longest dict key at each step."""
    node, rest, walked = obj, key, ""
    while rest:
        parts = rest.split(".")
        for n in range(len(parts), 0, -1):
            head = ".".join(parts[:n])
            if isinstance(node, Mapping) and head in node:
                node = node[head]
                break
            if isinstance(node, (list, tuple)) and n == 1 and head.isdigit() and int(head) < len(node):
                node = node[int(head)]
                break
        else:
            where = f" under {walked!r}" if walked else ""
            keys = list(node)[:10] if isinstance(node, Mapping) else None
            has = f"; keys there: {keys}" if keys is not None else f"; found {_describe(node)} there"
            raise StateDictError(f"--key {key!r}: no {parts[0]!r}{where}{has}")
        walked = f"{walked}.{head}" if walked else head
        rest = ".".join(parts[n:])
    return node


def _describe(obj: Any) -> str:
    if isinstance(obj, Mapping):
        keys = list(obj)[:10]
        return f"a dict with keys {keys}{' ...' if len(obj) > 10 else ''}"
    if isinstance(obj, torch.Tensor):
        return f"a tensor of shape {tuple(obj.shape)}"
    return f"a {type(obj).__name__}"


def _fmt(value: float) -> str:
    if math.isinf(value):
        return "inf"
    return f"{value:.4g}"


def expert_groups(slots: Sequence[SlotStats]) -> list[SlotStats | list[SlotStats]]:
    """``slots`` in order, with the experts of one grouped layer and role (names ``"<prefix>.<e>"`` for
    two or more integers ``e``, as :class:`scalestate.nn.GroupedLinear` names them) gathered into one
    list, ordered by ``e``, at the place of its first member."""
    members: dict[tuple[str, object], list[SlotStats]] = {}
    for s in slots:
        prefix, _, last = s.name.rpartition(".")
        if prefix and last.isdigit():
            members.setdefault((prefix, s.role), []).append(s)
    out: list[SlotStats | list[SlotStats]] = []
    placed: set[tuple[str, object]] = set()
    for s in slots:
        prefix, _, last = s.name.rpartition(".")
        key = (prefix, s.role)
        group = members.get(key) if prefix and last.isdigit() else None
        if group is None or len(group) < 2:
            out.append(s)
        elif key not in placed:
            placed.add(key)
            out.append(sorted(group, key=lambda m: int(m.name.rpartition(".")[2])))
    return out


def _spread(values: Sequence[float]) -> str:
    low, high = min(values), max(values)
    return _fmt(low) if low == high else f"{_fmt(low)} .. {_fmt(high)}"


def _headroom(value: float) -> str:
    return "inf" if math.isinf(value) else f"{0.0 if abs(value) < 0.005 else value:.2f}"


def stats_table(stats: ScalingStats, title: str | None = None, *, per_expert: bool = False) -> Any:
    """A ``rich.table.Table`` of every slot, with its flags (see :data:`FLAG_HELP`).

    The experts of a grouped layer (see :func:`expert_groups`) share one line
    per role, with the spread (smallest .. largest) of their scales and amaxes,
    the smallest headroom, and the experts that never received a token (no
    amax in their history) named in the flag (``no-amax[1,3]``);
    ``per_expert=True`` gives each its own line.
    """
    from rich.table import Table
    from rich.text import Text

    table = Table(title=title, title_justify="left", show_lines=False)
    table.add_column("slot", overflow="fold")
    table.add_column("role")
    for name in ("scale", "newest amax", "max amax", "headroom (bits)", "uncovered (bits)", "non-finite steps"):
        table.add_column(name, justify="right")
    table.add_column("flags")
    rows = [[s] for s in stats.slots()] if per_expert else [
        entry if isinstance(entry, list) else [entry] for entry in expert_groups(stats.slots())
    ]
    for group in rows:
        s = group[0]
        flags = [f.value for f in RiskFlag if any(f in m.flags for m in group)]
        style = "bold red" if flags else None
        if len(group) == 1:
            table.add_row(
                Text(s.name), s.role.value, _fmt(s.scale), _fmt(s.amax), _fmt(s.amax_max), _headroom(s.headroom_bits),
                f"{s.uncovered_bits:.2f}", str(s.nonfinite_steps), Text(", ".join(flags)), style=style,
            )
            continue
        prefix = s.name.rpartition(".")[0]
        ids = [m.name.rpartition(".")[2] for m in group]
        idle = [i for i, m in zip(ids, group, strict=True) if RiskFlag.NO_AMAX in m.flags]
        if idle:  # name the experts that never recorded (no tokens): the others have amaxes
            label = RiskFlag.NO_AMAX.value
            flags[flags.index(label)] = f"{label}[{','.join(idle)}]"
        table.add_row(
            Text(f"{prefix}.{{{ids[0]}..{ids[-1]}}} ({len(group)} slots)"), s.role.value,
            _spread([m.scale for m in group]), _spread([m.amax for m in group]),
            _fmt(max(m.amax_max for m in group)), _headroom(min(m.headroom_bits for m in group)),
            f"{max(m.uncovered_bits for m in group):.2f}", str(sum(m.nonfinite_steps for m in group)),
            Text(", ".join(flags)), style=style,
        )
    return table


def plot_stats(
    stats: ScalingStats, out: str | Path, *, max_slots: int = 12, dpi: int = 100, title: str | None = None
) -> tuple[int, int, int]:
    """Draw each slot's amax history and scale to a PNG; returns ``(names drawn, names in all, roles)``.

    One row of panels per slot name (flagged names first, then in order), one
    column per role. Each panel shows the amax history (log scale, the last
    ``len(history)`` steps) and, dashed, ``fp8_max / scale``: the amax above
    which the current scale saturates. The figure is ``12 x (1 + 2 * rows)``
    inches at ``dpi``, so ``1200 x 100 * (1 + 2 * rows)`` pixels by default.

    Raises:
        MissingDependencyError: matplotlib is missing (``pip install "scalestate[plot]"``).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MissingDependencyError(
            'drawing needs matplotlib, which is not installed: pip install "scalestate[plot]"'
        ) from None
    names = list(stats)
    flagged = [n for n in names if any(s.flags for s in stats[n].values())]
    chosen = (flagged + [n for n in names if n not in flagged])[:max_slots]
    chosen.sort(key=names.index)
    roles = [r for r in Role if any(r in stats[n] for n in chosen)] or list(Role)
    rows = max(len(chosen), 1)
    fig, axes = plt.subplots(rows, len(roles), figsize=(12, 1 + 2 * rows), dpi=dpi, squeeze=False)
    for i, name in enumerate(chosen):
        for j, role in enumerate(roles):
            ax = axes[i][j]
            s = stats[name].get(role)
            if s is None:
                ax.set_axis_off()
                continue
            _panel(ax, s, stats.iteration)
    if not chosen:
        axes[0][0].text(0.5, 0.5, "no slots", ha="center", va="center")
    note = f"; showing {len(chosen)} of {len(names)} names (flagged first)" if len(chosen) < len(names) else ""
    head = title or "scalestate"
    fig.suptitle(f"{head}: amax history and saturation threshold, step {stats.iteration}{note}", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.4 / (1 + 2 * rows)))
    fig.savefig(out, dpi=dpi)
    plt.close(fig)
    return len(chosen), len(names), len(roles)


def _panel(ax: Any, s: SlotStats, iteration: int) -> None:
    from matplotlib.ticker import MaxNLocator

    hist = s.amax_history
    steps = list(range(iteration - len(hist) + 1, iteration + 1))
    points = [(t, a) for t, a in zip(steps, hist, strict=True) if a > 0]
    if points:
        ax.plot([t for t, _ in points], [a for _, a in points], marker="o", markersize=3, label="amax")
        ax.set_yscale("log")
    ax.axhline(s.fp8_max / s.scale, linestyle="--", color="tab:red", linewidth=1,
               label=f"fp8_max / scale (scale {s.scale:.4g})")
    flags = f" [{', '.join(f.value for f in s.flags)}]" if s.flags else ""
    ax.set_title(f"{s.name} {s.role.value}{flags}", fontsize=8, color="tab:red" if s.flags else "black")
    ax.tick_params(labelsize=7)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step", fontsize=7)
    ax.legend(fontsize=6, loc="lower left")
