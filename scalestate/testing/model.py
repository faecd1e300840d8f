"""A small decoder-only transformer language model, built from plain ``torch.nn``.

Its ``torch.nn.Linear`` layers are what :func:`scalestate.nn.convert` turns
into FP8; everything else (embeddings, layer norms, attention softmax) stays
in high precision, as in FP8 training at scale. ``scalestate demo`` trains
it, the benchmarks measure it, and the library's parity tests run its
:class:`Block`: a model small enough for a CPU that still has every kind of
layer an FP8 transformer has.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor, nn

from scalestate.errors import ArgumentValueError

__all__ = ["Block", "TinyLM"]


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a GELU MLP.

    Four ``torch.nn.Linear`` layers (``qkv``, ``proj``, ``fc1``, ``fc2``) between
    layer norms, attention and residuals; it maps ``[batch, seq, d_model]`` to
    the same shape.

    Example:
        >>> import torch, scalestate as ss
        >>> from scalestate.testing import Block
        >>> manager = ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation")
        >>> block = ss.nn.convert(Block(32, n_heads=2), manager)
        >>> block(torch.randn(2, 8, 32)).shape, len(manager.handles)
        (torch.Size([2, 8, 32]), 4)
    """

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, 4 * d_model)
        self.fc2 = nn.Linear(4 * d_model, d_model)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.reshape(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        out: Tensor = x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
        return out


class TinyLM(nn.Module):
    """Byte-level language model: embeddings, ``n_layers`` blocks, a linear head.

    Args:
        vocab: token ids are ``0 .. vocab - 1`` (256: bytes).
        d_model: width of every block (a multiple of ``n_heads``).
        n_layers: number of :class:`Block` s.
        n_heads: attention heads per block.
        seq_len: the longest sequence (positions are learned).
        checkpoint: recompute each block in backward
            (``torch.utils.checkpoint``, non-reentrant) instead of keeping
            its activations.

    Example:
        >>> import torch, scalestate as ss
        >>> from scalestate.testing import TinyLM
        >>> manager = ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation")
        >>> model = ss.nn.convert(TinyLM(d_model=32, n_layers=2, n_heads=2, seq_len=16), manager)
        >>> tokens = torch.randint(0, 256, (2, 17))
        >>> with manager.forward():
        ...     loss = model.loss(tokens)
        >>> with manager.backward():
        ...     loss.backward()
        >>> manager.step()
        >>> len(manager.handles)  # four layers per block, and the head
        9
    """

    def __init__(
        self,
        *,
        vocab: int = 256,
        d_model: int = 128,
        n_layers: int = 4,
        n_heads: int = 4,
        seq_len: int = 64,
        checkpoint: bool = False,
    ) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ArgumentValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads})")
        self.checkpoint = checkpoint
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, tokens: Tensor) -> Tensor:
        """Logits ``[batch, seq, vocab]`` for each next token."""
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            if self.checkpoint and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        logits: Tensor = self.head(self.ln(x))
        return logits

    def loss(self, batch: Tensor, forward: nn.Module | None = None) -> Tensor:
        """Mean next-token cross-entropy of ``batch`` (``[B, seq_len + 1]`` token ids).

        ``forward``: what computes the logits, if not the model itself (its
        ``DistributedDataParallel`` wrapper, say).
        """
        logits = (self if forward is None else forward)(batch[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
