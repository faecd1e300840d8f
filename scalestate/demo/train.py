"""The demo's training runs: fp32 reference, FP8 with and without checkpointing."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any, Literal, get_args

import attrs
import torch
import torch.distributed as dist
from torch import Tensor

import scalestate as ss
from scalestate.demo.data import batches, corpus, encode
from scalestate.demo.progress import Progress
from scalestate.errors import ArgumentValueError
from scalestate.testing import TinyLM

__all__ = ["RECIPE_NAMES", "DemoConfig", "RecipeName", "RunResult", "high_precision_ends", "train"]

#: What ``scalestate demo --recipe`` takes.
RecipeName = Literal["delayed", "current", "rowwise", "block", "mxfp8", "nvfp4"]
RECIPE_NAMES: tuple[str, ...] = get_args(RecipeName)
#: Tile edge of ``BlockScaling`` at full size (DeepSeek-V3's).
FULL_BLOCK = 128


@attrs.frozen
class DemoConfig:
    """Everything a demo run depends on; two runs of one config are bitwise identical."""

    #: Optimizer steps.
    steps: int = 100
    #: Microbatches per step (gradient accumulation).
    microbatches: int = 4
    #: Sequences per microbatch.
    microbatch_size: int = 8
    #: Tokens per sequence.
    seq_len: int = 64
    #: Model width, depth and attention heads.
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    #: Peak learning rate of AdamW (linear warmup over the first 10% of steps).
    lr: float = 3e-3
    #: Seed of initialisation and data order.
    seed: int = 0
    #: scalestate backend of the FP8 runs.
    backend: str = "emulation"
    #: The FP8 recipe: ``"delayed"`` or ``"current"`` (one scale per tensor),
    #: ``"rowwise"``, ``"block"`` or ``"mxfp8"`` (fine-grained, just in time), or
    #: ``"nvfp4"`` (4-bit; the first block and the head stay in high precision).
    recipe: RecipeName = "delayed"
    #: Amax history length of delayed scaling.
    history_len: int = 16
    #: Tile and weight-block edge of ``"block"``; ``None``: :meth:`block_size` picks it.
    block: int | None = None
    #: Mixture of experts: every block's MLP is this many experts (0: a dense MLP), each
    #: token routed to ``top_k`` of them (see :class:`scalestate.testing.MoE`).
    moe_experts: int = 0
    top_k: int = 2

    def moe(self) -> tuple[int, int] | None:
        """``(experts, top_k)`` of the model's MoE blocks, or ``None`` for dense ones."""
        return (self.moe_experts, self.top_k) if self.moe_experts else None

    def block_size(self) -> int:
        """The block of ``"block"``: ``block`` if given, else 128, or the largest power
        of two ``<= d_model`` where that is smaller, so that every weight of the
        demo model spans at least one whole ``block x block`` block."""
        if self.block is not None:
            return self.block
        return min(FULL_BLOCK, 1 << (max(self.d_model, 1).bit_length() - 1))

    def make_recipe(self) -> ss.Recipe:
        """The scalestate recipe of the FP8 runs (the fine-grained ones with their defaults:
        E4M3 everywhere; power-of-two scales for blocks and MX, exact ones for rows)."""
        if self.recipe == "current":
            return ss.CurrentScaling()
        if self.recipe == "rowwise":
            return ss.RowwiseScaling()
        if self.recipe == "block":
            return ss.BlockScaling(block=self.block_size())
        if self.recipe == "mxfp8":
            return ss.MXFP8Scaling()
        if self.recipe == "nvfp4":
            return ss.NVFP4Scaling()
        if self.recipe == "delayed":
            return ss.DelayedScaling(history_len=self.history_len)
        raise ArgumentValueError(f"recipe must be one of {', '.join(RECIPE_NAMES)}; got {self.recipe!r}")


@attrs.frozen(eq=False)
class RunResult:
    """What one run produced."""

    label: str
    losses: list[float]
    val_loss: float
    seconds: float
    params: dict[str, Tensor]
    #: ``ScalingStateManager.state_dict()`` after the last step (FP8 runs).
    scaling: dict[str, Any] | None
    #: Data-parallel runs: whether every rank ended with bitwise the same
    #: ``"scaling state"`` and ``"parameters"`` as rank 0 (``None``: one process).
    across_ranks: dict[str, bool] | None = None


