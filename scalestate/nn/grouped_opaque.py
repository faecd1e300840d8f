"""Compiled grouped layers through two opaque operators: one graph for every routing, any recipe.

:mod:`scalestate.nn.grouped_device` casts every expert at once, which gives
the bits of one cast per expert only where a cast's scales do not depend on
where the groups begin (per-tensor recipes), and multiplies through the
backend's own grouped products. Elsewhere (fine-grained recipes, whose blocks
along the tokens start at each expert's first token; backends whose grouped
products are not their own, such as ``scaled_mm`` on CUDA), compiled code
runs a grouped layer's experts inside two operators of its own,
``scalestate::grouped_experts_forward`` and
``scalestate::grouped_experts_backward``, opaque to the compiler: they read
the group ends on the host when they run and make, expert by expert, the
very casts and products eager code makes, through a backend rebuilt from its
description (the emulation and ``scaled_mm`` backends, not their subclasses,
which may cast or multiply otherwise). They return each expert's amaxes (``[E]`` tensors),
which the traced code records for the experts with tokens. The group sizes
stay on the device, one graph serves every routing, and the bits are
eager's: outputs, gradients, histories and scales.

The cost: the backward casts each expert's input and weight again (with the
forward's scales, so the same bits), so the input is kept for backward in
its own precision, not in FP8. NVFP4's randomness is the manager's, read in
the graph: the RHT signs, and each expert's stochastic-rounding key, counted
for the experts with tokens only, as eager counts its casts. With
``collect_stats``, the operators also count what each expert's casts did
(`scalestate._engine.counting.cast_counts`), added to the slots with tokens.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from scalestate._engine.counting import cast_counts
from scalestate.backends.base import HOST_READ_OP, Backend, CastRequest, CastSpec, group_spans, rows_then_zeros
from scalestate.errors import UnknownBackendError
from scalestate.granularity import Granularity, GranularityKind
from scalestate.math import ScaleRule
from scalestate.nn.function import backward_products, forward_product, saved_operands
from scalestate.quantized import Quantized

__all__ = [
    "OpaqueGroupedFunction",
    "describe_spec",
    "grouped_experts_backward",
    "grouped_experts_forward",
    "opaque_grouped_linear",
]


@functools.cache
def _backend(key: str) -> Backend:
    """The backend ``key`` describes (imported when first needed: importing scalestate loads no backend)."""
    if key == "emulation":
        from scalestate.backends.emulation import EmulationBackend

        return EmulationBackend()
    name, _, fallback = key.partition(":")
    if name != "scaled_mm" or fallback not in ("", "emulation"):
        raise UnknownBackendError(
            f"grouped experts: unknown backend description {key!r}; expected 'emulation', 'scaled_mm:' or "
            "'scaled_mm:emulation'"
        )
    from scalestate.backends.scaled_mm import ScaledMMBackend

    return ScaledMMBackend(fallback="emulation" if fallback else None)


def describe_spec(spec: CastSpec) -> str:
    """A cast spec as the operators take it: its fields joined by ``|`` (a plain string, so that compiled
    code builds it while tracing)."""
    rule, g = spec.rule, spec.granularity
    dtype = str(spec.dtype).removeprefix("torch.")
    fine = "" if g is None else f"{GranularityKind(g.kind).value}|{g.block}|{int(g.power_of_2)}"
    flags = f"{int(spec.hadamard)}{int(spec.stochastic)}"
    return (
        f"{dtype}|{spec.fp8_max}|{flags}|{rule.amax_compute}|{rule.margin}|{int(rule.power_of_2)}|"
        f"{rule.amax_floor}|{fine}"
    )


@functools.cache
def _spec(description: str) -> CastSpec:
    """The spec :func:`describe_spec` described."""
    dtype, fp8_max, flags, amax_compute, margin, power_of_2, amax_floor, *fine = description.split("|")
    rule = ScaleRule(
        amax_compute=amax_compute,  # type: ignore[arg-type]  # one of the two literals, as described
        margin=int(margin),
        power_of_2=power_of_2 == "1",
        amax_floor=float(amax_floor),
    )
    granularity = None if fine == [""] else Granularity(GranularityKind(fine[0]), int(fine[1]), fine[2] == "1")
    return CastSpec(getattr(torch, dtype), float(fp8_max), rule, granularity, flags[0] == "1", flags[1] == "1")


def opaque_grouped_linear(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    group_sizes: Tensor,
    slots: Sequence[Sequence[Any]],
    products: str,
    manager: Any,
    out_dtype: torch.dtype,
) -> Tensor:
    """:func:`scalestate.nn.grouped_linear` in compiled code through the two operators; ``slots``: the
    experts' INPUT, WEIGHT and GRAD_OUTPUT slots; ``products``: the backend's description."""
    groups = manager._device_groups
    counts = group_sizes.to(torch.int64)
    active = counts > 0
    (x_scale, x_jit), (w_scale, w_jit) = groups.scales_and_jit(slots[0]), groups.scales_and_jit(slots[1])
    specs = tuple(describe_spec(group[0].spec) for group in slots)
    signs = groups.signs
    out: tuple[Tensor, Tensor, Tensor, Tensor] = OpaqueGroupedFunction.apply(  # type: ignore[no-untyped-call]
        x, weight, bias, counts.cumsum(0).to(torch.int32), active, torch.stack([x_scale, w_scale]),
        torch.stack([x_jit, w_jit]), signs, specs, products, out_dtype, manager, slots[2],
    )
    groups.record(slots[0], out[1], active, out[3][0])
    groups.record(slots[1], out[2], active, out[3][1])
    return out[0]


def _count(into: Tensor, x: Tensor, q: Quantized, spec: CastSpec, signs: Tensor) -> None:
    """Write one cast's statistics into ``into`` (``[4]``: elements, then cast_counts's three), as eager
    code adds them to the slot's."""
    elements, counts = cast_counts(x, q, spec.fp8_max, signs if spec.hadamard else None)
    into[0] = elements
    into[1:] = counts


