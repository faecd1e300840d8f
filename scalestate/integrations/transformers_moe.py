"""Hugging Face mixture-of-experts: transformers' expert modules with FP8 grouped experts.

transformers 5 keeps a MoE layer's experts as two 3-d parameters, not as
``nn.Linear`` layers: ``gate_up_proj`` ``[E, 2 * I, H]`` (the gate and up
projections of every expert, gate first) and ``down_proj`` ``[E, H, I]``,
both in ``torch.nn.functional.linear``'s orientation, without biases. The
expert computes ``down(act(gate(x)) * up(x))``, and the routing weight
multiplies its output. :func:`scalestate.nn.convert` turns such a module into
an :class:`Experts`, which keeps the very parameter objects (so
``state_dict`` keys, shapes and optimizers are unchanged) and runs both
projections through :func:`scalestate.nn.grouped_linear`, one FP8 slot per
expert and projection: ``"<path>.gate_up_proj.<e>"`` and
``"<path>.down_proj.<e>"``.

Families converted (all share that layout and the same forward in
transformers 5): Mixtral, Qwen2-MoE, Qwen3-MoE, Qwen3-Next, OLMoE,
FlexOlmo, DeepSeek-V2, DeepSeek-V3, GraniteMoE, PhiMoE, Jamba, MiniMax,
ERNIE-4.5-MoE, GLM-4-MoE and HunYuan-MoE-V1 (see :data:`FAMILIES`). Not
converted: GPT-OSS (transposed ``[E, H, 2 * I]`` weights, interleaved gate
and up, biases and a clamped SwiGLU), Llama 4 (its experts are not
dispatched per expert but multiplied densely) and DBRX (another layout).
Their routers are left alone in every family: a router is a small product
whose output decides, through a top-k, which expert each token reaches, so an
FP8 rounding there changes routing discretely, and it costs a negligible
share of the layer's FLOPs.

Conversions are registered lazily: :func:`scalestate.nn.convert` registers a
family's experts as soon as the program has imported its modeling module,
without importing any itself.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import Tensor

from scalestate.errors import ConversionTypeError
from scalestate.manager import ScalingStateManager
from scalestate.nn.grouped import ExpertViews, grouped_linear, register_experts
from scalestate.nn.grouped_cast import sort_by_expert
from scalestate.nn.registry import ConversionRequest, register_conversion, registered_conversions

__all__ = ["FAMILIES", "Experts", "convert_experts", "register_loaded_families"]

#: The transformers model packages whose experts convert, with the expert class of each.
FAMILIES: dict[str, str] = {
    "mixtral": "MixtralExperts",
    "qwen2_moe": "Qwen2MoeExperts",
    "qwen3_moe": "Qwen3MoeExperts",
    "qwen3_next": "Qwen3NextExperts",
    "olmoe": "OlmoeExperts",
    "flex_olmo": "FlexOlmoExperts",
    "deepseek_v2": "DeepseekV2Experts",
    "deepseek_v3": "DeepseekV3Experts",
    "granitemoe": "GraniteMoeExperts",
    "phimoe": "PhimoeExperts",
    "jamba": "JambaExperts",
    "minimax": "MiniMaxExperts",
    "ernie4_5_moe": "Ernie4_5_MoeExperts",
    "glm4_moe": "Glm4MoeExperts",
    "hunyuan_v1_moe": "HunYuanMoEV1Experts",
}


class Experts(torch.nn.Module):
    """transformers' experts (concatenated gate and up, no bias) with every expert's products in FP8.

    Holds ``gate_up_proj`` ``[E, 2 * I, H]`` and ``down_proj`` ``[E, H, I]`` as
    transformers does, and ``act_fn``. ``forward(hidden_states, top_k_index,
    top_k_weights)`` computes what transformers' eager forward computes, with
    each projection of each expert cast by its own slots
    (``"<name>.gate_up_proj.<e>"``, ``"<name>.down_proj.<e>"``); experts that
    no token reaches cast and record nothing. Usually made by
    :func:`scalestate.nn.convert`.
    """

    def __init__(
        self,
        num_experts: int,
        hidden_dim: int,
        intermediate_dim: int,
        act_fn: Any,
        *,
        manager: ScalingStateManager,
        name: str,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.num_experts, self.hidden_dim, self.intermediate_dim = num_experts, hidden_dim, intermediate_dim
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        self.gate_up_proj = torch.nn.Parameter(torch.empty(num_experts, 2 * intermediate_dim, hidden_dim, **kw))
        self.down_proj = torch.nn.Parameter(torch.empty(num_experts, hidden_dim, intermediate_dim, **kw))
        self.act_fn = act_fn
        self.name = name
        self.gate_up_handles = register_experts(manager, f"{name}.gate_up_proj", num_experts)
        self.down_handles = register_experts(manager, f"{name}.down_proj", num_experts)
        self._views = (ExpertViews(), ExpertViews())

    def invalidate_casts(self) -> None:
        """Drop every expert's cached weight casts (after editing the weights through ``.data``)."""
        for views in self._views:
            views.clear()
        for handle in self.gate_up_handles + self.down_handles:
            handle.invalidate_casts()

    def __setattr__(self, name: str, value: Any) -> None:
        """As ``torch.nn.Module``'s; a new weight drops the experts' cached casts."""
        super().__setattr__(name, value)
        if name in ("gate_up_proj", "down_proj") and "_views" in self.__dict__:
            self.invalidate_casts()

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        """``sum_k w_k * down_e(act(gate_e(x)) * up_e(x))`` over each token's experts ``e``."""
        # Compiled code keeps the sizes on the device: one graph for every routing (no index is dropped there).
        order, tokens, sizes = sort_by_expert(top_k_index, self.num_experts, on_device=torch.compiler.is_compiling())
        x = hidden_states[tokens]
        h = grouped_linear(x, self.gate_up_proj, None, sizes, self.gate_up_handles, views=self._views[0])
        gate, up = h.chunk(2, dim=-1)
        h = self.act_fn(gate) * up
        y = grouped_linear(h, self.down_proj, None, sizes, self.down_handles, views=self._views[1])
        y = y * top_k_weights.reshape(-1)[order, None]
        out = torch.zeros_like(hidden_states)
        return out.index_add_(0, tokens, y.to(out.dtype))

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, hidden_dim={self.hidden_dim}, "
            f"intermediate_dim={self.intermediate_dim}, slots={self.name}.{{gate_up_proj,down_proj}}.<e>"
        )


