"""Operand layout for torch's scaled-matmul kernels: memory order, zero padding, scale layouts.

cuBLASLt takes a row-major first operand and a column-major second one, with
dimensions that are multiples of 16 (of 128 or 32 along block-scaled axes)
and block scales in the layouts torch's meta checks ask for. Everything here
only lays out what it is given: zero padding adds nothing to any product, and
ones pad the scales where the data is zero.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from scalestate.backends.scaled_mm.kinds import BLOCK, MX, TILE, Pair
from scalestate.errors import BackendUnavailableError
from scalestate.quantized import Quantized

__all__ = ["block_args", "nvfp4_args", "padded", "rowwise_args", "swizzle_32_4_4", "tensorwise_operands"]


def tensorwise_operands(qa: Quantized, qb: Quantized, *, pad: bool) -> tuple[Tensor, Tensor]:
    """Row-major ``a``, column-major ``b`` (from ``transposed`` copies where the casts made
    them). With ``pad``, also cuBLASLt's other FP8 rules: inner and output dimensions
    multiples of 16 (zero-padded), not both E5M2."""
    a, b = qa.data, qb.data
    if not b.t().is_contiguous() and qb.transposed is not None:
        b = qb.transposed.t()  # the column-major copy the cast made
    if not pad:
        return (a if a.is_contiguous() else a.contiguous()), (b if b.t().is_contiguous() else b.t().contiguous().t())
    if a.dtype == torch.float8_e5m2 and b.dtype == torch.float8_e5m2:
        raise BackendUnavailableError(
            "torch._scaled_mm on CUDA cannot multiply two E5M2 operands; "
            "use Format.HYBRID or Format.E4M3, ScaledMMBackend(fallback=\"emulation\"), or backend='emulation'"
        )
    return padded(a, b, k_to=16, n_to=16)


def rowwise_args(a: Quantized, b: Quantized, bias: Tensor | None) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments of ``torch.nn.functional.scaled_mm`` for a row-wise product on CUDA, bfloat16 out:
    ``a`` row-major and ``b`` column-major, ``K`` and ``N`` zero-padded to multiples of 16, ``a``'s
    scales ``(M, 1)`` and ``b``'s ``(1, N)`` (padded with ones), the bias fused (padded with zeros)."""
    m, n = a.data.shape[0], b.data.shape[1]
    sa = a.scale_inv.float().reshape(-1).view(m, 1)
    sb = b.scale_inv.float().reshape(-1).view(1, n)
    a_data, b_data = padded(a.data, b.data, k_to=16, n_to=16)
    pad_n = b_data.shape[1] - n
    if pad_n:
        sb = F.pad(sb, (0, pad_n), value=1.0)
        bias = None if bias is None else F.pad(bias, (0, pad_n))
    st = F.ScalingType.RowWise
    return (a_data, b_data, sa, st, sb, st), {"bias": bias, "output_dtype": torch.bfloat16}


