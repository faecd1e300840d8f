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

from scalestate.backends.base import (
    HOST_READ_OP,
    CastRequest,
    GroupedCastRequest,
    GroupedOperand,
    GroupedRows,
    StepUpdate,
    group_spans,
    rows_then_zeros,
)
from scalestate.backends.emulation_cpu import (
    TABLE_MIN_NUMEL,
    CodeTables,
    Scratch,
    as_float32,
    dequantize_into,
    gather,
    quiet,
    readable,
    reusable,
    saturate,
)
from scalestate.backends.emulation_kept import KeptCopies
from scalestate.errors import CastError
from scalestate.finegrained import quantize as fine_quantize
from scalestate.granularity import GranularityKind
from scalestate.math import abs_max, ints_on, scale_from_amax, update_scales
from scalestate.nvfp4 import quantize_nvfp4, tensor_scale
from scalestate.quantized import FP8_DTYPES, Orientation, Quantized
from scalestate.recipe import Recipe
from scalestate.sac import hidden_from_sac
from scalestate.tiles import apply_tile_scales

__all__ = ["EmulationBackend"]

#: The methods grouped casts and products stand in for (see EmulationBackend.grouped_products).
_OWN = ("cast", "dequantize", "scaled_mm")


class EmulationBackend:
    """Reference backend: pure torch, any device."""

    name = "emulation"
    #: Whether :meth:`grouped_scaled_mm` multiplies row-major copies of each group's operands (the bits of a
    #: product that makes them, as ``torch.nn.functional.scaled_mm`` on CPU), not the operands as laid out.
    _row_major_groups = False

    def __init__(self) -> None:
        self._tables = CodeTables()
        self._kept = KeptCopies()  # see keep_dequantized
        self._scratch = Scratch()

    def __repr__(self) -> str:
        return "EmulationBackend()"

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
        amax = abs_max(xf)  # NaN propagates, as a max of |x| must
        scale = _chosen(request, lambda: scale_from_amax(amax, spec.fp8_max, spec.rule, previous=request.scale))
        known = amax if scratch is not None or readable(xf, scale) else None  # the clamp may be left out
        data = saturate(xf, scale, spec.fp8_max, spec.dtype, scratch, known)
        if request.record is not None:
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
        dequantized = _dequantized(a), _dequantized(b)
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
        if type(self).scaled_mm is not EmulationBackend.scaled_mm or torch.compiler.is_compiling():
            return
        for side, o in enumerate((q.primary, q.other)):
            if o is None or o.tile is not None or o.packing is not None or o.data._base is not None:
                continue
            if self._kept.holds(o.data, o.scale_inv):
                continue
            with hidden_from_sac():
                if brief and self._fits_scratch(o.data, o.scale_inv):
                    name = f"brief{side}"
                    self._kept.take_buffer(self._scratch, name)
                    values = dequantize_into(self._tables, o.data, o.scale_inv, (self._scratch, name))
                    self._kept.keep_brief(o.data, o.scale_inv, values, self._scratch, name)
                else:
                    self._kept.keep(o.data, o.scale_inv, self._dequantize(Quantized.of(o)))

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


def _dequantized(operand: GroupedOperand) -> Tensor:
    """``data * scale_inv`` in float32, in the data's memory order (a transposed operand stays a transposed
    view, as :meth:`EmulationBackend.dequantize` keeps it, so that each group's product sees its layout)."""
    data, scale_inv = operand
    if data.dim() >= 2 and not data.is_contiguous() and data.mT.is_contiguous():
        return (data.mT.to(torch.float32) * scale_inv.mT).mT
    return data.to(torch.float32) * scale_inv


def _chosen(request: CastRequest | GroupedCastRequest, own: Callable[[], Tensor]) -> Tensor:
    """The per-tensor scale of a cast (of each group's, for a grouped one): a copy of the slot's (``jit``
    False; the Quantized owns its scale, the slot's may change), the tensor's ``own()`` (True), or either
    per a device flag."""
    if request.jit is False:
        return request.scale.clone()
    scale = own()
    return scale if request.jit is True else torch.where(request.jit, scale, request.scale)


@torch.library.custom_op("scalestate::grouped_mm", mutates_args=(), **HOST_READ_OP)
def grouped_mm(a: Tensor, b: Tensor, offsets: Tensor, row_major: bool = False, bias: Tensor | None = None) -> Tensor:
    """Each group's ``torch.mm``, grouped as ``torch.nn.functional.grouped_mm`` groups (see
    :meth:`SupportsDeviceGroups.grouped_scaled_mm <scalestate.backends.SupportsDeviceGroups.grouped_scaled_mm>`),
    on any dtype and device, with the bits of ``torch.mm`` on each group's slices (with ``row_major``, on
    row-major copies of them, as ``torch.nn.functional.scaled_mm`` multiplies on CPU). An operator of its
    own, so that compiled code keeps the sizes on the device (torch's own refuses float32 while tracing);
    its ``ends`` are read on the host when it runs. ``bias`` (3-d ``b`` only): ``bias[g]`` is added
    to group ``g``'s product in float32, as :meth:`EmulationBackend.scaled_mm` adds a bias."""
    def mm(x: Tensor, y: Tensor) -> Tensor:
        return torch.mm(x.contiguous(), y.contiguous()) if row_major else torch.mm(x, y)

    if b.dim() == 3:  # rows of a by group, each times b[g]
        groups = group_spans(offsets, skip_empty=True)
        parts = [mm(a[s:e], b[g]) for g, s, e in groups]
        if bias is not None:
            parts = [part + bias[g].float() for part, (g, _, _) in zip(parts, groups, strict=True)]
        return rows_then_zeros(parts, a.shape[0], b.shape[-1], a, a.dtype)
    return torch.stack([mm(a[:, s:e], b[s:e]) for _, s, e in group_spans(offsets)])


@grouped_mm.register_fake
def _(a: Tensor, b: Tensor, offsets: Tensor, row_major: bool = False, bias: Tensor | None = None) -> Tensor:
    if b.dim() == 3:
        return a.new_empty((a.shape[0], b.shape[-1]))
    return a.new_empty((offsets.shape[0], a.shape[0], b.shape[1]))
