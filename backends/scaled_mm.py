"""``scaled_mm``: FP8 matrix products through ``torch._scaled_mm``.

Casts and the step update are the emulation backend's (pure torch, already
exact); only the matrix product changes. On CUDA, ``torch._scaled_mm`` needs an
sm89+ GPU (Ada, Hopper, Blackwell), a row-major first operand, a column-major
second one (made here when needed), inner and output dimensions divisible by
16, and at most one E5M2 operand. On CPU, torch 2.13 runs it without those limits.
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

    def scaled_mm(
        self,
        a: Quantized,
        b: Quantized,
        *,
        out_dtype: torch.dtype,
        bias: Tensor | None = None,
    ) -> Tensor:
        """``torch._scaled_mm(a, b)`` with per-tensor scales; see the module docs for limits."""
        a_data, b_data = a.data, b.data
        fuse_bias = bias is not None and bias.dtype == out_dtype
        if a_data.is_cuda:
            a_data, b_data = _cuda_layout(a_data, b_data)
            fuse_bias = fuse_bias and out_dtype != torch.float32
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
        if late_bias is not None:
            out = (out + late_bias.float()).to(out_dtype)
        return out


def _cuda_layout(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """Meet cuBLASLt's FP8 rules: row-major ``a``, column-major ``b``, dims % 16, not both E5M2."""
    if a.dtype == torch.float8_e5m2 and b.dtype == torch.float8_e5m2:
        raise BackendUnavailableError(
            "torch._scaled_mm on CUDA cannot multiply two E5M2 operands; "
            "use Format.HYBRID or Format.E4M3, or backend='emulation'"
        )
    k, n = b.shape
    if k % 16 or n % 16:
        raise BackendUnavailableError(
            f"torch._scaled_mm on CUDA needs the inner and output dimensions to be "
            f"multiples of 16; got a {tuple(a.shape)} @ b {tuple(b.shape)}. "
            "Pad the layer, leave it out of ss.nn.convert (filter_fn), or use backend='emulation'"
        )
    if not a.is_contiguous():
        a = a.contiguous()
    if not b.t().is_contiguous():
        b = b.t().contiguous().t()
    return a, b


def _probe_cpu() -> tuple[bool, str]:
    """Run a 1x1 product once: older torch builds have no CPU kernel for it."""
    one = torch.ones((), dtype=torch.float32)
    x = torch.ones(1, 1, dtype=torch.float8_e4m3fn)
    try:
        torch._scaled_mm(x, x, scale_a=one, scale_b=one, out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return False, f"torch {torch.__version__} has no CPU kernel for torch._scaled_mm ({first})"
    return True, f"torch._scaled_mm on CPU (torch {torch.__version__})"