def block_args(pair: Pair, a: Quantized, b: Quantized) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The positional and swizzle arguments of ``torch.nn.functional.scaled_mm`` for a block-wise or MX pair.

    Data: ``a`` row-major, ``b`` column-major, zero-padded (``K`` to the block
    along it, a dimension cut into 128-row blocks to 128, the others to 16).
    Scales: in the layouts of torch's checks (see the package docs), padded with
    ones where the data is padded.
    """
    st = F.ScalingType
    n = b.data.shape[1]
    if pair == (MX, MX):
        a_data, b_data = padded(a.data, b.data, k_to=32, n_to=16)
        sa = swizzle_32_4_4(a.scale_inv)
        sb = swizzle_32_4_4(b.scale_inv.t())
        swizzle = F.SwizzleType.SWIZZLE_32_4_4
        return (a_data, b_data, sa, st.BlockWise1x32, sb, st.BlockWise1x32), {
            "swizzle_a": swizzle, "swizzle_b": swizzle,
        }
    kind_a, kind_b = pair
    a_data, b_data = padded(
        a.data, b.data, k_to=128, n_to=128 if kind_b is BLOCK else 16, m_to=128 if kind_a is BLOCK else 1
    )
    k_blocks = b_data.shape[0] // 128
    l4 = -(-k_blocks // 4) * 4
    sa_in, sb_in = a.scale_inv.float(), b.scale_inv.float()
    # a's scales: 1 x 128 as (M, K/128), strides (1, M); 128 x 128 as (L4, M/128), strides (1, L4)
    sa = sa_in.t().contiguous().t() if kind_a is TILE else F.pad(sa_in, (0, l4 - k_blocks), value=1.0).contiguous().t()
    if kind_b is TILE:  # (N, K/128), strides (1, N); sb_in is (K/128, N)
        sb = F.pad(sb_in, (0, b_data.shape[1] - n), value=1.0).contiguous().t()
    else:  # 128 x 128: (L4, N/128), strides (1, L4); sb_in is (K/128, N/128)
        sb = F.pad(sb_in.t(), (0, l4 - k_blocks), value=1.0).contiguous().t()
    ta = st.BlockWise1x128 if kind_a is TILE else st.BlockWise128x128
    tb = st.BlockWise1x128 if kind_b is TILE else st.BlockWise128x128
    return (a_data, b_data, sa, ta, sb, tb), {}


def padded(a: Tensor, b: Tensor, *, k_to: int, n_to: int, m_to: int = 1) -> tuple[Tensor, Tensor]:
    """``a`` row-major and ``b`` column-major, zero-padded: ``K`` to a multiple of ``k_to``,
    ``N`` of ``n_to``, ``M`` of ``m_to`` (zeros add nothing to any product)."""
    m, k = a.shape
    n = b.shape[1]
    pad_m, pad_k, pad_n = -m % m_to, -k % k_to, -n % n_to
    if pad_m or pad_k:
        a = _pad(a, rows=pad_m, cols=pad_k)
    if pad_k or pad_n:
        b = _pad(b.t(), rows=pad_n, cols=pad_k).t()
    if not a.is_contiguous():
        a = a.contiguous()
    if not b.t().is_contiguous():
        b = b.t().contiguous().t()
    return a, b


def swizzle_32_4_4(scale: Tensor) -> Tensor:
    """One-byte block scales ``(rows, k_blocks)`` (E8M0 for MX, E4M3 for NVFP4) in cuBLAS's 32x4x4
    block-scaling layout, flat, of the same dtype.

    Rows are padded to a multiple of 128 and ``k_blocks`` to one of 4 (with
    ones in E8M0, zeros in E4M3, whose byte 127 is NaN; the data there is
    zero). Each 128 x 4 tile of the padded matrix becomes 512 contiguous
    bytes, tiles in row-major order; inside a tile, row ``r`` and column ``c``
    land at ``(r % 32) * 16 + (r // 32) * 4 + c``.
    """
    rows, cols = scale.shape
    bytes_ = scale.contiguous().view(torch.uint8)
    pad_r, pad_c = -rows % 128, -cols % 4
    if pad_r or pad_c:
        fill = 127 if scale.dtype == torch.float8_e8m0fnu else 0  # E8M0's 1; E4M3's 0
        bytes_ = F.pad(bytes_, (0, pad_c, 0, pad_r), value=fill)
    tr, tc = bytes_.shape[0] // 128, bytes_.shape[1] // 4
    # (tile row, 4 groups of 32 rows, 32 rows, tile column, 4 columns) -> (tile row, tile column, 32, 4, 4)
    tiles = bytes_.view(tr, 4, 32, tc, 4).permute(0, 3, 2, 1, 4)
    return tiles.reshape(-1).view(scale.dtype)


def nvfp4_args(a: Quantized, b: Quantized) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments of ``torch.nn.functional.scaled_mm`` for two NVFP4 operands, as torch's checks ask.

    ``a`` holds its values packed along ``K`` (``(M, K)`` as stored), ``b`` is
    the transpose of values stored ``(N, K)`` (what ``Quantized.t()`` gives).
    Data: ``a`` row-major ``(M, K / 2)`` bytes and ``b`` column-major, ``K``
    zero-padded to a multiple of 32 elements and ``N`` to one of 16. Scales:
    two levels per operand, the E4M3 block scales (``16 x 16`` weight blocks
    repeated over their 16 rows) in the 32x4x4 layout with
    ``BlockWise1x16``, and the per-tensor ``S_dec`` with ``TensorWise``.
    """
    pa, pb = a.primary, b.primary
    if pa.packing is None or pb.packing is None or pa.packing.transposed or not pb.packing.transposed:
        raise BackendUnavailableError(
            "an NVFP4 product takes a first operand stored along K and a second one that is the transpose "
            "of values stored along K (as ss.nn.Linear's products are)"
        )
    assert pa.tensor_scale_inv is not None
    assert pb.tensor_scale_inv is not None
    n = pb.packing.shape[0]
    a_bytes, b_bytes = pa.data.view(torch.uint8), pb.data.view(torch.uint8)
    pad_k = -a_bytes.shape[1] % 16
    if pad_k:
        a_bytes = F.pad(a_bytes, (0, pad_k))
    pad_n = -n % 16
    if pad_k or pad_n:
        b_bytes = F.pad(b_bytes, (0, pad_k, 0, pad_n))
    sa, sb = _row_scales(pa.scale_inv, pa.tile, pa.packing.shape[0]), _row_scales(pb.scale_inv, pb.tile, n)
    st, sw = F.ScalingType, F.SwizzleType
    recipe = [st.BlockWise1x16, st.TensorWise]
    swizzle = [sw.SWIZZLE_32_4_4, sw.NO_SWIZZLE]
    args = (
        a_bytes.contiguous().view(torch.float4_e2m1fn_x2), b_bytes.contiguous().view(torch.float4_e2m1fn_x2).t(),
        [swizzle_32_4_4(sa), pa.tensor_scale_inv.reshape(1)], recipe,
        [swizzle_32_4_4(sb), pb.tensor_scale_inv.reshape(1)], recipe,
    )
    return args, {"swizzle_a": swizzle, "swizzle_b": swizzle}


def _row_scales(s_b: Tensor, tile: tuple[int, int] | None, rows: int) -> Tensor:
    """Block scales with one row per data row: ``16 x 16`` blocks repeated down their rows."""
    if tile is not None and tile[0] > 1:
        return s_b.view(torch.uint8).repeat_interleave(tile[0], dim=0)[:rows].view(s_b.dtype)
    return s_b


def _pad(x: Tensor, *, rows: int = 0, cols: int = 0) -> Tensor:
    """Append zero rows and columns to a 2-d FP8 tensor (through its bytes: FP8 +0 is all zero bits)."""
    padded_bytes = torch.nn.functional.pad(x.view(torch.uint8), (0, cols, 0, rows))
    return padded_bytes.view(x.dtype)
