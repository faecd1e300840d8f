"""The weight-cast cache: weight casts cached per (tensor, version, scale epoch) (invariant 5)."""

from __future__ import annotations

import torch
import torch.utils.checkpoint as tcp

import scalestate as ss
from scalestate.testing import CastSpy, assert_same

I, W, G = ss.Role.INPUT, ss.Role.WEIGHT, ss.Role.GRAD_OUTPUT


def _watch(manager: ss.ScalingStateManager) -> CastSpy:
    """A spy on the manager's backend for the rest of the test (each test has a manager of its own)."""
    spy = CastSpy(manager)
    spy.__enter__()
    return spy


def _weight_amax(manager: ss.ScalingStateManager, name: str) -> float:
    sd = manager.state_dict()
    return float(sd["step_amax"][sd["slots"].index([name, "weight"])])


class TestWeightCastCache:
    def _setup(self, manager):
        layer = ss.nn.Linear(16, 8, manager=manager, name="fc")
        return layer, _watch(manager)

    def test_once_per_step_across_microbatches_and_recompute(self, manager):
        """4 checkpointed microbatches: one weight cast per step; a new one after the optimizer step."""
        layer, spy = self._setup(manager)
        opt = torch.optim.SGD(layer.parameters(), lr=0.1)
        for step in range(3):
            for _ in range(4):
                with manager.forward():
                    y = tcp.checkpoint(layer, torch.randn(2, 16), use_reentrant=False)
                with manager.backward():
                    y.sum().backward()
            assert spy.casts_of(layer.weight) == step + 1
            opt.step()
            manager.step()

    def test_key(self, manager):
        """A cast is reused only for the same tensor, unmodified, in the same scale epoch."""
        h = manager.register("w", roles=(W,))
        w = torch.randn(8, 8)
        spy = _watch(manager)
        with manager.forward():
            h.quantize(w, W)
            h.quantize(w, W)  # same tensor, same version, same epoch: a hit
        assert spy.casts_of(w) == 1
        w.add_(1.0)  # new version
        with manager.forward():
            h.quantize(w, W)
        assert spy.casts_of(w) == 2
        manager.step()  # new epoch
        with manager.forward():
            h.quantize(w, W)
        assert spy.casts_of(w) == 3
        with manager.forward():  # a different tensor with equal values is not a hit
            h.quantize(w.clone(), W)
        assert spy.casts_of(w) == 3 and len(spy.requests) == 4

    def test_in_place_edit_between_microbatches(self, manager):
        """An in-place weight change mid-step is seen: the next cast is fresh and correct."""
        layer, spy = self._setup(manager)
        x = torch.randn(2, 16)
        with manager.forward():
            y1 = layer(x)
        with torch.no_grad():
            layer.weight.mul_(2)
        with manager.forward():
            y2 = layer(x)
        assert spy.casts_of(layer.weight) == 2 and not torch.equal(y1, y2)

    def test_module_load_state_dict(self, manager):
        """Loading module weights invalidates the cast."""
        layer, spy = self._setup(manager)
        with manager.forward():
            layer(torch.randn(2, 16))
        layer.load_state_dict({k: v * 3 for k, v in layer.state_dict().items()})
        with manager.forward():
            layer(torch.randn(2, 16))
        assert spy.casts_of(layer.weight) == 2

    def test_manager_load_state_dict(self, recipe, backend):
        """Loading scaling state (new scales) invalidates a cast made in the same epoch: the next
        training forward casts the weight again, with the loaded scales, exactly as a fresh
        manager that loaded the same state does."""
        torch.manual_seed(0)
        manager = ss.ScalingStateManager(recipe, backend=backend)
        layer, spy = self._setup(manager)
        x = torch.randn(2, 16)
        with manager.forward():
            layer(x)
        manager.step()
        sd = manager.state_dict()
        for scale in (4.0, 16.0):  # the scales move on from the saved ones
            with manager.forward():
                layer(x * scale)
            manager.step()
        with torch.no_grad():
            layer(x)  # evaluation: a cast of this epoch, cached, recording nothing
        casts = spy.casts_of(layer.weight)
        manager.load_state_dict(sd)
        with manager.forward():
            y = layer(x)
        assert spy.casts_of(layer.weight) == casts + 1
        fresh = ss.ScalingStateManager(recipe, backend=backend)
        twin = ss.nn.Linear(16, 8, manager=fresh, name="fc")
        twin.load_state_dict(layer.state_dict())
        fresh.load_state_dict(sd)
        with fresh.forward():
            want = twin(x)
        assert torch.equal(y, want)
        assert_same(manager.state_dict(), fresh.state_dict(), name="state")

    def test_data_edits_need_invalidate(self, manager):
        """Edits through .data bypass the version counter; invalidate_casts() covers them."""
        layer, spy = self._setup(manager)
        with manager.forward():
            layer(torch.randn(2, 16))
        layer.weight.data.mul_(2)
        manager.invalidate_casts()
        with manager.forward():
            layer(torch.randn(2, 16))
        assert spy.casts_of(layer.weight) == 2

    def test_handle_invalidate_drops_only_its_own_cast(self, manager):
        """handle.invalidate_casts() recasts that handle's weight; other handles keep theirs."""
        layer, spy = self._setup(manager)
        other = ss.nn.Linear(16, 4, manager=manager, name="other")
        x = torch.randn(2, 16)
        with manager.forward():
            layer(x)
            other(x)
        before = other.handle.quantize(other.weight, ss.Role.WEIGHT)
        layer.weight.data.mul_(2)
        layer.handle.invalidate_casts()
        with manager.forward():
            layer(x)
        assert spy.casts_of(layer.weight) == 2
        again = other.handle.quantize(other.weight, ss.Role.WEIGHT)
        assert again.data is before.data  # still the cached cast

    def test_hit_records_like_a_fresh_cast(self, manager):
        """A weight cast made in evaluation still leaves the training step's weight amax complete."""
        layer, spy = self._setup(manager)
        with torch.no_grad():
            layer(torch.randn(2, 16))  # evaluation: records nothing
        assert _weight_amax(manager, "fc") == 0.0
        with manager.forward():
            layer(torch.randn(2, 16))  # cache hit in training
        assert spy.casts_of(layer.weight) == 1
        assert _weight_amax(manager, "fc") == layer.weight.abs().max().item()

    def test_new_tensor_at_same_address_is_not_a_hit(self, manager):
        """A freed weight's address reused by a new tensor never hits the cache."""
        h = manager.register("w", roles=(W,))
        with manager.forward():  # 2-d: block recipes cast weights in block x block blocks
            a = h.quantize(torch.full((8, 8), 1.0), W).dequantize()
            b = h.quantize(torch.full((8, 8), 3.0), W).dequantize()
        assert a[0, 0].item() == 1.0 and b[0, 0].item() == 3.0

    def test_transposed_request_is_not_served_without_the_copy(self, delayed):
        """A cached cast without a transposed copy does not serve a request that needs one."""
        h = delayed.register("w", roles=(W,))
        w = torch.randn(4, 6)
        spy = _watch(delayed)
        with delayed.forward():
            assert h.quantize(w, W).transposed is None
            q = h.quantize(w, W, transpose=True)
            assert h.quantize(w, W, transpose=True) is q
            plain = h.quantize(w, W)  # served by the same cast, as asked for: one orientation
            assert plain.data is q.data and plain.transposed is None
        assert spy.casts_of(w) == 2 and q.transposed is not None

    def test_inference_tensors_are_cast_uncached(self, delayed):
        """A weight created under inference_mode (no version counter) is cast every time."""
        with torch.inference_mode():
            w = torch.randn(4, 4)
        h = delayed.register("w", roles=(W,))
        spy = _watch(delayed)
        with delayed.forward():
            h.quantize(w, W)
            h.quantize(w, W)
        assert spy.casts_of(w) == 2

    def test_step_voids_casts_by_epoch_without_sweeping(self, delayed):
        """step() leaves the cached casts where they are (void by their epoch: its cost does not grow with
        them); a stale cast is never served, and the weight's next cast releases it."""
        import gc
        import weakref

        manager = delayed
        layer = ss.nn.Linear(16, 8, manager=manager, name="fc")
        spy = _watch(manager)
        with manager.forward():
            layer(torch.randn(2, 16))
        first = weakref.ref(spy.results[-1].data)  # the weight's cast (the input's came before it)
        assert spy.requests[-1].x.data_ptr() == layer.weight.data_ptr()
        spy.results.clear()
        manager.step()
        gc.collect()
        assert first() is not None  # kept by the cache, void by its epoch
        with manager.forward():
            layer(torch.randn(2, 16))
        assert spy.casts_of(layer.weight) == 2  # not served after the step: cast again
        spy.results.clear()
        gc.collect()
        assert first() is None  # the new cast replaced it