def data_parallel() -> tuple[int, int]:
    """``(rank, world size)`` of the default process group, ``(0, 1)`` without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def train(
    cfg: DemoConfig,
    *,
    fp8: bool,
    checkpoint: bool,
    label: str,
    text: str | None = None,
    show_progress: bool = True,
) -> RunResult:
    """Train one model from scratch on ``text`` (default: :func:`corpus`), 95/5 split,
    and evaluate it on the held-out part.

    Where the default process group has several ranks, the model is wrapped in
    ``DistributedDataParallel`` (gradients synchronised on the last microbatch
    of each step only), every rank draws its own batches, the manager reduces
    its amaxes over the group, and the result says whether every rank ended
    with the same scaling state and parameters. Losses are rank 0's.
    """
    rank, world = data_parallel()
    tokens = encode(corpus() if text is None else text)
    cut = int(tokens.numel() * 0.95)
    train_tokens, val_tokens = tokens[:cut], tokens[cut:]
    torch.manual_seed(cfg.seed)
    model = TinyLM(
        d_model=cfg.d_model, n_layers=cfg.n_layers, n_heads=cfg.n_heads,
        seq_len=cfg.seq_len, checkpoint=checkpoint, moe=cfg.moe(),
    )
    manager = None
    if fp8:
        recipe = cfg.make_recipe()
        manager = ss.ScalingStateManager(recipe, backend=cfg.backend, device="cpu")
        keep = high_precision_ends(cfg.n_layers) if isinstance(recipe, ss.NVFP4Scaling) else None
        ss.nn.convert(model, manager, filter_fn=keep)
    net: torch.nn.Module = model
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel

        net = DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)
    warmup = max(1, cfg.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / warmup))
    data = batches(
        train_tokens, steps=cfg.steps, batch=cfg.microbatches * cfg.microbatch_size,
        seq_len=cfg.seq_len, seed=cfg.seed + 1 + 1000 * rank,
    )
    progress = Progress(label, cfg.steps) if show_progress and rank == 0 else None
    losses: list[float] = []
    start = time.perf_counter()
    with progress if progress is not None else contextlib.nullcontext():
        for step_batch in data:
            total = 0.0
            chunks = step_batch.chunk(cfg.microbatches)
            for i, mb in enumerate(chunks):
                no_sync = getattr(net, "no_sync", None)
                accumulate = no_sync() if no_sync is not None and i < len(chunks) - 1 else contextlib.nullcontext()
                with accumulate:
                    with manager.forward() if manager else contextlib.nullcontext():
                        loss = model.loss(mb, forward=net) / cfg.microbatches
                    with manager.backward() if manager else contextlib.nullcontext():
                        torch.autograd.backward(loss)
                total += loss.item()
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            if manager:
                manager.step()
            losses.append(total)
            if progress is not None:
                progress.update(total)
    seconds = time.perf_counter() - start
    val_loss = _evaluate(model, cfg, val_tokens)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    scaling = manager.state_dict() if manager else None
    return RunResult(
        label=label,
        losses=losses,
        val_loss=val_loss,
        seconds=seconds,
        params=params,
        scaling=scaling,
        across_ranks=_agreement(params, scaling) if world > 1 else None,
    )


def high_precision_ends(n_layers: int) -> Callable[[str, torch.nn.Module], bool]:
    """The demo's ``filter_fn`` for NVFP4: every layer but the first block's and the head.

    NVIDIA's NVFP4 recipe keeps the first and the last layers of the network in
    high precision (they are the most sensitive to quantization and a small part
    of the compute). The demo keeps the output head and, in a model of more than
    one block, the first block (of one block, that would leave nothing in NVFP4).

    Example:
        >>> keep = high_precision_ends(4)
        >>> [keep(p, None) for p in ("blocks.0.qkv", "blocks.1.qkv", "head")]
        [False, True, False]
    """

    def convert(path: str, module: torch.nn.Module) -> bool:
        return path != "head" and not (n_layers > 1 and path.startswith("blocks.0."))

    return convert


def _agreement(params: dict[str, Tensor], scaling: dict[str, Any] | None) -> dict[str, bool]:
    """Whether every rank holds bitwise rank 0's scaling state and parameters (same answer on every rank)."""
    mine = {"params": params, "scaling": scaling}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    first = everyone[0]
    same_params = all(
        r["params"].keys() == first["params"].keys()
        and all(torch.equal(r["params"][k], first["params"][k]) for k in first["params"])
        for r in everyone
    )
    out = {"parameters": same_params}
    if scaling is not None:
        out["scaling state"] = all(
            r["scaling"]["slots"] == first["scaling"]["slots"]
            and all(torch.equal(r["scaling"][k], first["scaling"][k]) for k in ("amax_history", "scale"))
            for r in everyone
        )
    return out


@torch.no_grad()
def _evaluate(model: TinyLM, cfg: DemoConfig, val_tokens: Tensor) -> float:
    """Mean loss on held-out text; an evaluation pass, so FP8 records nothing."""
    model.eval()
    val = batches(val_tokens, steps=4, batch=16, seq_len=cfg.seq_len, seed=cfg.seed + 2)
    val_loss = sum(model.loss(b).item() for b in val) / len(val)
    model.train()
    return val_loss
