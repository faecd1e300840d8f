"""scalestate.handle: what a module holds."""

from __future__ import annotations

import torch

import scalestate as ss

I, W, G = ss.Role.INPUT, ss.Role.WEIGHT, ss.Role.GRAD_OUTPUT


class TestHandle:
    def test_properties(self, delayed):
        """name, roles, manager and repr."""
        h = delayed.register("blocks.0.fc1", roles=(I, G))
        assert h.name == "blocks.0.fc1" and h.roles == (I, G) and h.manager is delayed
        assert repr(h) == "<ScalingHandle('blocks.0.fc1', roles=(INPUT, GRAD_OUTPUT))>"

    def test_scale_and_history_are_copies(self, manager):
        """scale() and amax_history() return copies that follow step() but never alias the state."""
        h = manager.register("fc", roles=(I,))
        s, hist = h.scale(I), h.amax_history(I)
        assert s.item() == 1.0 and hist.shape == (manager.recipe.history_len,)
        s.fill_(5.0)
        hist.fill_(5.0)
        assert h.scale(I).item() == 1.0 and h.amax_history(I).sum().item() == 0.0
        with manager.forward():
            h.quantize(torch.tensor([2.0]), I)
        manager.step()
        assert h.amax_history(I)[-1].item() == 2.0
        # 448 / 2, rounded down to a power of two where the recipe rounds (block, MX)
        assert h.scale(I).item() == (128.0 if manager.recipe.power_of_2 else 224.0)

    def test_quantize_builds_no_graph(self, delayed):
        """Casting a tensor that requires grad records no autograd history."""
        h = delayed.register("fc", roles=(I,))
        q = h.quantize(torch.randn(4, requires_grad=True), I)
        assert q.data.grad_fn is None and q.scale_inv.grad_fn is None
