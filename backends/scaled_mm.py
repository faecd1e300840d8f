"""``scaled_mm``: FP8 matrix products through ``torch._scaled_mm``.

Casts and the step update are the emulation backend's (pure torch, already
exact); only the matrix product changes. On CUDA, ``torch._scaled_mm`` needs an
sm89+ GPU (Ada, Hopper, Blackwell), a row-major first operand, a column-major
second one, inner and output dimensions divisible by 16, and at most one E5M2
operand. The layouts are made here when needed, and odd dimensions are padded
with zeros (which adds nothing to any product) and cut off again, so any shape
works; only two E5M2 operands cannot. On CPU, torch 2.13 runs it without
those limits.
"""

from __future__ import annotations

import torch
from torch import Tensor

from scalestate.backends.emulation import EmulationBackend
from scalestate.errors import BackendUnavailableError
from scalestate.quantized import Quantized

__all__ = ["ScaledMMBackend"]


class ScaledMMBackend(EmulationBackend):
    """FP8 GEMMs with ``torch._scaled_mm``; casts and updates as in emulation."""

    name = "scaled_mm"

    def __init__(self) -> None:
        super().__init__()
        self._cpu_probe: tuple[bool, str] | None = None

    def available(self, device: torch.device | None = None) -> tuple[bool, str]:
        """Whether ``torch._scaled_mm`` runs on ``device`` (default: CUDA if present, else CPU)."""
        if not hasattr(torch, "_scaled_mm"):
            return False, f"torch {torch.__version__} has no torch._scaled_mm"
        if device is None:
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(device)
        if device.type == "cuda":
            if not torch.cuda.is_available():
                return False, "no CUDA device is visible to torch"
            major, minor = torch.cuda.get_device_capability(device)
            if (major, minor) < (8, 9):
                return False, f"torch._scaled_mm needs sm89+; found sm{major}{minor}"
            return True, f"torch._scaled_mm on sm{major}{minor}"
        if device.type == "cpu":
            if self._cpu_probe is None:
                self._cpu_probe = _probe_cpu()
            return self._cpu_probe
        return False, f"torch._scaled_mm is not supported on {device.type} here"

    def wants_transposed(self, device: torch.device) -> bool:
        """True: FP8 operands go in as row-major times column-major (cuBLASLt's rule on CUDA,
        and the compiler's for ``torch._scaled_mm`` everywhere)."""
        return True

    def scaled_mm(
        self,
        a: Quantized,
        b: Quantized,
        *,
        out_dtype: torch.dtype,
        bias: Tensor | None = None,
    ) -> Tensor:
        """``torch._scaled_mm(a, b)``; see the module docs for limits.

        On CUDA an operand in the wrong layout is taken from its ``transposed``
        copy when the cast made one (no copy here), else copied.
        """
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
            "use Format.HYBRID or Format.E4M3, or backend='emulation'"
        )
    k, n = b.shape
    pad_k, pad_n = -k % 16, -n % 16
    if pad_k:
        a = _pad(a, cols=pad_k)
    if pad_k or pad_n:
        b = _pad(b.t(), rows=pad_n, cols=pad_k).t()
    if not a.is_contiguous():
        a = a.contiguous()
    if not b.t().is_contiguous():
        b = b.t().contiguous().t()
    return a, b


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
