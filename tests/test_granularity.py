"""scalestate.granularity: one enum of fine-grained kinds, their labels written once."""

from __future__ import annotations

import pytest
import torch

import scalestate as ss
from scalestate.backends.scaled_mm import ScaledMMBackend
from scalestate.backends.scaled_mm.kinds import PAIRS, kind_label
from scalestate.errors import CastError
from scalestate.finegrained import quantize
from scalestate.granularity import NVFP4_KINDS, Granularity, GranularityKind, granularity_label

E4M3 = torch.float8_e4m3fn
I, W, G = ss.Role.INPUT, ss.Role.WEIGHT, ss.Role.GRAD_OUTPUT


class TestKind:
    def test_recipes_give_members(self):
        """Every fine-grained recipe names its kinds with GranularityKind members."""
        assert ss.RowwiseScaling().granularity(I).kind is GranularityKind.ROW
        assert [ss.BlockScaling().granularity(r).kind for r in (I, W, G)] == [
            GranularityKind.TILE, GranularityKind.BLOCK, GranularityKind.TILE,
        ]
        assert all(type(ss.BlockScaling().granularity(r).kind) is GranularityKind for r in (I, W, G))
        assert ss.MXFP8Scaling().granularity(G).kind is GranularityKind.MX

    def test_string_values_still_compare_equal(self):
        """Code written against the string kinds keeps working: equal, same hash, usable as a key."""
        assert GranularityKind.TILE == "tile" and {"tile": 1}[GranularityKind.TILE] == 1
        assert Granularity("tile", 128, True) == ss.BlockScaling().granularity(I)  # type: ignore[arg-type]
        assert str(GranularityKind.MX) == "mx" and f"{GranularityKind.ROW}" == "row"

    @pytest.mark.parametrize("kind", [k for k in GranularityKind if k not in NVFP4_KINDS])
    def test_string_kind_casts_bitwise_alike(self, kind):
        """quantize() takes a Granularity spelled with the string value, with the same bits."""
        x = torch.randn(40, 96) * 3
        block = 0 if kind is GranularityKind.ROW else 32
        by_member = quantize(x, E4M3, Granularity(kind, block, True), columnwise=True)
        by_string = quantize(x, E4M3, Granularity(kind.value, block, True), columnwise=True)  # type: ignore[arg-type]
        for a, b in zip(by_member.flatten()[0], by_string.flatten()[0], strict=True):
            assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                               b.view(torch.uint8) if b.element_size() == 1 else b)

    @pytest.mark.parametrize("kind", sorted(NVFP4_KINDS))
    def test_nvfp4_kinds_point_to_their_cast(self, kind):
        """finegrained.quantize makes FP8 casts only: an NVFP4 kind is refused, naming its cast."""
        with pytest.raises(CastError, match=r"scalestate\.nvfp4\.quantize_nvfp4"):
            quantize(torch.randn(2, 16), E4M3, Granularity(kind, 16))

    def test_unknown_kind(self):
        """A kind that is none of the members is a CastError listing them."""
        with pytest.raises(CastError, match=r"GranularityKind\.ROW, GranularityKind\.TILE"):
            quantize(torch.randn(2, 4), E4M3, Granularity("column", 4))  # type: ignore[arg-type]


class TestLabels:
    @pytest.mark.parametrize(
        ("granularity", "label"),
        [
            (None, "a per-tensor scale"),
            (Granularity(GranularityKind.ROW), "row-wise scales"),
            (Granularity(GranularityKind.TILE, 64), "1 x 64 tiles"),
            (Granularity(GranularityKind.BLOCK, 128), "128 x 128 blocks"),
            (Granularity(GranularityKind.MX, 32, True), "E8M0-scaled MX blocks of 32"),
        ],
    )
    def test_words(self, granularity, label):
        assert granularity_label(granularity) == label

    def test_every_kind_has_words(self):
        """No member is left without a label."""
        assert len({granularity_label(Granularity(kind, 16)) for kind in GranularityKind}) == len(GranularityKind)

    def test_scaled_mm_uses_the_same_words(self):
        """The kinds of torch's kernels are said as the recipes' granularities are: tiles and blocks of 128,
        MX blocks of 32, row-wise scales, a per-tensor scale."""
        recipe_words = {granularity_label(ss.BlockScaling().granularity(r)) for r in (I, W)} | {
            granularity_label(ss.MXFP8Scaling().granularity(I)),
            granularity_label(ss.RowwiseScaling().granularity(I)),
            granularity_label(None),
        }
        assert {kind_label(kind) for pair in PAIRS for kind in pair} == recipe_words
        recipe = ss.BlockScaling(block=64)
        ok, reason = ScaledMMBackend().supports(recipe, "cpu")
        assert not ok and reason.startswith(f"BlockScaling ({granularity_label(recipe.granularity(I))}, ")
