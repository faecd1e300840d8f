"""Grouped (mixture-of-experts) layers on a CUDA GPU: the CPU suite's main equalities, run on the device.

Expert ``e`` of a ``GroupedLinear`` is, bitwise, an ``ss.nn.Linear`` on its
tokens (eager, both backends whose products run there); compiled code with
the group sizes on the device runs one graph for every routing with eager's
bits (per-tensor and fine-grained recipes on the emulation backend, per-tensor ones on scaled_mm). Run by
``benchmarks/gpu_check.sh``; skipped without a GPU, with the reason.
"""

from __future__ import annotations

import pytest
import torch
from test_grouped import _run as run_grouped
from test_grouped_compile import FINE_SIZES
from test_grouped_compile import _run as run_compiled

import scalestate as ss
from helpers import RECIPES
from scalestate.testing import assert_same

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (benchmarks/gpu_check.sh runs these on one)"
)


def _capability() -> tuple[int, int]:
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)


@pytest.mark.parametrize("backend", ["emulation", "scaled_mm"])
@pytest.mark.parametrize("recipe", ["delayed", "rowwise"])
def test_grouped_equals_one_linear_per_expert_on_the_gpu(recipe: str, backend: str) -> None:
    """Outputs, input and weight gradients, histories and scales, over three steps of two microbatches
    with empty experts: the grouped layer against a loop of ss.nn.Linear, bitwise, on the GPU."""
    if backend == "scaled_mm" and _capability() < ((9, 0) if recipe == "rowwise" else (8, 9)):
        pytest.skip(f"torch's scaled matmul for {recipe} scaling needs sm89+ (row-wise: sm90+); this GPU is "
                    f"sm{''.join(map(str, _capability()))}")
    got = run_grouped(RECIPES[recipe], backend, True, device="cuda")
    want = run_grouped(RECIPES[recipe], backend, False, device="cuda")
    assert_same(got, want, name=f"grouped vs loop, {recipe}, {backend}, cuda")


@pytest.mark.parametrize(
    ("recipe", "backend", "sizes"),
    [
        (ss.DelayedScaling(history_len=4), "emulation", None),
        (ss.DelayedScaling(history_len=4), "scaled_mm", None),
        (ss.MXFP8Scaling(), "emulation", FINE_SIZES),
    ],
    ids=["delayed-emulation", "delayed-scaled_mm", "mxfp8-emulation"],
)
def test_compiled_sizes_on_the_device_on_the_gpu(recipe: ss.Recipe, backend: str, sizes: list | None) -> None:
    """Group sizes as a CUDA tensor: one compiled frame (aot_eager) over every routing, bitwise eager (the
    grouped casts and products on emulation; the two operators for MXFP8, and for scaled_mm, whose products
    on CUDA are torch's kernels, one per expert)."""
    if backend == "scaled_mm" and _capability() < (8, 9):
        pytest.skip(f"torch's scaled matmul needs sm89+; this GPU is sm{''.join(map(str, _capability()))}")
    kwargs = {} if sizes is None else {"sizes_per_step": sizes}
    got, frames = run_compiled(recipe, "aot_eager", device="cuda", backend=backend, **kwargs)
    want, _ = run_compiled(recipe, None, device="cuda", backend=backend, **kwargs)
    assert frames == 1
    assert_same(got, want, name=f"compiled vs eager, {type(recipe).__name__}, {backend}, cuda")
