"""The ``cuda`` backend object: availability, dispatch to the kernels, products through cuBLASLt."""

from __future__ import annotations

import os
import sys

import torch
from torch import Tensor

from scalestate.backends.base import CastRequest, StepUpdate
from scalestate.backends.emulation import EmulationBackend
from scalestate.backends.scaled_mm import ScaledMMBackend
from scalestate.granularity import NVFP4_KINDS, GranularityKind
from scalestate.quantized import Quantized
from scalestate.recipe import Recipe

__all__ = ["LONGEST_ROW", "MIN_CAPABILITY", "MIN_TRITON", "CudaBackend", "interpreted", "triton_version"]

#: FP8 conversions and tensor cores: Ada (8.9), Hopper (9.0), Blackwell (10.0, 12.0).
MIN_CAPABILITY = (8, 9)
#: Rows longer than this are cast row-wise by the emulation's code (one program instance holds a row).
LONGEST_ROW = 1 << 16
#: The oldest Triton whose ``tl.math.div_rn``, bitcasts and FP8 types the kernels use.
MIN_TRITON = (3, 0)


def interpreted() -> bool:
    """Whether Triton's interpreter runs the kernels (``TRITON_INTERPRET=1``), as Triton decides it:
    when the kernels' module is first imported (read from the environment until then)."""
    module = sys.modules.get("scalestate.backends.cuda.launch")
    if module is not None:
        return bool(module.INTERPRETED)
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_version() -> tuple[int, int] | None:
    """The installed Triton's ``(major, minor)``, or ``None`` when it does not import."""
    try:
        import triton
    except ImportError:
        return None
    major, minor, *_ = (int(p) if p.isdigit() else 0 for p in triton.__version__.split(".")[:2])
    return major, minor


class CudaBackend(EmulationBackend):
    """Fused FP8 casts and the step update in Triton kernels; products in torch's scaled matmuls.

    On a CUDA GPU of compute capability 8.9+, every cast is one kernel (two
    for a just-in-time scale, which needs the amax before the cast), writing
    the row-major data, the transposed copy when asked, the scales, and the
    slot's amax in the same pass; the step update is one launch for all
    slots. Products go through :class:`~scalestate.backends.scaled_mm.ScaledMMBackend`
    (``fallback="emulation"``). Under Triton's interpreter (``TRITON_INTERPRET=1``
    set before the first import) the same kernels run on CPU tensors, with
    the emulation's products: for testing only, slowly.
    """

    name = "cuda"

    def __init__(self) -> None:
        super().__init__()
        self._products = ScaledMMBackend(fallback="emulation")

    def __repr__(self) -> str:
        mode = "interpreter" if interpreted() else "gpu"
        return f"CudaBackend(mode={mode!r})"

    def available(self, device: torch.device | None = None) -> tuple[bool, str]:
        """Whether the kernels run on ``device`` (default: the current CUDA device), and why not."""
        version = triton_version()
        if version is None:
            return False, 'Triton is not installed: pip install "scalestate[cuda]" (CUDA builds of torch bring it)'
        if version < MIN_TRITON:
            return False, f"Triton {version[0]}.{version[1]} is too old; the kernels need Triton >= 3.0"
        device = torch.device(device) if device is not None else torch.device("cuda")
        if device.type == "cpu":
            if interpreted():
                return True, "Triton's interpreter (TRITON_INTERPRET=1) runs the kernels on CPU: for testing only"
            return False, (
                "the cuda backend's kernels need a CUDA GPU; on CPU they run only under Triton's interpreter "
                "(TRITON_INTERPRET=1 before importing scalestate's cuda backend), for testing. "
                "Use backend='emulation' on CPU"
            )
        if device.type != "cuda":
            return False, f"the cuda backend runs on CUDA devices; got {device.type!r}"
        if interpreted():
            return False, "TRITON_INTERPRET=1 is set: the kernels run on CPU tensors only; unset it to use the GPU"
        if not torch.cuda.is_available():
            return False, "no CUDA GPU is visible to torch"
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            return False, f"there is no CUDA device {index} (torch sees {torch.cuda.device_count()})"
        cc = torch.cuda.get_device_capability(index)
        if cc < MIN_CAPABILITY:
            return False, (
                f"{torch.cuda.get_device_name(index)} has compute capability {cc[0]}.{cc[1]}; the FP8 kernels "
                "need 8.9+ (Ada, Hopper, Blackwell). Use backend='emulation'"
            )
        return True, f"Triton kernels on {torch.cuda.get_device_name(index)} (sm_{cc[0]}{cc[1]})"

    def supports(self, recipe: Recipe, device: torch.device | str | None = None) -> tuple[bool, str]:
        """Every recipe's casts run in the kernels where :meth:`available`; products as ``scaled_mm``'s
        (falling back to emulation where no torch kernel takes them)."""
        dev = torch.device(device) if device is not None else None
        ok, why = self.available(dev)
        if not ok:
            return False, why
        if dev is not None and dev.type == "cuda":
            _, products = self._products.supports(recipe, dev)
            return True, f"{why}; products: {products}"
        return True, f"{why}; products: the emulation's"

    def cast(self, request: CastRequest) -> Quantized:
        """The cast in the kernels (see :mod:`scalestate.backends.cuda`)."""
        x, spec = request.x, request.spec
        g = spec.granularity
        if x.numel() == 0 or (g is not None and _kernel_cannot(g.kind, g.block, x)):
            return super().cast(request)
        from scalestate.backends.cuda import launch

        return launch.cast(request)

    def wants_transposed(self, device: torch.device) -> bool:
        """As ``scaled_mm``'s on CUDA (row-major times column-major); no on CPU (emulated products)."""
        return device.type == "cuda" and self._products.wants_transposed(device)

    def grouped_products(self, device: torch.device) -> bool:
        """Off CUDA only, where the products are the emulation's (on CUDA they are cuBLASLt's, one per group)."""
        return device.type != "cuda"

    def scaled_mm(
        self, a: Quantized, b: Quantized, *, out_dtype: torch.dtype, bias: Tensor | None = None
    ) -> Tensor:
        """On CUDA through torch's scaled matmuls (cuBLASLt); on CPU the emulation's product."""
        if a.data.device.type == "cuda":
            return self._products.scaled_mm(a, b, out_dtype=out_dtype, bias=bias)
        return super().scaled_mm(a, b, out_dtype=out_dtype, bias=bias)

    def update(self, update: StepUpdate) -> None:
        """The step update of every slot in one launch, in place (accumulators zeroed in it too)."""
        from scalestate.backends.cuda import launch

        launch.update(
            update.history, update.scales, update.step_amax, update.fp8_max, update.rule,
            update.nonfinite_counts, update.forget_nonfinite,
        )


def _kernel_cannot(kind: GranularityKind, block: int, x: Tensor) -> bool:
    """Casts the kernels leave to the emulation's code: tiles of a size that is not a power of two,
    rows longer than :data:`LONGEST_ROW`, and NVFP4 (no kernel of its own yet: torch operations)."""
    if kind in NVFP4_KINDS:
        return True
    if kind == GranularityKind.ROW:
        return x.shape[-1] > LONGEST_ROW or (x.dim() == 2 and x.shape[0] > LONGEST_ROW)
    return block & (block - 1) != 0
