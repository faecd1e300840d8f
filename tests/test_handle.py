"""scalestate.handle: what a module holds."""

from __future__ import annotations

import pytest
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
        # 448 / 2, rounded down to a power of two where the recipe rounds (block, MX); NVFP4: 448 * 6 / 2
        if isinstance(manager.recipe, ss.NVFP4Scaling):
            assert h.scale(I).item() == 1344.0
        else:
            assert h.scale(I).item() == (128.0 if manager.recipe.power_of_2 else 224.0)

    def test_quantize_builds_no_graph(self, delayed):
        """Casting a tensor that requires grad records no autograd history."""
        h = delayed.register("fc", roles=(I,))
        q = h.quantize(torch.randn(4, requires_grad=True), I)
        assert q.data.grad_fn is None and q.scale_inv.grad_fn is None


PER_TENSOR = {"delayed": ss.DelayedScaling(history_len=4), "current": ss.CurrentScaling()}


def _shards_manager(recipe: str, backend: str, **kw: object) -> ss.ScalingStateManager:
    return ss.ScalingStateManager(PER_TENSOR[recipe], backend=backend, group=None, collect_stats=True, **kw)


def _step_data(step: int) -> torch.Tensor:
    """A (6, 8) tensor whose range grows every step, its largest value in the second half of the rows."""
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(step)) * (1 + step)
    x[4, 3] = 9.0 * (1 + step)
    return x


@pytest.mark.parametrize("backend", ["emulation", "scaled_mm"])
@pytest.mark.parametrize("recipe", sorted(PER_TENSOR))
class TestShardCasts:
    """quantize(shard, role, amax=...): a shard is cast, recorded and counted as a part of the whole tensor."""

    def test_shards_cast_as_the_whole(self, recipe, backend):
        """Rows cast in two shards with the whole amax: the whole cast's data, scales, state and stats, bitwise."""
        whole_m, shard_m = _shards_manager(recipe, backend), _shards_manager(recipe, backend)
        a, b = whole_m.register("fc"), shard_m.register("fc")
        for step in range(4):
            x = _step_data(step)
            amax = torch.linalg.vector_norm(x, float("inf"))
            with whole_m.forward(), shard_m.forward():
                for role in (I, W, G):
                    q = a.quantize(x, role)
                    parts = [b.quantize(part, role, amax=amax) for part in x.split(3)]
                    assert torch.equal(torch.cat([p.data for p in parts]).view(torch.uint8), q.data.view(torch.uint8))
                    for p in parts:
                        assert torch.equal(p.scale, q.scale) and torch.equal(p.scale_inv, q.scale_inv)
            whole_m.step()
            shard_m.step()
            want, got = whole_m.state_dict(), shard_m.state_dict()
            for key in ("amax_history", "scale", "step_amax"):
                assert torch.equal(want[key], got[key]), key
            assert whole_m.stats().slots() == shard_m.stats().slots()
        assert shard_m.stats()["fc"][W].cast_elements == x.numel()  # both shards, once each
        assert not torch.equal(want["scale"], torch.ones_like(want["scale"]))  # the scales moved

    def test_lazy_amax_is_asked_for_only_just_in_time(self, recipe, backend):
        """A function amax is called only for a just-in-time scale; otherwise the shard's own amax is recorded."""
        m = _shards_manager(recipe, backend)
        h = m.register("fc", roles=(I,))
        calls: list[int] = []
        shard = torch.full((2, 4), 3.0)

        def whole() -> torch.Tensor:
            calls.append(m.iteration)
            return torch.tensor(6.0)

        recorded = []
        for _ in range(3):
            with m.forward():
                h.quantize(shard, I, amax=whole)
            recorded.append(m.state_dict()["step_amax"][0].item())
            m.step()
        if recipe == "delayed":  # just in time before the first step only
            assert calls == [0] and recorded == [6.0, 3.0, 3.0]
        else:
            assert calls == [0, 1, 2] and recorded == [6.0, 6.0, 6.0]

    def test_nan_in_another_shard(self, recipe, backend):
        """A NaN whole amax is recorded as NaN and scales the shard as the whole tensor's cast does."""
        x = _step_data(0)
        x[5, 0] = float("nan")
        whole_m, shard_m = _shards_manager(recipe, backend), _shards_manager(recipe, backend)
        a, b = whole_m.register("fc", roles=(I,)), shard_m.register("fc", roles=(I,))
        with whole_m.forward(), shard_m.forward():
            q = a.quantize(x, I)
            p = b.quantize(x[:3], I, amax=torch.tensor(float("nan")))
        assert torch.equal(p.data.view(torch.uint8), q.data[:3].view(torch.uint8)) and torch.equal(p.scale, q.scale)
        assert torch.isnan(shard_m.state_dict()["step_amax"][0])

    def test_ahead_of_use(self, recipe, backend):
        """A weight cast ahead of its use records and counts nothing; each use (a cache hit) records and counts once."""
        m = _shards_manager(recipe, backend)
        h = m.register("fc", roles=(W,))
        w = _step_data(1)
        amax = torch.linalg.vector_norm(w, float("inf"))
        with m.forward():
            ahead = h.quantize(w, W, amax=amax, ahead_of_use=True)
            assert m.state_dict()["step_amax"][0].item() == 0.0
            uses = [h.quantize(w, W, amax=amax) for _ in range(2)]
        assert all(u is ahead for u in uses)  # cache hits: the very cast made ahead
        assert m.state_dict()["step_amax"][0].item() == amax.item()
        m.step()
        assert m.stats()["fc"][W].cast_elements == 2 * w.numel()
        with m.forward():
            h.quantize(w, W, amax=amax, ahead_of_use=True)
        m.step()
        counted = m.stats()["fc"][W]  # a step with only a cast ahead of use recorded nothing
        assert counted.cast_elements == 0 and counted.saturated_fraction is None
        assert m.state_dict()["amax_history"][0].count_nonzero() == 1


class TestShardCastErrors:
    """What quantize(..., amax=...) refuses, with what to do."""

    @pytest.mark.parametrize(
        ("kwargs", "error", "words"),
        [
            ({"shard_group": object()}, ss.errors.ArgumentValueError, "shard_group= was given without amax="),
            ({"amax": 3.0}, ss.errors.ArgumentTypeError, "amax must be a tensor"),
            ({"amax": torch.ones(2)}, ss.errors.CastError, "amax must be one floating-point value"),
            ({"amax": torch.tensor(3)}, ss.errors.CastError, "amax must be one floating-point value"),
            ({"amax": lambda: torch.ones(2)}, ss.errors.CastError, "amax must be one floating-point value"),
            ({"amax": torch.tensor(3.0, device="meta")}, ss.errors.CastError, "amax is on meta"),
            ({"amax": torch.tensor(3.0), "ahead_of_use": 1}, ss.errors.ArgumentTypeError, "ahead_of_use must be"),
        ],
    )
    def test_bad_arguments(self, delayed, kwargs, error, words):
        """Each error names what was wrong."""
        h = delayed.register("fc", roles=(I,))
        with pytest.raises(error, match=words):
            h.quantize(torch.ones(2, 2), I, **kwargs)

    def test_fine_grained_recipe(self):
        """A shard would split the rows, tiles or blocks of a fine-grained recipe."""
        m = ss.ScalingStateManager(ss.RowwiseScaling(), backend="emulation", group=None)
        h = m.register("fc", roles=(I,))
        with pytest.raises(ss.errors.CastError, match="needs per-tensor scales"):
            h.quantize(torch.ones(2, 2), I, amax=torch.tensor(1.0))
