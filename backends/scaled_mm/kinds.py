"""Torch's scaling types, in the library's own granularity vocabulary.

``torch.nn.functional.scaled_mm`` names how each operand is scaled along the
contraction dimension (``TensorWise``, ``RowWise``, ``BlockWise1x128``,
``BlockWise128x128``, ``BlockWise1x32``). Here each is the
:class:`~scalestate.granularity.GranularityKind` it takes (``None``: one scale
per tensor), with the one block size its kernel takes, and is said in words
by :func:`scalestate.granularity.granularity_label`.
"""

from __future__ import annotations

import torch

from scalestate.granularity import Granularity, GranularityKind, granularity_label
from scalestate.quantized import Quantized

__all__ = [
    "BLOCK",
    "KERNEL_BLOCK",
    "MX",
    "PAIRS",
    "ROW",
    "TILE",
    "Kind",
    "Pair",
    "kind_label",
    "operand_kinds",
    "operand_label",
    "recipe_kinds",
]

ROW, TILE, BLOCK, MX = GranularityKind.ROW, GranularityKind.TILE, GranularityKind.BLOCK, GranularityKind.MX

#: How one operand is scaled along the contraction dimension: a granularity kind, or ``None`` (per tensor).
Kind = GranularityKind | None
#: ``(kind of a, kind of b)``.
Pair = tuple[Kind, Kind]
#: The pairs torch's kernels take, in order of preference.
PAIRS: tuple[Pair, ...] = ((None, None), (ROW, ROW), (TILE, TILE), (TILE, BLOCK), (BLOCK, TILE), (MX, MX))
#: Elements per scale along the contraction dimension that torch's kernel of each kind takes.
KERNEL_BLOCK: dict[GranularityKind, int] = {TILE: 128, BLOCK: 128, MX: 32}


def kind_label(kind: Kind) -> str:
    """The scaling a kernel of ``kind`` takes, in words (``"1 x 128 tiles"``)."""
    return granularity_label(None if kind is None else Granularity(kind, KERNEL_BLOCK.get(kind, 0)))


def recipe_kinds(granularity: Granularity | None) -> tuple[Kind, ...]:
    """The kind of torch kernel that takes casts of ``granularity`` (empty: none does)."""
    if granularity is None:
        return (None,)
    kind = GranularityKind(granularity.kind)
    if kind is ROW or granularity.block == KERNEL_BLOCK[kind]:
        return (kind,)
    return ()


def operand_kinds(q: Quantized, k: int, *, first: bool) -> tuple[Kind, ...]:
    """The kinds ``q`` fits as the first (``(M, K)``) or second (``(K, N)``) operand.

    A ``1 x c`` tile with ``c >= K`` is one scale per row: it fits the row-wise
    kernel as well as (when ``c == 128``) the ``1 x 128`` one.
    """
    if q.tile is None:
        return (None,)
    along_k, across = _along_k(q.tile, first)
    if q.scale_inv.dtype == torch.float8_e8m0fnu:
        return (MX,) if (across, along_k) == (1, KERNEL_BLOCK[MX]) else ()
    kinds: list[Kind] = []
    if across == 1 and along_k >= k:
        kinds.append(ROW)
    if (across, along_k) == (1, KERNEL_BLOCK[TILE]):
        kinds.append(TILE)
    if across == along_k == KERNEL_BLOCK[BLOCK]:
        kinds.append(BLOCK)
    return tuple(kinds)


def operand_label(q: Quantized, k: int, *, first: bool) -> str:
    """``q``'s scaling in words, as seen along the contraction dimension (``"1 x 64 tiles"``)."""
    if q.tile is None:
        return granularity_label(None)
    along_k, across = _along_k(q.tile, first)
    if q.scale_inv.dtype == torch.float8_e8m0fnu:
        return granularity_label(Granularity(MX, along_k))
    if across == 1:
        return granularity_label(Granularity(ROW) if along_k >= k else Granularity(TILE, along_k))
    if across == along_k:
        return granularity_label(Granularity(BLOCK, along_k))
    return f"{across} x {along_k} blocks"  # a tile no recipe makes


def _along_k(tile: tuple[int, int], first: bool) -> tuple[int, int]:
    """``(elements along K, rows or columns across it)`` of an operand's tile."""
    return (tile[1], tile[0]) if first else (tile[0], tile[1])
