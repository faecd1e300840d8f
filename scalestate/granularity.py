"""Granularity: how finely a fine-grained cast scales, and how that is said in words.

A :class:`Granularity` is what a recipe says for one role's casts
(``recipe.granularity(role)``; ``None`` means one scale per tensor). Its
:class:`GranularityKind` is the closed set of fine-grained casts that
:mod:`scalestate.finegrained` makes and that backends dispatch on; the words
every message uses for a granularity are written here once
(:func:`granularity_label`).

Example:
    >>> from scalestate.granularity import Granularity, GranularityKind, granularity_label
    >>> g = Granularity(GranularityKind.TILE, 128, True)
    >>> g.kind is GranularityKind.TILE, granularity_label(g), granularity_label(None)
    (True, '1 x 128 tiles', 'a per-tensor scale')
"""

from __future__ import annotations

import enum
from typing import NamedTuple

__all__ = ["MX_BLOCK", "NVFP4_KINDS", "Granularity", "GranularityKind", "granularity_label"]

#: Elements per scale in MXFP8 (the OCP Microscaling spec's block size).
MX_BLOCK = 32


class GranularityKind(str, enum.Enum):
    """The fine-grained casts: one scale per row, per tile, per block, per MX block, or NVFP4's two levels.

    A ``str`` enum: each member equals its value (``GranularityKind.TILE ==
    "tile"``), so code written against the strings of earlier versions keeps
    comparing equal; the library itself compares members.
    """

    #: One scale per row of the last dimension (:func:`scalestate.finegrained.quantize_rowwise`).
    ROW = "row"
    #: One scale per ``1 x block`` tile of a row (:func:`scalestate.finegrained.quantize_tiles`).
    TILE = "tile"
    #: One scale per ``block x block`` block of the last two dimensions
    #: (:func:`scalestate.finegrained.quantize_blocks`).
    BLOCK = "block"
    #: MXFP8: one E8M0 power of two per ``block`` elements of a row (:func:`scalestate.finegrained.quantize_mx`).
    MX = "mx"
    #: NVFP4: one E4M3 scale per ``1 x 16`` block of a row and a float32 one per tensor
    #: (:func:`scalestate.nvfp4.quantize_nvfp4`).
    NVFP4 = "nvfp4"
    #: NVFP4 with ``16 x 16`` blocks over the last two dimensions (weights: ``w`` and ``w.t()``
    #: quantize to the same values).
    NVFP4_2D = "nvfp4_2d"

    def __str__(self) -> str:
        return self.value


class Granularity(NamedTuple):
    """Which fine-grained cast a slot makes: what a recipe says for one role.

    ``kind`` is a :class:`GranularityKind` (its string value, ``"tile"``, is
    accepted and compares equal).
    """

    #: Which cast: row, tile, block or MX.
    kind: GranularityKind
    #: Elements per scale along a row (``ROW``: unused, 0).
    block: int = 0
    #: Round scales down to powers of two (``MX``: always powers of two).
    power_of_2: bool = False


#: The words for each kind, ``{block}`` filled in: the one place they are written.
_LABELS: dict[GranularityKind, str] = {
    GranularityKind.ROW: "row-wise scales",
    GranularityKind.TILE: "1 x {block} tiles",
    GranularityKind.BLOCK: "{block} x {block} blocks",
    GranularityKind.MX: "E8M0-scaled MX blocks of {block}",
    GranularityKind.NVFP4: "NVFP4 blocks of 1 x {block}",
    GranularityKind.NVFP4_2D: "NVFP4 blocks of {block} x {block}",
}
#: The NVFP4 kinds (E2M1 data with two levels of scales).
NVFP4_KINDS = frozenset({GranularityKind.NVFP4, GranularityKind.NVFP4_2D})
_PER_TENSOR = "a per-tensor scale"


def granularity_label(granularity: Granularity | None) -> str:
    """A granularity in words, for messages: ``"1 x 128 tiles"``, ``"128 x 128 blocks"``, ...

    ``None`` (one scale per tensor) is ``"a per-tensor scale"``.

    Example:
        >>> from scalestate.granularity import Granularity, GranularityKind
        >>> granularity_label(Granularity(GranularityKind.BLOCK, 64))
        '64 x 64 blocks'
    """
    if granularity is None:
        return _PER_TENSOR
    return _LABELS[GranularityKind(granularity.kind)].format(block=granularity.block)
