"""``emulation``: pure-torch FP8, the reference every other backend is tested against.

This module is the readable specification of the cast and the step update.
A cast reads ``x`` in float32, finds its amax, multiplies by the scale,
saturates to the FP8 range and rounds to nearest even (torch's own cast); a
recorded cast then maxes its amax into the slot's accumulator. Matrix
products dequantize both operands and multiply in float32. Runs on any device
torch supports, and under ``torch.compile`` (where the compiler fuses the
cast's operations into one kernel).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from scalestate.backends import emulation_grouped  # registers scalestate::grouped_mm
from scalestate.backends.base import (
    CastRequest,
    GroupedCastRequest,
    GroupedOperand,
    GroupedRows,
    StepUpdate,
)
from scalestate.backends.emulation_cpu import (
    CLAMP_CHECK_MIN_NUMEL,
    TABLE_MIN_NUMEL,
    CodeTables,
    Scratch,
    as_float32,
    dequantize_into,
    gather,
    host_abs_max,
    quiet,
    readable,
    reusable,
    saturate,
)
from scalestate.backends.emulation_kept import KeptCopies
from scalestate.errors import ArgumentTypeError, ArgumentValueError, CastError
from scalestate.finegrained import quantize as fine_quantize
from scalestate.granularity import GranularityKind
from scalestate.math import abs_max, ints_on, scale_from_amax, update_scales
from scalestate.nvfp4 import quantize_nvfp4, tensor_scale
from scalestate.quantized import FP8_DTYPES, Orientation, Quantized
from scalestate.recipe import Recipe
from scalestate.sac import hidden_from_sac
from scalestate.tiles import apply_tile_scales

__all__ = ["SAVED_COPY_BYTES", "EmulationBackend"]

#: The methods grouped casts and products stand in for (see EmulationBackend.grouped_products).
_OWN = ("cast", "dequantize", "scaled_mm")
#: The default of ``EmulationBackend(saved_copy_bytes=...)``: 64 MiB of float32 copies of saved inputs.
SAVED_COPY_BYTES = 64 << 20


class EmulationBackend:
    """Reference backend: pure torch, any device."""

    name = "emulation"
    #: Whether :meth:`grouped_scaled_mm` multiplies row-major copies of each group's operands (the bits of a
    #: product that makes them, as ``torch.nn.functional.scaled_mm`` on CPU), not the operands as laid out.
    _row_major_groups = False

    def __init__(self, *, saved_copy_bytes: int = SAVED_COPY_BYTES) -> None:
        """``saved_copy_bytes``: the most bytes the float32 copies :meth:`keep_saved` keeps (of inputs saved
        for a backward) may take at once; 0 keeps none, and each backward dequantizes its input again."""
        if type(saved_copy_bytes) is not int:
            raise ArgumentTypeError(f"saved_copy_bytes must be an int (bytes); got {type(saved_copy_bytes).__name__}")
        if saved_copy_bytes < 0:
            raise ArgumentValueError(f"saved_copy_bytes must be >= 0 (0 keeps no copies); got {saved_copy_bytes}")
        self.saved_copy_bytes = saved_copy_bytes
        self._tables = CodeTables()
        self._kept = KeptCopies()  # see keep_dequantized
        self._scratch = Scratch()

    def __repr__(self) -> str:
        own = "" if self.saved_copy_bytes == SAVED_COPY_BYTES else f"saved_copy_bytes={self.saved_copy_bytes}"
        return f"EmulationBackend({own})"

    def __getstate__(self) -> dict[str, object]:
        """Its state for pickle and copy, without the kept dequantizations (of this process's tensors)
        and the buffers it reuses (its threads')."""
        return {**self.__dict__, "_kept": None, "_scratch": None}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self._kept = KeptCopies()
        self._scratch = Scratch()

    def buffer_bytes(self) -> int:
        """The bytes of the buffers this thread's eager CPU casts and products reuse
        (:mod:`scalestate.backends.emulation_cpu`): up to three float32 buffers the size of the largest
        operand (four with inputs in another dtype), an index buffer and a scaled table."""
        return self._scratch.nbytes()

    def release_buffers(self) -> None:
        """Free the buffers every thread's eager CPU casts and products reuse. The next cast or product
        that uses one allocates it again; a copy :meth:`keep_dequantized` made with ``brief`` stays valid."""
        self._scratch = Scratch()

    def _products_key(self) -> str | None:
        """How compiled grouped layers' operators rebuild this backend (scalestate.nn.grouped_opaque):
        ``"emulation"``; ``None`` for a subclass, which may cast or multiply otherwise."""
        return "emulation" if type(self) is EmulationBackend else None

    def available(self, device: torch.device | None = None) -> tuple[bool, str]:
        """Always available: it needs nothing beyond torch's float8 dtypes."""
        return True, "pure torch: runs on any device"

    def supports(self, recipe: Recipe, device: torch.device | str | None = None) -> tuple[bool, str]:
        """Always: every recipe's casts and products are pure torch, on any device."""
        return True, "pure torch: runs every recipe on any device"

    def cast(self, request: CastRequest) -> Quantized:
        """The reference cast: amax, scale, saturating round, record, optional transpose."""
        x, spec = request.x, request.spec
        if spec.nvfp4:
            return self._cast_nvfp4(request)
        if spec.granularity is not None:
            return self._cast_fine(request)
        scratch = self._scratch if reusable(x, request.scale) else None
        xf = as_float32(x, scratch)
        host = (scratch is not None or readable(xf, request.scale)) and xf.numel() >= CLAMP_CHECK_MIN_NUMEL
        if host and request.jit is False:  # the slot's scale: the amax is only recorded and compared
            amax: Tensor | float = host_abs_max(xf)
            scale = request.scale.clone()
        else:
            amax = abs_max(xf)  # NaN propagates, as a max of |x| must
            scale = _chosen(request, lambda: scale_from_amax(amax, spec.fp8_max, spec.rule, previous=request.scale))
        data = saturate(xf, scale, spec.fp8_max, spec.dtype, scratch, amax if host else None)
        if request.record is not None:
            if isinstance(amax, float):  # a finite or infinite amax: the same max, one operation on 0-d
                request.record.clamp_(min=amax)
            else:
                torch.maximum(request.record, amax, out=request.record)
        return _per_tensor(data, scale, torch.reciprocal(scale), request.transpose)

    def cast_grouped(self, request: GroupedCastRequest) -> tuple[Quantized, ...]:
        """Every group's per-tensor cast at once (:meth:`cast_grouped_rows`), split into one
        :class:`~scalestate.Quantized` per group. The same bits as one :meth:`cast` per group
        (the products and roundings are per element; a max is exact in any order)."""
        rows = self.cast_grouped_rows(request._replace(transpose=False))
        parts = rows.data.split(list(request.sizes))  # type: ignore[no-untyped-call]  # torch leaves split untyped
        return tuple(
            _per_tensor(part, rows.scale[g], rows.scale_inv[g], request.transpose) for g, part in enumerate(parts)
        )

    def cast_grouped_rows(self, request: GroupedCastRequest) -> GroupedRows:
        """Every group's per-tensor cast in a fixed number of operations, whatever the sizes: row
        amaxes, one max per group, the groups' scales spread over their rows, one saturating round.
        ``request.sizes`` may be host ints or a device tensor (nothing is read on the host)."""
        x, spec, sizes = request.x, request.spec, request.sizes
        if spec.granularity is not None or x.dim() != 2 or request.transpose:
            raise CastError(
                f"grouped casts take per-tensor specs and 2-d tensors, one orientation; got granularity "
                f"{spec.granularity}, shape {tuple(x.shape)}, transpose={request.transpose} "
                "(cast each group with cast() instead)"
            )
        xf = x if x.dtype == torch.float32 else x.float()
        counts = sizes if isinstance(sizes, Tensor) else ints_on(sizes, x.device)
        n = counts.shape[0]
        group_of_row = torch.repeat_interleave(torch.arange(n, device=x.device), counts, output_size=x.shape[0])
        row_amax = xf.abs().amax(dim=1)
        amax = row_amax.new_zeros(n).scatter_reduce_(0, group_of_row, row_amax, "amax")
        # A scattered max need not keep NaN on every device (atomics): count each group's NaN rows.
        nan_rows = row_amax.new_zeros(n).index_add_(0, group_of_row, torch.isnan(row_amax).float())
        amax = torch.where(nan_rows > 0, float("nan"), amax)
        scale = _chosen(request, lambda: scale_from_amax(amax, spec.fp8_max, spec.rule, previous=request.scale))
        data = (xf * scale.index_select(0, group_of_row).unsqueeze(1)).clamp_(-spec.fp8_max, spec.fp8_max)
        if request.record is not None:
            torch.maximum(request.record, amax, out=request.record)
        return GroupedRows(data.to(spec.dtype), scale, torch.reciprocal(scale), group_of_row)

    def grouped_products(self, device: torch.device) -> bool:
        """True, on any device, where :meth:`cast`, :meth:`dequantize` and :meth:`scaled_mm` are this class's
        own: :meth:`cast_grouped_rows` and :meth:`grouped_scaled_mm` then cast and multiply each group as
        they would. A subclass that replaces one of them (and not this method) gets False: its compiled
        grouped layers take the host path, with its own casts and products."""
        cls = type(self)
        return all(getattr(cls, name) is getattr(EmulationBackend, name) for name in _OWN)

    def grouped_scaled_mm(
        self,
        a: GroupedOperand,
        b: GroupedOperand,
        offsets: Tensor,
        *,
        out_dtype: torch.dtype,
        bias: Tensor | None = None,
    ) -> Tensor:
        """Dequantize both operands, multiply each group in float32 and add its bias
        (``scalestate::grouped_mm``), cast."""
        if bias is not None and (b.data.dim() != 3 or tuple(bias.shape) != (b.data.shape[0], b.data.shape[2])):
            raise CastError(
                f"grouped_scaled_mm: a bias is one row per group of a 3-d b, ({b.data.shape[0]}, "
                f"{b.data.shape[-1]}); got shape {tuple(bias.shape)} with b of shape {tuple(b.data.shape)}"
            )
        dequantized = emulation_grouped.dequantized(a), emulation_grouped.dequantized(b)
        out: Tensor = torch.ops.scalestate.grouped_mm(*dequantized, offsets, self._row_major_groups, bias)
        return out if out_dtype == torch.float32 else out.to(out_dtype)

    def _cast_fine(self, request: CastRequest) -> Quantized:
        """A fine-grained cast: :func:`scalestate.finegrained.quantize`, then record its amax."""
        spec = request.spec
        assert spec.granularity is not None
        fq = fine_quantize(request.x, spec.dtype, spec.granularity, columnwise=request.transpose)
        if request.record is not None:
            torch.maximum(request.record, fq.amax, out=request.record)
        return fq.quantized

    def _cast_nvfp4(self, request: CastRequest) -> Quantized:
        """An NVFP4 cast: the per-tensor scale chosen as a per-tensor cast's is, then
        :func:`scalestate.nvfp4.quantize_nvfp4`, then record ``max|x|``."""
        spec = request.spec
        assert spec.granularity is not None
        xf = request.x if request.x.dtype == torch.float32 else request.x.float()
        amax = abs_max(xf)
        s_enc = _chosen(request, lambda: tensor_scale(amax, 1.0, spec.rule))
        fq = quantize_nvfp4(
            xf, s_enc=s_enc, amax=amax, two_d=spec.granularity.kind is GranularityKind.NVFP4_2D,
            columnwise=request.transpose, signs=request.signs if spec.hadamard else None,
            sr_key=request.sr_key if spec.stochastic else None,
        )
        if request.record is not None:
            torch.maximum(request.record, amax, out=request.record)
        return fq.quantized

    def wants_transposed(self, device: torch.device) -> bool:
        """False: products of dequantized operands take any layout."""
        return False

    def keep_dequantized(self, q: Quantized, *, brief: bool = False) -> None:
        """Dequantize ``q`` (per tensor) once for every product that multiplies it while its data lives.

        The layers call this for operands that several products take: a
        weight's cast (its cache serves every microbatch of a step; forward and
        backward each multiply it) and the output gradient's (both gradient
        products take it). :meth:`dequantize` and :meth:`scaled_mm` then use
        the kept values for that data and for its transpose, the same tensor
        they would compute. The kept copy is float32 (4 bytes per element) and
        lives as long as the FP8 data does. Not while compiling, where the
        compiler fuses the dequantization into its own kernels; not in
        subclasses that multiply otherwise. Made out of sight of selective
        checkpointing (see :mod:`scalestate.sac`), as whether it runs depends
        on what is kept.

        With ``brief``, the products that take ``q`` run before the next brief
        keep on this thread (an output gradient, within one layer's
        backward): its copy is written into a buffer this thread reuses, which
        the next brief keep takes over (the copy is then forgotten, and made
        afresh if asked for). Only :meth:`scaled_mm` on this thread uses it;
        :meth:`dequantize` computes afresh.
        """
        for side, o in self._unkept(q):
            with hidden_from_sac():
                if brief and self._fits_scratch(o.data, o.scale_inv):
                    name = f"brief{side}"
                    self._kept.take_buffer(self._scratch, name)
                    values = dequantize_into(self._tables, o.data, o.scale_inv, (self._scratch, name))
                    self._kept.keep_brief(o.data, o.scale_inv, values, self._scratch, name)
                else:
                    self._kept.keep(o.data, o.scale_inv, self._dequantize(Quantized.of(o)))

    def keep_saved(self, q: Quantized) -> None:
        """Keep the dequantization of ``q``, an input a layer saves for its backward, until that backward.

        :class:`scalestate.nn.Linear` calls this in a training forward whose
        weight gradient is needed: its forward product and its weight
        gradient's product then take one float32 copy (as
        :meth:`keep_dequantized` keeps it, until the FP8 data goes), instead
        of dequantizing the input in each. The copies so kept take at most
        ``saved_copy_bytes`` together (4 bytes per element, beyond the saved
        FP8 data's 1): keeping a new one drops the oldest first (a backward
        runs the layers in reverse, so the newest are used first), and an
        input larger than that is not kept. Same bits as dequantizing again.
        """
        for _, o in self._unkept(q):
            if o.data.numel() * 4 > self.saved_copy_bytes:
                continue
            with hidden_from_sac():
                if self._fits_scratch(o.data, o.scale_inv):  # a fresh copy, the indices in a reused buffer
                    fresh = torch.empty(o.data.numel(), dtype=torch.float32, device=o.data.device)
                    values = dequantize_into(self._tables, o.data, o.scale_inv, (self._scratch, "saved"), fresh)
                else:
                    values = self._dequantize(Quantized.of(o))
                self._kept.keep_saved(o.data, o.scale_inv, values, self.saved_copy_bytes)

    def kept_bytes(self) -> int:
        """The bytes of the float32 copies kept now (:meth:`keep_dequantized`, :meth:`keep_saved`), outside the
        reused buffers (:meth:`buffer_bytes`)."""
        return self._kept.nbytes()

    def _unkept(self, q: Quantized) -> list[tuple[int, Orientation]]:
        """``q``'s orientations (by side) a copy may be kept of and is not: per tensor, whole FP8 data; none
        while compiling (the compiler fuses dequantization into its kernels) or in a subclass that multiplies
        otherwise."""
        if type(self).scaled_mm is not EmulationBackend.scaled_mm or torch.compiler.is_compiling():
            return []
        return [
            (side, o) for side, o in enumerate((q.primary, q.other))
            if o is not None and o.tile is None and o.packing is None and o.data._base is None
            and not self._kept.holds(o.data, o.scale_inv)
        ]

    def _fits_scratch(self, data: Tensor, scale_inv: Tensor) -> bool:
        """Whether ``data`` (per tensor, FP8) is dequantized into a reused buffer: large, and unseen."""
        return data.dtype in FP8_DTYPES and scale_inv.dim() == 0 and reusable(data, scale_inv)

    def _kept_values(self, q: Quantized, brief: bool) -> Tensor | None:
        """The kept dequantization of ``q`` (with ``brief``, also this thread's brief copies), or None;
        nothing is kept while compiling."""
        return None if torch.compiler.is_compiling() else self._kept.get(q, brief)

    def dequantize(self, q: Quantized) -> Tensor:
        """``q.data * q.scale_inv`` in float32, each factor over its tile.

        On CPU, torch's E4M3 to float32 cast is several times slower than a
        lookup in a table built with that very cast; large E4M3 operands are
        converted through it (:func:`scalestate.backends.emulation_cpu.gather`).
        Per-tensor scales scale the table first, which gives the same bits as
        scaling every element; per-tile scales are applied to the gathered
        values. Data :meth:`keep_dequantized` kept (or its transpose) is not
        dequantized again.
        """
        kept = self._kept_values(q, brief=False)
        return kept if kept is not None else self._dequantize(q)

    def _dequantize(self, q: Quantized) -> Tensor:
        """What :meth:`dequantize` computes, with nothing kept."""
        data = q.data
        if (
            data.numel() < TABLE_MIN_NUMEL
            or data.dtype != torch.float8_e4m3fn
            or data.device.type != "cpu"
            or torch.compiler.is_compiling()
        ):
            # Out of place: selective checkpointing may keep the converted data (see scalestate.sac).
            return q.dequantize() if q.tile is not None else data.to(torch.float32) * q.scale_inv
        if q.tile is not None:
            return apply_tile_scales(gather(self._tables, data, None), q.scale_inv, q.tile)
        return gather(self._tables, data, q.scale_inv)

    def _operand(self, q: Quantized, name: str) -> Tensor:
        """``q`` dequantized for one product: kept values, or (where unseen) values written into this
        thread's buffer ``name``, or :meth:`dequantize`'s."""
        if type(self).dequantize is not EmulationBackend.dequantize:
            return self.dequantize(q)  # a subclass's own
        kept = self._kept_values(q, brief=True)
        if kept is not None:
            return kept
        if q.tile is None and self._fits_scratch(q.data, q.scale_inv):
            return dequantize_into(self._tables, q.data, q.scale_inv, (self._scratch, name))
        return self._dequantize(q)

    def scaled_mm(
        self,
        a: Quantized,
        b: Quantized,
        *,
        out_dtype: torch.dtype,
        bias: Tensor | None = None,
    ) -> Tensor:
        """Dequantize both operands, multiply in float32, add ``bias``, cast.

        Operands are dequantized into buffers this thread reuses where no
        one else can see them (:func:`scalestate.backends.emulation_cpu.reusable`),
        and the bias is added to the product in place wherever no mode can
        keep the product (:func:`scalestate.backends.emulation_cpu.quiet`):
        the same bits.
        """
        out = torch.mm(self._operand(a, "a"), self._operand(b, "b"))
        if bias is not None:
            if quiet(out):  # nothing else holds the product (no mode keeps it): the same sum, in place
                out += bias.float()
            else:
                out = out + bias.float()
        return out if out_dtype == torch.float32 else out.to(out_dtype)

    def update(self, update: StepUpdate) -> None:
        """:func:`scalestate.math.update_scales` in place, then clear the accumulators."""
        update_scales(
            update.history, update.scales, update.step_amax, update.fp8_max, update.rule, in_place=True,
            nonfinite_counts=update.nonfinite_counts, forget_nonfinite=update.forget_nonfinite,
        )
        update.step_amax.zero_()


def _per_tensor(data: Tensor, scale: Tensor, scale_inv: Tensor, transpose: bool) -> Quantized:
    """A per-tensor cast's result: ``data`` with its scales, and with ``transpose`` the contiguous
    ``data.t()`` sharing them."""
    rows = Orientation(data, scale, scale_inv)
    other = Orientation(data.t().contiguous(), scale, scale_inv) if transpose else None
    return Quantized.of(rows, other)


def _chosen(request: CastRequest | GroupedCastRequest, own: Callable[[], Tensor]) -> Tensor:
    """The per-tensor scale of a cast (of each group's, for a grouped one): a copy of the slot's (``jit``
    False; the Quantized owns its scale, the slot's may change), the tensor's ``own()`` (True), or either
    per a device flag."""
    if request.jit is False:
        return request.scale.clone()
    scale = own()
    return scale if request.jit is True else torch.where(request.jit, scale, request.scale)