def convert_experts(module: torch.nn.Module, request: ConversionRequest) -> Experts:
    """The conversion :func:`scalestate.nn.convert` applies to transformers' experts of the layout above.

    Register it for another experts class of that layout with
    ``ss.nn.register_conversion(TheirExperts, convert_experts)``.

    Raises:
        ConversionTypeError: the module has another layout (transposed,
            interleaved, with biases, without gate, expert-parallel), or
            ``fp8_all_gather=True`` was asked for.
    """
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    flags = {
        "has_bias": False, "is_transposed": False, "is_concatenated": True, "has_gate": True,
        "has_post_expert_norm": False, "_is_expert_parallel": False,
    }
    off = [flag for flag, want in flags.items() if getattr(module, flag, want) != want]
    if (
        not isinstance(gate_up, torch.nn.Parameter) or not isinstance(down, torch.nn.Parameter)
        or gate_up.dim() != 3 or down.dim() != 3
        or gate_up.shape[0] != down.shape[0] or gate_up.shape[1] != 2 * down.shape[2]
        or gate_up.shape[2] != down.shape[1] or off
    ):
        raise ConversionTypeError(
            f"convert_experts converts experts holding gate_up_proj [E, 2*I, H] and down_proj [E, H, I] "
            f"(concatenated gate and up, no bias, not transposed, not expert-parallel); {type(module).__name__} "
            f"differs{f' ({off})' if off else ''}. Leave it out with filter_fn"
        )
    if request.fp8_all_gather:
        raise ConversionTypeError(
            "convert_experts: fp8_all_gather=True is not supported for grouped experts; convert with "
            "fp8_all_gather=False (FSDP2 then gathers the high-precision expert weights)"
        )
    n, hidden, inter = down.shape
    new = Experts(
        n, hidden, inter, getattr(module, "act_fn", None), manager=request.manager, name=request.name, device="meta"
    )
    new.gate_up_proj, new.down_proj = gate_up, down  # the same parameter objects
    config = getattr(module, "config", None)
    if config is not None:
        new.config = config
    new.train(module.training)
    return new


_registered: set[str] = set()


def register_loaded_families() -> None:
    """Register :func:`convert_experts` for every family of :data:`FAMILIES` whose modeling module the
    program has imported (unless a conversion of its class is registered already); imports nothing."""
    for family, class_name in FAMILIES.items():
        module = sys.modules.get(f"transformers.models.{family}.modeling_{family}")
        if family in _registered or module is None:
            continue
        experts = getattr(module, class_name, None)
        _registered.add(family)
        if isinstance(experts, type) and experts not in registered_conversions():
            register_conversion(experts, convert_experts)


register_loaded_families()
