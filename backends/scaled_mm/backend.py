"""`ScaledMMBackend`: the dispatch of ``scaled_mm``: which kernel takes each product, or why none does.

Casts and the step update are the emulation backend's; a product is matched
to the first pair of torch's scaling types (:mod:`.kinds`) that both operands
fit and the device runs (:mod:`.capability`), then computed by
:mod:`.products`. See :mod:`scalestate.backends.scaled_mm` for what runs where.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from scalestate.backends.base import GroupedOperand, granularity_label, recipe_granularities
from scalestate.backends.emulation import EmulationBackend
from scalestate.backends.scaled_mm.capability import Probe, default_device, device_label
from scalestate.backends.scaled_mm.kinds import PAIRS, ROW, Kind, Pair, operand_kinds, operand_label, recipe_kinds
from scalestate.backends.scaled_mm.products import blockwise, nvfp4, rowwise, tensorwise
from scalestate.errors import ArgumentTypeError, ArgumentValueError, BackendUnavailableError
from scalestate.granularity import Granularity
from scalestate.quantized import Quantized
from scalestate.recipe import NVFP4Scaling, Recipe, Role

__all__ = ["ScaledMMBackend"]

_TWO_E5M2 = "cuBLASLt cannot multiply two E5M2 operands (use Format.HYBRID or Format.E4M3)"
_ALTERNATIVES = 'ScaledMMBackend(fallback="emulation") to emulate those products, or backend="emulation"'
_NO_KERNEL = "its block-wise kernels take 1 x 128 tiles and 128 x 128 blocks, its MX kernel blocks of 32"
#: The operands of a linear layer's three products: forward, input gradient, weight gradient.
_PRODUCTS = ((Role.INPUT, Role.WEIGHT), (Role.GRAD_OUTPUT, Role.WEIGHT), (Role.GRAD_OUTPUT, Role.INPUT))


class ScaledMMBackend(EmulationBackend):
    """FP8 GEMMs with torch's scaled-matmul kernels; casts and updates as in emulation.

    Args:
        fallback: ``None`` (default): a product no kernel can run on its device
            raises :class:`~scalestate.errors.BackendUnavailableError`.
            ``"emulation"``: such a product is computed by
            :meth:`EmulationBackend.scaled_mm` instead, for that call only (the
            others still run in the kernels). The registry name ``"scaled_mm"``
            makes a backend without fallback.

    Example:
        >>> import scalestate as ss
        >>> from scalestate.backends.scaled_mm import ScaledMMBackend
        >>> ScaledMMBackend(fallback="emulation").supports(ss.MXFP8Scaling(), "cpu")[0]
        True
    """

    name = "scaled_mm"

    def __init__(self, fallback: Literal["emulation"] | None = None) -> None:
        super().__init__()
        if fallback is not None and not isinstance(fallback, str):
            raise ArgumentTypeError(f"fallback must be None or the string 'emulation'; got {type(fallback).__name__}")
        if fallback not in (None, "emulation"):
            raise ArgumentValueError(f"fallback must be None or 'emulation'; got {fallback!r}")
        self._fallback: Literal["emulation"] | None = fallback
        # Facts of the build and the devices, asked once, eagerly: torch.compile cannot trace the queries.
        self._probe = Probe()

    @property
    def fallback(self) -> Literal["emulation"] | None:
        """``"emulation"`` if products no kernel can run are emulated, else ``None``."""
        return self._fallback

    def __repr__(self) -> str:
        return f"ScaledMMBackend(fallback={self._fallback!r})"

    def available(self, device: torch.device | None = None) -> tuple[bool, str]:
        """Whether ``torch._scaled_mm`` runs on ``device`` (default: CUDA if present, else CPU)."""
        return self._probe.available(default_device(device))

    def supports(self, recipe: Recipe, device: torch.device | str | None = None) -> tuple[bool, str]:
        """Whether the products of ``recipe`` (those of a linear layer) run on ``device``, and why.

        Per-tensor recipes: where :meth:`available`. Fine-grained ones: where
        torch's kernels take their scales (see the package docs); with
        ``fallback="emulation"`` also elsewhere, the reason then saying that
        the products fall back to emulation. Decided from the device and the
        torch build, without running tensor operations.
        """
        device = default_device(device)
        ok, why = self.available(device)
        if not ok:
            return False, why
        roles = recipe_granularities(recipe)
        if all(g is None for g in roles.values()):
            return True, why
        name = _recipe_label(recipe, roles)
        if isinstance(recipe, NVFP4Scaling):
            where = device_label(device)
            runs, reason = self._probe.nvfp4_runs(device)
            if runs:
                return True, f"{name} runs in torch's kernels on {where}"
            if self._fallback == "emulation":
                return True, f"{name} on {where}: {reason}; those products fall back to emulation"
            return False, f"{name} cannot run in torch's kernels on {where}: {reason}. Use {_ALTERNATIVES}"
        failures: dict[str, None] = {}
        for first, second in _PRODUCTS:
            ka, kb = recipe_kinds(roles[first]), recipe_kinds(roles[second])
            if not ka or not kb:
                label = granularity_label(roles[first] if not ka else roles[second])
                failures[f"no torch kernel takes {label} ({_NO_KERNEL})"] = None
                continue
            if device.type == "cuda" and recipe.format.dtype(first) == recipe.format.dtype(second) == torch.float8_e5m2:
                failures[_TWO_E5M2] = None
            runs, reason = self._probe.pair_runs((ka[0], kb[0]), device)
            if not runs:
                failures[reason] = None
        where = device_label(device)
        if not failures:
            return True, f"{name} runs in torch's kernels on {where}"
        why = "; ".join(failures)
        if self._fallback == "emulation":
            return True, f"{name} on {where}: {why}; those products fall back to emulation"
        return False, f"{name} cannot run in torch's kernels on {where}: {why}. Use {_ALTERNATIVES}"

    def wants_transposed(self, device: torch.device) -> bool:
        """Whether FP8 operands go in as row-major times column-major: cuBLASLt's rule on CUDA, and
        the compiler's for ``torch._scaled_mm``. Not on a CPU where ``torch.nn.functional.scaled_mm``
        takes the products: it makes its dequantized operands contiguous itself, so any layout gives
        the same bits, and the casts make no transposed copies there. Fine-grained operands are laid
        out inside :meth:`scaled_mm`."""
        return device.type != "cpu" or not self._probe.cpu_functional

    #: On CPU its products multiply row-major copies of the dequantized operands (see grouped_products).
    _row_major_groups = True

    def _products_key(self) -> str | None:
        """How compiled grouped layers' operators rebuild this backend (scalestate.nn.grouped_opaque):
        ``"scaled_mm:"`` plus its fallback; ``None`` for a subclass."""
        return f"scaled_mm:{self._fallback or ''}" if type(self) is ScaledMMBackend else None

    def grouped_products(self, device: torch.device) -> bool:
        """On a CPU where ``torch.nn.functional.scaled_mm`` takes the products: true. That kernel multiplies
        row-major float32 copies of the dequantized operands, and :meth:`grouped_scaled_mm` multiplies each
        group's so, with its bits. Elsewhere false: the products are torch's scaled-matmul kernels, one per
        group (compiled grouped layers on this backend compile once per pattern of group sizes;
        ``scaled_grouped_mm`` is not used yet)."""
        return device.type == "cpu" and self._probe.cpu_functional

    def grouped_scaled_mm(
        self,
        a: GroupedOperand,
        b: GroupedOperand,
        offsets: Tensor,
        *,
        out_dtype: torch.dtype,
        bias: Tensor | None = None,
    ) -> Tensor:
        """Each group's product with the bits of :meth:`scaled_mm` of that group, where
        :meth:`grouped_products` says so (on a CPU with ``torch.nn.functional.scaled_mm``)."""
        device = a.data.device
        if not self.grouped_products(device):
            raise BackendUnavailableError(
                f"ScaledMMBackend multiplies grouped operands with the sizes on the device only on a CPU with "
                f"torch.nn.functional.scaled_mm (torch 2.13+), not on {device_label(device)}: give the group "
                "sizes as a list (one product per group), or use backend='emulation'"
            )
        return super().grouped_scaled_mm(a, b, offsets, out_dtype=out_dtype, bias=bias)

    def scaled_mm(
        self,
        a: Quantized,
        b: Quantized,
        *,
        out_dtype: torch.dtype,
        bias: Tensor | None = None,
    ) -> Tensor:
        """``a @ b`` in torch's kernels; see the package docs for what runs where.

        On CUDA an operand in the wrong layout is taken from its ``transposed``
        copy when the cast made one with the same (per-tensor) scale, else copied.
        """
        if a.primary.packing is not None or b.primary.packing is not None:
            runs, reason = self._probe.nvfp4_runs(a.data.device)
            if runs:
                return nvfp4(a, b, out_dtype, bias)
            if self._fallback == "emulation":
                return super().scaled_mm(a, b, out_dtype=out_dtype, bias=bias)
            raise BackendUnavailableError(
                f"ScaledMMBackend cannot multiply NVFP4 operands: {reason}. Use {_ALTERNATIVES}"
            )
        if a.tile is None and b.tile is None:
            if (
                a.data.is_cuda
                and a.dtype == torch.float8_e5m2
                and b.dtype == torch.float8_e5m2
                and self._fallback == "emulation"
            ):
                return super().scaled_mm(a, b, out_dtype=out_dtype, bias=bias)
            return tensorwise(a, b, out_dtype, bias, cpu_functional=self._probe.cpu_functional)
        m, k = a.data.shape
        n = b.data.shape[1]
        if m == 0 or n == 0 or k == 0:  # nothing to multiply: zeros (and the bias), exactly
            return super().scaled_mm(a, b, out_dtype=out_dtype, bias=bias)
        device = a.data.device
        pair, reason = self._choose(a, b, device)
        if pair is None:
            if self._fallback == "emulation":
                return super().scaled_mm(a, b, out_dtype=out_dtype, bias=bias)
            raise BackendUnavailableError(f"{reason}. Use {_ALTERNATIVES}")
        if pair == (ROW, ROW):
            return rowwise(a, b, out_dtype, bias, cpu_functional=self._probe.cpu_functional)
        return blockwise(pair, a, b, out_dtype, bias)

    def _choose(self, a: Quantized, b: Quantized, device: torch.device) -> tuple[Pair | None, str]:
        """The first pair of scaling types both operands fit and ``device`` runs, or ``None`` and why not."""
        k = a.data.shape[1]
        kinds_a: tuple[Kind, ...] = operand_kinds(a, k, first=True)
        kinds_b: tuple[Kind, ...] = operand_kinds(b, k, first=False)
        reasons: dict[str, None] = {}
        if device.type == "cuda" and a.dtype == torch.float8_e5m2 and b.dtype == torch.float8_e5m2:
            kinds_a = kinds_b = ()
            reasons[_TWO_E5M2] = None
        for pair in PAIRS:
            if pair[0] in kinds_a and pair[1] in kinds_b:
                runs, reason = self._probe.pair_runs(pair, device)
                if runs:
                    return pair, ""
                reasons[reason] = None
        what = f"{operand_label(a, k, first=True)} times {operand_label(b, k, first=False)}"
        if not reasons:
            reasons[f"no torch kernel takes that combination of scales ({_NO_KERNEL}, each with its own kind)"] = None
        return None, f"ScaledMMBackend cannot multiply {what} on {device_label(device)}: {'; '.join(reasons)}"


def _recipe_label(recipe: Recipe, roles: dict[Role, Granularity | None]) -> str:
    kinds = dict.fromkeys(granularity_label(g) for g in roles.values())
    return f"{type(recipe).__name__} ({', '.join(kinds)})"
