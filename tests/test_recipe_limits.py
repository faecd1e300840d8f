"""Where fine-grained recipes are refused, with an error that says what to do instead.

FP8 all-gather under FSDP2 casts every shard with the slot's one per-tensor
scale, and tensor-parallel layers reduce one amax per logical tensor: neither
has a meaning for rows, tiles or blocks that a shard would split.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from dist_harness import run_ranks

import scalestate as ss

FINE = [ss.RowwiseScaling(), ss.BlockScaling(block=8), ss.MXFP8Scaling()]


@pytest.mark.parametrize("recipe", FINE, ids=lambda r: type(r).__name__)
def test_fp8_all_gather_needs_a_per_tensor_recipe(recipe):
    m = ss.ScalingStateManager(recipe, backend="emulation")
    with pytest.raises(ss.errors.CastError, match="fp8_all_gather=False") as info:
        ss.nn.Linear(16, 8, manager=m, fp8_all_gather=True)
    assert type(recipe).__name__ in str(info.value)
    net = torch.nn.Sequential(torch.nn.Linear(16, 8))
    with pytest.raises(ss.errors.CastError, match="fp8_all_gather=False"):
        ss.nn.convert(net, ss.ScalingStateManager(recipe, backend="emulation"), fp8_all_gather=True)


def _tensor_parallel(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    out: dict[str, Any] = {}
    for recipe in [*FINE, ss.CurrentScaling()]:
        m = ss.ScalingStateManager(recipe, backend="emulation", group=None)
        layer = ss.nn.Linear(16, 8, bias=False, manager=m, name="fc")
        w = distribute_tensor(layer.weight.detach(), mesh, [Shard(0)])
        x = distribute_tensor(torch.randn(4, 16), mesh, [Replicate()])
        try:
            ss.nn.linear(x, w, None, layer.handle)
            out[type(recipe).__name__] = "ran"
        except ss.errors.CastError as e:
            out[type(recipe).__name__] = str(e)
    return out


def test_tensor_parallel_needs_a_per_tensor_recipe():
    (result,) = run_ranks(_tensor_parallel, 1)
    assert result["CurrentScaling"] == "ran"  # the same call runs with a per-tensor recipe
    for recipe in FINE:
        message = result[type(recipe).__name__]
        assert "tensor-parallel" in message and type(recipe).__name__ in message
        assert "ss.DelayedScaling or ss.CurrentScaling" in message
