"""The randomness of NVFP4 casts, as manager state: a seed, the RHT signs drawn from it, and counters.

Nothing here draws from torch's generators. Random Hadamard transform signs
come from the seed (:func:`scalestate.nvfp4.rht_signs`); each stochastically
rounded cast gets the key :meth:`Randomness.sr_key` derives from the seed,
the slot, the iteration and the cast's ordinal among that slot's casts in the
step, all held as tensors so that compiled code reads them without a guard.
A recompute never casts a gradient, so it cannot consume or shift a draw; a
load restores the seed, the signs, the iteration and the ordinals, so a
resumed run draws what the uninterrupted one would have.
"""

from __future__ import annotations

import torch
from torch import Tensor

from scalestate.nvfp4 import rht_signs, seed_key, slot_key, stream_key

__all__ = ["Randomness"]


class Randomness:
    """One manager's seed, RHT signs, iteration tensor, per-row slot keys and ordinals.

    ``counting``: whether any cast draws (stochastic rounding); without it no
    per-row key or ordinal is kept and the iteration tensor is not kept up (they
    would cost operations at every registration and step), and every ordinal is 0.
    """

    def __init__(self, device: torch.device, seed: int, *, counting: bool = False) -> None:
        self._device = device
        self._counting = counting
        self._seed = seed
        self._seed_key = torch.tensor(seed_key(seed), dtype=torch.int64, device=device)
        self._signs = rht_signs(seed, device)
        self._iteration = torch.zeros((), dtype=torch.int64, device=device)
        self._slot_keys = torch.zeros(0, dtype=torch.int64, device=device)
        self._ordinals = torch.zeros(0, dtype=torch.int64, device=device)

    @property
    def seed(self) -> int:
        """The seed of every draw."""
        return self._seed

    @property
    def signs(self) -> Tensor:
        """``[16]`` float32 signs of the random Hadamard transform (the state's own tensor)."""
        return self._signs

    def ordinals(self, n: int) -> Tensor:
        """``[n]`` int64 view: stochastically rounded casts of each row so far in this step (zeros without draws)."""
        if not self._counting:  # zeros, or what a load gave (kept as it was: it draws nothing here)
            held = self._ordinals[:n]
            if held.numel() == n:
                return held
            return torch.cat([held, torch.zeros(n - held.numel(), dtype=torch.int64, device=self._device)])
        return self._ordinals[:n]

    def grow(self, capacity: int, n: int) -> None:
        """Room for ``capacity`` rows, keeping the first ``n``."""
        if not self._counting:
            return
        keys = torch.zeros(capacity, dtype=torch.int64, device=self._device)
        ordinals = torch.zeros(capacity, dtype=torch.int64, device=self._device)
        keys[:n], ordinals[:n] = self._slot_keys[:n], self._ordinals[:n]
        self._slot_keys, self._ordinals = keys, ordinals

    def add(self, row: int, name: str, role: str) -> None:
        """Row ``row`` is the slot ``(name, role)``: its key is the same in every process."""
        if self._counting:
            self._slot_keys[row] = slot_key(name, role)

    def to(self, device: torch.device) -> None:
        """Move every tensor to ``device``."""
        self._device = device
        self._seed_key, self._signs = self._seed_key.to(device), self._signs.to(device)
        self._iteration = self._iteration.to(device)
        self._slot_keys, self._ordinals = self._slot_keys.to(device), self._ordinals.to(device)

    def sr_key(self, row: int) -> Tensor:
        """The 0-d int64 key of row ``row``'s next stochastically rounded cast; counts the cast.

        ``stream_key(seed_key, slot_key, lo(iteration), hi(iteration), ordinal)``
        (see :mod:`scalestate.nvfp4`), computed on the device.
        """
        it = self._iteration
        ordinal = self._ordinals[row]
        key = stream_key(self._seed_key, self._slot_keys[row], it & 0xFFFFFFFF, it >> 32, ordinal)
        ordinal.add_(1)
        assert isinstance(key, Tensor)
        return key

    def sr_keys(self, rows: Tensor, counted: Tensor) -> Tensor:
        """``[G]`` keys of the next stochastically rounded casts of ``rows`` (an int64 index tensor), each
        :meth:`sr_key`'s; counts a cast for the rows where ``counted`` (a ``[G]`` bool tensor) only."""
        it = self._iteration
        key = stream_key(self._seed_key, self._slot_keys[rows], it & 0xFFFFFFFF, it >> 32, self._ordinals[rows])
        self._ordinals.index_add_(0, rows, counted.to(torch.int64))
        assert isinstance(key, Tensor)
        return key

    def set_seed(self, seed: int, signs: Tensor | None = None) -> None:
        """Make ``seed`` the one drawn from (and ``signs`` as loaded, or those drawn from it), in place."""
        self._seed = seed
        self._seed_key.fill_(seed_key(seed))
        self._signs.copy_(rht_signs(seed, self._device) if signs is None else signs)

    def end_step(self) -> None:
        """A step ended: the next iteration, no cast drawn in it yet."""
        if self._counting:
            self._iteration.add_(1)
            self._ordinals.zero_()

    def discard(self) -> None:
        """The step's draws are forgotten, as its casts are."""
        if self._counting:
            self._ordinals.zero_()

    def load(self, iteration: int, ordinals: Tensor | None, n: int) -> None:
        """The iteration and the first ``n`` rows' ordinals as loaded (zeros when not saved)."""
        self._iteration.fill_(iteration)
        if not self._counting:
            zeros = torch.zeros(n, dtype=torch.int64, device=self._device)
            self._ordinals = zeros if ordinals is None else ordinals.clone()
            return
        if ordinals is None:
            self._ordinals.zero_()
        else:
            self._ordinals[:n].copy_(ordinals)
