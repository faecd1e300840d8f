"""``scaled_mm``: FP8 matrix products through torch's scaled-matmul kernels.

Casts and the step update are the emulation backend's (pure torch, already
exact); only the matrix product changes.

Per-tensor products go through ``torch._scaled_mm``. On CUDA it needs an
sm89+ GPU (Ada, Hopper, Blackwell), a row-major first operand, a column-major
second one, inner and output dimensions divisible by 16, and at most one E5M2
operand. The layouts are made here when needed, and odd dimensions are padded
with zeros (which adds nothing to any product) and cut off again, so any shape
works; only two E5M2 operands cannot (they raise, or fall back, below). On
CPU, torch 2.13 runs it without those limits.

Fine-grained products (operands with a ``tile``) go through
``torch.nn.functional.scaled_mm`` where torch has it, with these mappings
(``a`` is ``(M, K)`` scaled along ``K``; ``b`` is ``(K, N)`` scaled along ``K``):

* row-wise (``a``'s scales ``(M, 1)``, ``b``'s ``(1, N)``): ``ScalingType.RowWise``.
  On CPU in torch 2.13 the kernel runs it; the product is asked for in float32
  and the bias added afterwards, as the emulation does (bit for bit the
  emulation's product in every case measured on CPU). On CUDA the
  row-wise kernel is used for bfloat16 outputs (what torch's own op tests
  exercise on sm89+); for other output dtypes, and in a torch without
  ``torch.nn.functional.scaled_mm``, the per-tensor kernel multiplies the FP8
  data with unit scales into float32 and the row and column scales are applied
  to that result (they factor out of every sum).
* ``1 x 128`` tiles and ``128 x 128`` blocks: ``BlockWise1x128`` /
  ``BlockWise128x128`` (the pairs 1x128 x 1x128, 1x128 x 128x128, 128x128 x 1x128).
  CUDA sm90 only, built with CUDA 12.9+ (cuBLASLt block scaling). Scales are
  handed over in the layouts torch's meta checks ask for: ``1 x 128`` scales
  outer-dimension-major (``(M, K/128)`` with strides ``(1, M)``; ``b``'s as
  ``(N, K/128)`` with strides ``(1, N)``), ``128 x 128`` scales as
  ``(L4, N/128)`` with strides ``(1, L4)``, ``L4`` the number of ``K`` blocks
  rounded up to a multiple of 4. ``K`` is zero-padded to a multiple of 128,
  and a dimension cut into ``128 x 128`` blocks too, so partial tiles and
  blocks at the edges run like whole ones.
* MXFP8 (``1 x 32`` blocks, E8M0 scales): ``BlockWise1x32`` with the scales
  swizzled into cuBLAS's 32x4x4 layout (``SwizzleType.SWIZZLE_32_4_4``), on
  sm100+ GPUs. ``K`` is zero-padded to a multiple of 32.

A ``1 x c`` tile with ``c >= K`` is one scale per row and runs as row-wise.
A fine-grained product with a bias is taken in float32 and the bias added
before the one rounding to the output dtype (the emulation's order), except
in the CUDA row-wise kernel, which adds a bfloat16 bias itself.

A product no kernel here can run (block-wise or MX on CPU or on the wrong GPU,
tiles of another size than torch's, mixed granularities, two E5M2 operands
on CUDA) raises
:class:`~scalestate.errors.BackendUnavailableError` naming the granularity,
the device and what would run it, or, with ``ScaledMMBackend(fallback="emulation")``,
is computed by the emulation backend for that call. :meth:`ScaledMMBackend.supports`
answers per recipe and device without running anything.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from scalestate.backends.base import granularity_label, recipe_granularities
from scalestate.backends.emulation import EmulationBackend
from scalestate.errors import ArgumentTypeError, ArgumentValueError, BackendUnavailableError
from scalestate.finegrained import Granularity
from scalestate.quantized import Quantized
from scalestate.recipe import Recipe, Role

__all__ = ["ScaledMMBackend"]

#: How one operand is scaled along the contraction dimension, in the words of torch's ``ScalingType``.
_Kind = Literal["tensor", "row", "1x128", "128x128", "1x32"]
#: ``(kind of a, kind of b)`` pairs torch's kernels take, in order of preference.
_PAIRS: tuple[tuple[_Kind, _Kind], ...] = (
    ("tensor", "tensor"),
    ("row", "row"),
    ("1x128", "1x128"),
    ("1x128", "128x128"),
    ("128x128", "1x128"),
    ("1x32", "1x32"),
)
_KIND_LABEL: dict[_Kind, str] = {
    "tensor": "a per-tensor scale",
    "row": "row-wise scales",
    "1x128": "1 x 128 tiles",
    "128x128": "128 x 128 blocks",
    "1x32": "E8M0-scaled MX blocks of 32",
}
#: The first torch whose CPU kernel was measured here to run row-wise products (torch 2.13).
_CPU_ROWWISE_TORCH = (2, 13)
_BLOCK_WHERE = "an sm90 GPU (Hopper) with torch built for CUDA 12.9+ (cuBLASLt block scaling)"
_MX_WHERE = "an sm100+ GPU (Blackwell)"
_TWO_E5M2 = "cuBLASLt cannot multiply two E5M2 operands (use Format.HYBRID or Format.E4M3)"
_ALTERNATIVES = 'ScaledMMBackend(fallback="emulation") to emulate those products, or backend="emulation"'


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
        self._cpu_probe: tuple[bool, str] | None = None
        # Facts of the build and the devices, asked once, eagerly: torch.compile cannot trace the queries.
        self._cpu_rowwise = _cpu_runs_rowwise()
        self._capabilities: dict[torch.device, tuple[int, int]] = {}

    @property
    def fallback(self) -> Literal["emulation"] | None:
        """``"emulation"`` if products no kernel can run are emulated, else ``None``."""
        return self._fallback

    def __repr__(self) -> str:
        return f"ScaledMMBackend(fallback={self._fallback!r})"

    def available(self, device: torch.device | None = None) -> tuple[bool, str]:
        """Whether ``torch._scaled_mm`` runs on ``device`` (default: CUDA if present, else CPU)."""
        if not hasattr(torch, "_scaled_mm"):
            return False, f"torch {torch.__version__} has no torch._scaled_mm"
        device = _default_device(device)
        if device.type == "cuda":
            if not torch.cuda.is_available():
                return False, "no CUDA device is visible to torch"
            major, minor = self._capability(device)
            if (major, minor) < (8, 9):
                return False, f"torch._scaled_mm needs sm89+; found sm{major}{minor}"
            return True, f"torch._scaled_mm on sm{major}{minor}"
        if device.type == "cpu":
            if self._cpu_probe is None:
                self._cpu_probe = _probe_cpu()
            return self._cpu_probe
        return False, f"torch._scaled_mm is not supported on {device.type} here"

    def supports(self, recipe: Recipe, device: torch.device | str | None = None) -> tuple[bool, str]:
        """Whether the products of ``recipe`` (those of a linear layer) run on ``device``, and why.

        Per-tensor recipes: where :meth:`available`. Fine-grained ones: where
        torch's kernels take their scales (see the module docs); with
        ``fallback="emulation"`` also elsewhere, the reason then saying that
        the products fall back to emulation. Decided from the device and the
        torch build, without running tensor operations.
        """
        device = _default_device(device)
        ok, why = self.available(device)
        if not ok:
            return False, why
        roles = recipe_granularities(recipe)
        if all(g is None for g in roles.values()):
            return True, why
        name = _recipe_label(recipe, roles)
        failures: dict[str, None] = {}
        for first, second in _PRODUCTS:
            ka, kb = _granularity_kind(roles[first]), _granularity_kind(roles[second])
            if ka is None or kb is None:
                label = granularity_label(roles[first] if ka is None else roles[second])
                failures[f"no torch kernel takes {label} (its block-wise kernels take 1 x 128 tiles and "
                         "128 x 128 blocks, its MX kernel blocks of 32)"] = None
                continue
            if device.type == "cuda" and recipe.format.dtype(first) == recipe.format.dtype(second) == torch.float8_e5m2:
                failures[_TWO_E5M2] = None
            runs, reason = self._pair_runs((ka, kb), device)
            if not runs:
                failures[reason] = None
        where = _device_label(device)
        if not failures:
            return True, f"{name} runs in torch's kernels on {where}"
        why = "; ".join(failures)
        if self._fallback == "emulation":
            return True, f"{name} on {where}: {why}; those products fall back to emulation"
        return False, f"{name} cannot run in torch's kernels on {where}: {why}. Use {_ALTERNATIVES}"

    def wants_transposed(self, device: torch.device) -> bool:
        """True: FP8 operands go in as row-major times column-major (cuBLASLt's rule on CUDA,
        and the compiler's for ``torch._scaled_mm`` everywhere). Fine-grained operands are
        laid out inside :meth:`scaled_mm`."""
        return True

    def scaled_mm(
        self,
        a: Quantized,
        b: Quantized,
        *,
        out_dtype: torch.dtype,
        bias: Tensor | None = None,
    ) -> Tensor:
        """``a @ b`` in torch's kernels; see the module docs for what runs where.

        On CUDA an operand in the wrong layout is taken from its ``transposed``
        copy when the cast made one with the same (per-tensor) scale, else copied.
        """
        if a.tile is None and b.tile is None:
            if (
                a.data.is_cuda
                and a.dtype == torch.float8_e5m2
                and b.dtype == torch.float8_e5m2
                and self._fallback == "emulation"
            ):
                return super().scaled_mm(a, b, out_dtype=out_dtype, bias=bias)
            return _tensorwise(a, b, out_dtype, bias)
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
        if pair == ("row", "row"):
            return self._rowwise(a, b, out_dtype, bias)
        return _blockwise(pair, a, b, out_dtype, bias)

    # ------------------------------------------------------------ deciding

    def _choose(self, a: Quantized, b: Quantized, device: torch.device) -> tuple[tuple[_Kind, _Kind] | None, str]:
        """The first pair of scaling types both operands fit and ``device`` runs, or ``None`` and why not."""
        k = a.data.shape[1]
        kinds_a, kinds_b = _operand_kinds(a, k, first=True), _operand_kinds(b, k, first=False)
        reasons: dict[str, None] = {}
        if device.type == "cuda" and a.dtype == torch.float8_e5m2 and b.dtype == torch.float8_e5m2:
            kinds_a = kinds_b = ()
            reasons[_TWO_E5M2] = None
        for pair in _PAIRS:
            if pair[0] in kinds_a and pair[1] in kinds_b:
                runs, reason = self._pair_runs(pair, device)
                if runs:
                    return pair, ""
                reasons[reason] = None
        what = f"{_operand_label(a, k, first=True)} times {_operand_label(b, k, first=False)}"
        if not reasons:
            reasons["no torch kernel takes that combination of scales (its block-wise kernels take 1 x 128 "
                    "tiles and 128 x 128 blocks, its MX kernel blocks of 32, each with its own kind)"] = None
        return None, f"ScaledMMBackend cannot multiply {what} on {_device_label(device)}: {'; '.join(reasons)}"

    def _pair_runs(self, pair: tuple[_Kind, _Kind], device: torch.device) -> tuple[bool, str]:
        """Whether torch runs products of ``pair`` on ``device`` (which :meth:`available` accepts);
        if not, why not and what would."""
        if pair == ("tensor", "tensor") or pair == ("row", "row"):
            # Row-wise runs wherever per-tensor does: the row and column scales factor out of every sum.
            return self.available(device)
        if "tensor" in pair:
            return False, f"no torch kernel multiplies {_KIND_LABEL[pair[0]]} times {_KIND_LABEL[pair[1]]}"
        mx = pair == ("1x32", "1x32")
        what, where = ("MX blocks", _MX_WHERE) if mx else ("1 x 128 tiles and 128 x 128 blocks", _BLOCK_WHERE)
        if device.type != "cuda":
            return False, (
                f"torch's {device.type.upper()} kernel takes per-tensor and row-wise scales only (torch 2.13 "
                f"refuses others with 'Invalid scaling configuration'); {what} run on {where}"
            )
        if torch.version.hip:
            return False, f"{what} are mapped to torch's kernels for NVIDIA GPUs only; they run on {where}"
        if not _has_functional_scaled_mm():
            return False, (
                f"torch {torch.__version__} has no torch.nn.functional.scaled_mm, which {what} need, "
                f"on {where}"
            )
        major, minor = self._capability(device)
        if mx:
            if major < 10:
                return False, f"{what} run on {where}; found sm{major}{minor}"
            return True, f"{what} on sm{major}{minor}"
        if major != 9:
            return False, f"{what} run on {where}; found sm{major}{minor}"
        if _cuda_version() < (12, 9):
            return False, f"{what} run on {where}; this torch is built for CUDA {torch.version.cuda}"
        return True, f"{what} on sm{major}{minor}"

    def _capability(self, device: torch.device) -> tuple[int, int]:
        """The compute capability of a CUDA ``device``, asked of torch once (at binding, by :meth:`available`)."""
        known = self._capabilities.get(device)
        if known is None:
            major, minor = torch.cuda.get_device_capability(device)
            known = self._capabilities[device] = (major, minor)
        return known

    # ------------------------------------------------------------ products

    def _rowwise(self, a: Quantized, b: Quantized, out_dtype: torch.dtype, bias: Tensor | None) -> Tensor:
        """A product of row-wise scaled operands: the row-wise kernel where it takes the output dtype,
        else the per-tensor kernel on the data and the scales applied to its float32 result."""
        m, n = a.data.shape[0], b.data.shape[1]
        sa = a.scale_inv.float().reshape(-1).view(m, 1)  # fresh strides (size-1 dims keep odd ones)
        sb = b.scale_inv.float().reshape(-1).view(1, n)
        cuda = a.data.is_cuda
        if not cuda and self._cpu_rowwise:
            out = F.scaled_mm(
                a.data, b.data, sa, F.ScalingType.RowWise, sb, F.ScalingType.RowWise, output_dtype=torch.float32
            )
            return _finish(out, out_dtype, bias)
        fuse = bias is None or bias.dtype == torch.bfloat16
        if cuda and out_dtype == torch.bfloat16 and fuse and _has_functional_scaled_mm():
            args, kwargs = _rowwise_args(a, b, bias)
            out = F.scaled_mm(*args, **kwargs)
            return out[:, :n] if out.shape[1] != n else out
        one = torch.ones((), dtype=torch.float32, device=a.data.device)
        to = 16 if cuda else 1  # cuBLASLt's multiples of 16
        a_data, b_data = _padded(a.data, b.data, k_to=to, n_to=to)
        out = torch._scaled_mm(a_data, b_data, scale_a=one, scale_b=one, out_dtype=torch.float32)
        if out.shape[1] != n:
            out = out[:, :n]
        return _finish(out * sa * sb, out_dtype, bias)


def _rowwise_args(a: Quantized, b: Quantized, bias: Tensor | None) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments of ``torch.nn.functional.scaled_mm`` for a row-wise product on CUDA, bfloat16 out:
    ``a`` row-major and ``b`` column-major, ``K`` and ``N`` zero-padded to multiples of 16, ``a``'s
    scales ``(M, 1)`` and ``b``'s ``(1, N)`` (padded with ones), the bias fused (padded with zeros)."""
    m, n = a.data.shape[0], b.data.shape[1]
    sa = a.scale_inv.float().reshape(-1).view(m, 1)
    sb = b.scale_inv.float().reshape(-1).view(1, n)
    a_data, b_data = _padded(a.data, b.data, k_to=16, n_to=16)
    pad_n = b_data.shape[1] - n
    if pad_n:
        sb = F.pad(sb, (0, pad_n), value=1.0)
        bias = None if bias is None else F.pad(bias, (0, pad_n))
    st = F.ScalingType.RowWise
    return (a_data, b_data, sa, st, sb, st), {"bias": bias, "output_dtype": torch.bfloat16}


def _tensorwise(a: Quantized, b: Quantized, out_dtype: torch.dtype, bias: Tensor | None) -> Tensor:
    """The per-tensor product through ``torch._scaled_mm``."""
    n = b.data.shape[1]
    fuse_bias = bias is not None and bias.dtype == out_dtype
    a_data, b_data = _layout(a, b, pad=a.data.is_cuda)
    if a.data.is_cuda:
        fuse_bias = fuse_bias and out_dtype != torch.float32 and b_data.shape[1] == n
    late_bias = None if fuse_bias else bias
    out = torch._scaled_mm(
        a_data,
        b_data,
        scale_a=a.scale_inv,
        scale_b=b.scale_inv,
        bias=bias if fuse_bias else None,
        # a bias added afterwards is added in float32, then rounded once
        out_dtype=out_dtype if late_bias is None else torch.float32,
    )
    if out.shape[1] != n:  # cut off the padded columns
        out = out[:, :n]
    if late_bias is not None:
        out = (out + late_bias.float()).to(out_dtype)
    return out


def _blockwise(pair: tuple[_Kind, _Kind], a: Quantized, b: Quantized, out_dtype: torch.dtype,
               bias: Tensor | None) -> Tensor:
    """A product of ``1 x 128`` / ``128 x 128`` or MX operands through ``torch.nn.functional.scaled_mm``
    on CUDA (its operands and scales laid out by :func:`_block_args`)."""
    m, n = a.data.shape[0], b.data.shape[1]
    args, kwargs = _block_args(pair, a, b)
    kwargs["output_dtype"] = out_dtype if bias is None else torch.float32
    out = F.scaled_mm(*args, **kwargs)
    if out.shape != (m, n):
        out = out[:m, :n]
    return out if bias is None else _finish(out, out_dtype, bias)


def _block_args(pair: tuple[_Kind, _Kind], a: Quantized, b: Quantized) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The positional and swizzle arguments of ``torch.nn.functional.scaled_mm`` for a block-wise or MX pair.

    Data: ``a`` row-major, ``b`` column-major, zero-padded (``K`` to the block
    along it, a dimension cut into 128-row blocks to 128, the others to 16).
    Scales: in the layouts of torch's checks (see the module docs), padded with
    ones where the data is padded.
    """
    st = F.ScalingType
    n = b.data.shape[1]
    if pair == ("1x32", "1x32"):
        a_data, b_data = _padded(a.data, b.data, k_to=32, n_to=16)
        sa = _swizzle_32_4_4(a.scale_inv)
        sb = _swizzle_32_4_4(b.scale_inv.t())
        swizzle = F.SwizzleType.SWIZZLE_32_4_4
        return (a_data, b_data, sa, st.BlockWise1x32, sb, st.BlockWise1x32), {
            "swizzle_a": swizzle, "swizzle_b": swizzle,
        }
    kind_a, kind_b = pair
    a_data, b_data = _padded(
        a.data, b.data, k_to=128, n_to=128 if kind_b == "128x128" else 16, m_to=128 if kind_a == "128x128" else 1
    )
    k_blocks = b_data.shape[0] // 128
    l4 = -(-k_blocks // 4) * 4
    sa_in, sb_in = a.scale_inv.float(), b.scale_inv.float()
    if kind_a == "1x128":  # (M, K/128), strides (1, M)
        sa = sa_in.t().contiguous().t()
    else:  # 128 x 128: (L4, M/128), strides (1, L4)
        sa = F.pad(sa_in, (0, l4 - k_blocks), value=1.0).contiguous().t()
    if kind_b == "1x128":  # (N, K/128), strides (1, N); sb_in is (K/128, N)
        sb = F.pad(sb_in, (0, b_data.shape[1] - n), value=1.0).contiguous().t()
    else:  # 128 x 128: (L4, N/128), strides (1, L4); sb_in is (K/128, N/128)
        sb = F.pad(sb_in.t(), (0, l4 - k_blocks), value=1.0).contiguous().t()
    ta = st.BlockWise1x128 if kind_a == "1x128" else st.BlockWise128x128
    tb = st.BlockWise1x128 if kind_b == "1x128" else st.BlockWise128x128
    return (a_data, b_data, sa, ta, sb, tb), {}


def _finish(out: Tensor, out_dtype: torch.dtype, bias: Tensor | None) -> Tensor:
    """A float32 product plus ``bias`` (added in float32), rounded once to ``out_dtype``: the emulation's order."""
    if bias is not None:
        out = out + bias.float()
    return out if out_dtype == torch.float32 else out.to(out_dtype)


# ---------------------------------------------------------------- operands


def _operand_kinds(q: Quantized, k: int, *, first: bool) -> tuple[_Kind, ...]:
    """The scaling types ``q`` fits as the first (``(M, K)``) or second (``(K, N)``) operand.

    A ``1 x c`` tile with ``c >= K`` is one scale per row: it fits the row-wise
    kernel as well as (when ``c == 128``) the ``1 x 128`` one.
    """
    if q.tile is None:
        return ("tensor",)
    along_k, across = (q.tile[1], q.tile[0]) if first else (q.tile[0], q.tile[1])
    if q.scale_inv.dtype == torch.float8_e8m0fnu:
        return ("1x32",) if (across, along_k) == (1, 32) else ()
    kinds: list[_Kind] = []
    if across == 1 and along_k >= k:
        kinds.append("row")
    if (across, along_k) == (1, 128):
        kinds.append("1x128")
    if (across, along_k) == (128, 128):
        kinds.append("128x128")
    return tuple(kinds)


def _operand_label(q: Quantized, k: int, *, first: bool) -> str:
    """``q``'s scaling in words, as seen along the contraction dimension (``"1 x 64 tiles"``)."""
    if q.tile is None:
        return _KIND_LABEL["tensor"]
    along_k, across = (q.tile[1], q.tile[0]) if first else (q.tile[0], q.tile[1])
    if q.scale_inv.dtype == torch.float8_e8m0fnu:
        return f"E8M0-scaled MX blocks of {along_k}"
    if across == 1 and along_k >= k:
        return _KIND_LABEL["row"]
    if across == 1:
        return f"1 x {along_k} tiles"
    return f"{across} x {along_k} blocks"


def _pair_label(pair: tuple[_Kind, _Kind]) -> str:
    if pair[0] == pair[1]:
        return "operands with " + _KIND_LABEL[pair[0]]
    return f"{_KIND_LABEL[pair[0]]} times {_KIND_LABEL[pair[1]]}"


def _padded(a: Tensor, b: Tensor, *, k_to: int, n_to: int, m_to: int = 1) -> tuple[Tensor, Tensor]:
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


def _swizzle_32_4_4(scale: Tensor) -> Tensor:
    """E8M0 scales ``(rows, k_blocks)`` in cuBLAS's 32x4x4 block-scaling layout, flat.

    Rows are padded to a multiple of 128 and ``k_blocks`` to one of 4 (with
    E8M0 ones; the data there is zero). Each 128 x 4 tile of the padded
    matrix becomes 512 contiguous bytes, tiles in row-major order; inside a
    tile, row ``r`` and column ``c`` land at ``(r % 32) * 16 + (r // 32) * 4 + c``.
    """
    rows, cols = scale.shape
    bytes_ = scale.contiguous().view(torch.uint8)
    pad_r, pad_c = -rows % 128, -cols % 4
    if pad_r or pad_c:
        bytes_ = F.pad(bytes_, (0, pad_c, 0, pad_r), value=127)  # 127: the E8M0 encoding of 1
    tr, tc = bytes_.shape[0] // 128, bytes_.shape[1] // 4
    # (tile row, 4 groups of 32 rows, 32 rows, tile column, 4 columns) -> (tile row, tile column, 32, 4, 4)
    tiles = bytes_.view(tr, 4, 32, tc, 4).permute(0, 3, 2, 1, 4)
    return tiles.reshape(-1).view(torch.float8_e8m0fnu)


# ---------------------------------------------------------------- recipes


def _granularity_kind(g: Granularity | None) -> _Kind | None:
    """The scaling type torch calls a cast of granularity ``g``, or ``None`` if torch has no kernel for it."""
    if g is None:
        return "tensor"
    if g.kind == "row":
        return "row"
    if g.kind == "mx":
        return "1x32" if g.block == 32 else None
    if g.block != 128:
        return None
    return "128x128" if g.kind == "block" else "1x128"


#: The operands of a linear layer's three products: forward, input gradient, weight gradient.
_PRODUCTS = ((Role.INPUT, Role.WEIGHT), (Role.GRAD_OUTPUT, Role.WEIGHT), (Role.GRAD_OUTPUT, Role.INPUT))


def _recipe_label(recipe: Recipe, roles: dict[Role, Granularity | None]) -> str:
    kinds = dict.fromkeys(granularity_label(g) for g in roles.values())
    return f"{type(recipe).__name__} ({', '.join(kinds)})"


# ---------------------------------------------------------------- torch build


def _default_device(device: torch.device | str | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _device_label(device: torch.device) -> str:
    if device.type == "cpu":
        return f"CPU (torch {torch.__version__})"
    return str(device)


def _has_functional_scaled_mm() -> bool:
    return hasattr(F, "scaled_mm") and hasattr(F, "ScalingType")


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def _cuda_version() -> tuple[int, int]:
    if not torch.version.cuda:
        return (0, 0)
    major, _, minor = torch.version.cuda.partition(".")
    return int(major), int(minor.partition(".")[0] or 0)


def _cpu_runs_rowwise() -> bool:
    """Whether this torch's CPU kernel takes row-wise scales (measured in torch 2.13), asked of the dispatcher."""
    if not _has_functional_scaled_mm() or _torch_version() < _CPU_ROWWISE_TORCH:
        return False
    has_kernel = getattr(torch._C, "_dispatch_has_kernel_for_dispatch_key", None)
    return has_kernel is not None and bool(has_kernel("aten::_scaled_mm_v2", "CPU"))


def _layout(qa: Quantized, qb: Quantized, *, pad: bool) -> tuple[Tensor, Tensor]:
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
    return _padded(a, b, k_to=16, n_to=16)


def _pad(x: Tensor, *, rows: int = 0, cols: int = 0) -> Tensor:
    """Append zero rows and columns to a 2-d FP8 tensor (through its bytes: FP8 +0 is all zero bits)."""
    padded = torch.nn.functional.pad(x.view(torch.uint8), (0, cols, 0, rows))
    return padded.view(x.dtype)


def _probe_cpu() -> tuple[bool, str]:
    """Whether this torch has a CPU kernel for ``torch._scaled_mm`` (older builds do not).

    Asked of the dispatcher, not by running a product: availability may be
    checked during a first cast inside a checkpointed region, where an extra
    operation would be recorded (selective checkpointing caches products by
    order). Torch builds without that query run a 1x1 product instead.
    """
    has_kernel = getattr(torch._C, "_dispatch_has_kernel_for_dispatch_key", None)
    if has_kernel is not None:
        if has_kernel("aten::_scaled_mm", "CPU"):
            return True, f"torch._scaled_mm on CPU (torch {torch.__version__})"
        return False, f"torch {torch.__version__} has no CPU kernel for torch._scaled_mm"
    one = torch.ones((), dtype=torch.float32)
    x = torch.ones(1, 1, dtype=torch.float8_e4m3fn)
    try:
        torch._scaled_mm(x, x, scale_a=one, scale_b=one, out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return False, f"torch {torch.__version__} has no CPU kernel for torch._scaled_mm ({first})"
    return True, f"torch._scaled_mm on CPU (torch {torch.__version__})"
