"""A small decoder-only transformer language model, built from plain ``torch.nn``.

Its ``torch.nn.Linear`` layers are what :func:`scalestate.nn.convert` turns
into FP8; everything else (embeddings, layer norms, attention softmax) stays
in high precision, as in FP8 training at scale. ``scalestate demo`` trains
it, the benchmarks measure it, and the library's parity tests run its
:class:`Block`: a model small enough for a CPU that still has every kind of
layer an FP8 transformer has.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor, nn

from scalestate.errors import ArgumentValueError, ConversionTypeError
from scalestate.nn.registry import ConversionRequest, register_conversion, registered_conversions

__all__ = ["Block", "Experts", "MoE", "TinyLM"]


class Experts(nn.Module):
    """``num_experts`` linear layers in one ``[E, out, in]`` weight, in high precision, without bias.

    ``forward(x, group_sizes)``: the tokens ordered by expert, each expert's
    product on its own. :func:`scalestate.nn.convert` turns it into an
    :class:`scalestate.nn.GroupedLinear` on the same weight (importing this
    module registers the conversion), each expert a slot ``"<path>.<e>"``.
    """

    def __init__(self, num_experts: int, in_features: int, out_features: int) -> None:
        super().__init__()
        self.num_experts, self.in_features, self.out_features = num_experts, in_features, out_features
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features))
        with torch.no_grad():
            for e in range(num_experts):  # each expert as torch.nn.Linear initializes its weight
                nn.init.kaiming_uniform_(self.weight[e], a=math.sqrt(5))

    def forward(self, x: Tensor, group_sizes: Tensor | list[int]) -> Tensor:
        sizes = group_sizes.tolist() if isinstance(group_sizes, Tensor) else list(group_sizes)
        parts = x.split(sizes)  # type: ignore[no-untyped-call]  # torch leaves Tensor.split untyped
        return torch.cat([F.linear(p, w) for p, w in zip(parts, self.weight, strict=True)])


class MoE(nn.Module):
    """A top-k mixture of GELU MLP experts: ``sum_k w_k * down_e(gelu(up_e(x)))``.

    The router is a bare ``[E, d_model]`` weight (softmax over the experts,
    the top ``top_k`` renormalized), so :func:`scalestate.nn.convert` leaves it
    in high precision: its output picks experts discretely. ``up`` and ``down``
    are :class:`Experts`, which convert to FP8 grouped layers.
    """

    def __init__(self, d_model: int, d_ff: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ArgumentValueError(f"top_k must be in 1 .. num_experts ({num_experts}); got {top_k}")
        self.num_experts, self.top_k = num_experts, top_k
        self.router = nn.Parameter(torch.empty(num_experts, d_model))
        nn.init.kaiming_uniform_(self.router, a=math.sqrt(5))
        self.up = Experts(num_experts, d_model, d_ff)
        self.down = Experts(num_experts, d_ff, d_model)

    def forward(self, x: Tensor) -> Tensor:
        from scalestate.nn.grouped_cast import sort_by_expert

        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs = F.linear(x, self.router).softmax(dim=-1)
        weights, index = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        # One host read, for both layers; none in compiled code (one graph for every routing).
        order, tokens, counts = sort_by_expert(index, self.num_experts, on_device=torch.compiler.is_compiling())
        y = self.down(F.gelu(self.up(x[tokens], counts)), counts) * weights.reshape(-1)[order, None]
        return torch.zeros_like(x).index_add_(0, tokens, y.to(x.dtype)).reshape(shape)


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a GELU MLP.

    Four ``torch.nn.Linear`` layers (``qkv``, ``proj``, ``fc1``, ``fc2``) between
    layer norms, attention and residuals; it maps ``[batch, seq, d_model]`` to
    the same shape. With ``moe=(num_experts, top_k)`` the MLP is a :class:`MoE`
    (``self.moe``, experts as wide as the MLP) instead of ``fc1`` and ``fc2``.

    Example:
        >>> import torch, scalestate as ss
        >>> from scalestate.testing import Block
        >>> manager = ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation")
        >>> block = ss.nn.convert(Block(32, n_heads=2), manager)
        >>> block(torch.randn(2, 8, 32)).shape, len(manager.handles)
        (torch.Size([2, 8, 32]), 4)
    """

    def __init__(self, d_model: int, n_heads: int, moe: tuple[int, int] | None = None) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        if moe is None:
            self.fc1 = nn.Linear(d_model, 4 * d_model)
            self.fc2 = nn.Linear(4 * d_model, d_model)
        else:
            self.moe = MoE(d_model, 4 * d_model, *moe)

    def _mlp(self, x: Tensor) -> Tensor:
        if hasattr(self, "moe"):
            out: Tensor = self.moe(x)
            return out
        result: Tensor = self.fc2(F.gelu(self.fc1(x)))
        return result

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.reshape(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self._mlp(self.ln2(x))


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
        moe: ``(num_experts, top_k)``: every block's MLP is a :class:`MoE`.

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
        moe: tuple[int, int] | None = None,
    ) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ArgumentValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads})")
        self.checkpoint = checkpoint
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, moe) for _ in range(n_layers))
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


def _convert_experts(module: nn.Module, request: ConversionRequest) -> nn.Module:
    """:class:`Experts` to an FP8 :class:`scalestate.nn.GroupedLinear` holding the same weight."""
    from scalestate.nn.grouped import GroupedLinear

    if not isinstance(module, Experts):
        raise ConversionTypeError(f"the Experts conversion got a {type(module).__name__}")
    new = GroupedLinear(
        module.num_experts, module.in_features, module.out_features, manager=request.manager, name=request.name,
        device="meta",
    )
    new.weight = module.weight
    new.train(module.training)
    return new


if Experts not in registered_conversions():
    register_conversion(Experts, _convert_experts)