def _request(
    x: Tensor, spec: CastSpec, scale: Tensor, jit: Tensor, record: Tensor | None, transpose: bool, signs: Tensor
) -> CastRequest:
    """The cast eager code asks of the backend (the RHT signs where the spec transforms)."""
    return CastRequest(x, spec, scale, jit, record, transpose, signs if spec.hadamard else None)


def _transpose(backend: Backend, x: Tensor, x_spec: CastSpec) -> bool:
    """Whether the casts make both orientations, as :func:`scalestate.nn.grouped_linear` asks."""
    return backend.wants_transposed(x.device) or x_spec.granularity is not None


@torch.library.custom_op("scalestate::grouped_experts_forward", mutates_args=(), **HOST_READ_OP)
def grouped_experts_forward(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    offsets: Tensor,
    scales: Tensor,
    jit: Tensor,
    signs: Tensor,
    x_spec: str,
    w_spec: str,
    products: str,
    out_dtype: torch.dtype,
    stats: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Each expert's ``x_e @ weight[e].T + bias[e]``, cast and multiplied as eager grouped layers do:
    ``(out, x_amax, w_amax)``. ``scales`` and ``jit`` (``[2, E]``: the input's, the weight's) are the
    slots' scales and whether each casts just in time; ``signs``: NVFP4's RHT signs (unused otherwise);
    the amaxes are each expert's (0 without rows), and with ``stats`` the ``[2, E, 4]`` counts of its
    two casts (zeros otherwise)."""
    backend, specs = _backend(products), (_spec(x_spec), _spec(w_spec))
    transpose = _transpose(backend, x, specs[0])
    amax = x.new_zeros((2, offsets.shape[0]), dtype=torch.float32)
    counts = x.new_zeros((2, offsets.shape[0], 4), dtype=torch.int64)
    outs = []
    for g, s, e in group_spans(offsets, skip_empty=True):
        qx = backend.cast(_request(x[s:e], specs[0], scales[0, g], jit[0, g], amax[0, g], transpose, signs))
        qw = backend.cast(_request(weight[g], specs[1], scales[1, g], jit[1, g], amax[1, g], transpose, signs))
        if stats:
            _count(counts[0, g], x[s:e], qx, specs[0], signs)
            _count(counts[1, g], weight[g], qw, specs[1], signs)
        outs.append(forward_product(backend, qx, qw, out_dtype, None if bias is None else bias[g])[0])
    out = rows_then_zeros(outs, x.shape[0], weight.shape[1], x, out_dtype)
    return out, amax[0].clone(), amax[1].clone(), counts


@grouped_experts_forward.register_fake
def _(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    offsets: Tensor,
    scales: Tensor,
    jit: Tensor,
    signs: Tensor,
    x_spec: str,
    w_spec: str,
    products: str,
    out_dtype: torch.dtype,
    stats: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    amax = x.new_empty(offsets.shape[0], dtype=torch.float32)
    counts = x.new_empty((2, offsets.shape[0], 4), dtype=torch.int64)
    return x.new_empty((x.shape[0], weight.shape[1]), dtype=out_dtype), amax, torch.empty_like(amax), counts


@torch.library.custom_op("scalestate::grouped_experts_backward", mutates_args=(), **HOST_READ_OP)
def grouped_experts_backward(
    grad_out: Tensor,
    x: Tensor,
    weight: Tensor,
    offsets: Tensor,
    scales: Tensor,
    jit: Tensor,
    signs: Tensor,
    keys: Tensor,
    x_spec: str,
    w_spec: str,
    g_spec: str,
    products: str,
    need_x: bool,
    need_w: bool,
    stats: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Each expert's input and weight gradients, cast and multiplied as eager grouped layers do:
    ``(grad_x, grad_w, g_amax)``. ``scales`` and ``jit`` are ``[3, E]`` (the input's and the weight's
    as the forward had them, the output gradient's); ``keys``: each expert's stochastic-rounding key for
    its output gradient (unused where it does not round stochastically); ``grad_x`` (``x``'s dtype) and ``grad_w``
    (``weight``'s, zeros for an expert without rows) are empty where not needed."""
    backend, specs = _backend(products), (_spec(x_spec), _spec(w_spec), _spec(g_spec))
    transpose = _transpose(backend, x, specs[0])
    amax_g = x.new_zeros(offsets.shape[0], dtype=torch.float32)
    counts = x.new_zeros((offsets.shape[0], 4), dtype=torch.int64)
    grad_w = grad_out.new_zeros(weight.shape if need_w else (0,), dtype=weight.dtype)
    dtypes = (x.dtype if need_x else None, weight.dtype if need_w else None)
    parts = []
    for g, s, e in group_spans(offsets, skip_empty=True):
        qx = backend.cast(_request(x[s:e], specs[0], scales[0, g], jit[0, g], None, transpose, signs))
        qw = backend.cast(_request(weight[g], specs[1], scales[1, g], jit[1, g], None, transpose, signs))
        x_saved, w_saved, x_is_transposed = saved_operands(qx, qw)
        g_request = _request(grad_out[s:e], specs[2], scales[2, g], jit[2, g], amax_g[g], x_is_transposed, signs)
        qg = backend.cast(g_request._replace(sr_key=keys[g] if specs[2].stochastic else None))
        if stats:
            _count(counts[g], grad_out[s:e], qg, specs[2], signs)
        gx, gw = backward_products(backend, qg, x_saved, w_saved, x_is_transposed, dtypes)
        if gx is not None:
            parts.append(gx)
        if gw is not None:
            grad_w[g] = gw
    grad_x = rows_then_zeros(parts, x.shape[0], x.shape[1], x, x.dtype) if need_x else x.new_zeros((0,))
    return grad_x, grad_w, amax_g, counts


@grouped_experts_backward.register_fake
def _(
    grad_out: Tensor,
    x: Tensor,
    weight: Tensor,
    offsets: Tensor,
    scales: Tensor,
    jit: Tensor,
    signs: Tensor,
    keys: Tensor,
    x_spec: str,
    w_spec: str,
    g_spec: str,
    products: str,
    need_x: bool,
    need_w: bool,
    stats: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    grad_x = x.new_empty(x.shape if need_x else (0,))
    grad_w = weight.new_empty(weight.shape if need_w else (0,))
    counts = x.new_empty((offsets.shape[0], 4), dtype=torch.int64)
    return grad_x, grad_w, x.new_empty(offsets.shape[0], dtype=torch.float32), counts


class OpaqueGroupedFunction(torch.autograd.Function):
    """A grouped layer through the two operators: ``(out, x_amax, w_amax)``, the amaxes for the caller to
    record; backward reads the output gradient's scales (``grad_slots``) and records its amaxes."""

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        offsets: Tensor,
        active: Tensor,
        scales: Tensor,
        jit: Tensor,
        signs: Tensor,
        specs: tuple[str, str, str],
        products: str,
        out_dtype: torch.dtype,
        manager: Any,
        grad_slots: Sequence[Any],
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        stats = manager._device_groups.stats
        out, amax_x, amax_w, counts = torch.ops.scalestate.grouped_experts_forward(
            x, weight, bias, offsets, scales, jit, signs, specs[0], specs[1], products, out_dtype, stats
        )
        ctx.save_for_backward(x, weight, offsets, active, scales, jit, signs)
        ctx.mark_non_differentiable(amax_x, amax_w, counts)
        ctx.specs, ctx.products, ctx.manager, ctx.grad_slots = specs, products, manager, grad_slots
        ctx.b_dtype = None if bias is None else bias.dtype
        return out, amax_x, amax_w, counts

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor, *_: Any) -> tuple[Tensor | None, ...]:
        grad_out = grad_out.contiguous()  # as eager has it (see FP8LinearFunction.backward)
        x, weight, offsets, active, scales, jit, signs = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_x = grad_w = grad_b = None
        if need_x or need_w:
            groups = ctx.manager._device_groups
            g_scale, g_jit = groups.scales_and_jit(ctx.grad_slots)
            keys = groups.sr_keys(ctx.grad_slots, active)
            gx, gw, amax_g, counts = torch.ops.scalestate.grouped_experts_backward(
                grad_out, x, weight, offsets, torch.cat([scales, g_scale[None]]), torch.cat([jit, g_jit[None]]),
                signs, keys, *ctx.specs, ctx.products, need_x, need_w, groups.stats,
            )
            groups.record(ctx.grad_slots, amax_g, active, counts)
            grad_x, grad_w = (gx if need_x else None), (gw if need_w else None)
        if need_b:  # each expert's rows summed as ss.nn.Linear sums its bias gradient
            grad_b = torch.ops.scalestate.grouped_sum(grad_out, offsets).to(ctx.b_dtype)
        return grad_x, grad_w, grad_b, None, None, None, None, None, None, None, None, None, None
