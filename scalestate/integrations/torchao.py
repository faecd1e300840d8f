"""torchao's float8 training with every cast scaled by a :class:`~scalestate.ScalingStateManager`.

Design requirement: torchao's float8 ``Linear`` scales each cast from the
tensor being cast (dynamic scaling) and keeps no state; it dropped delayed
scaling. This adapter gives its users delayed scaling (and current scaling)
with scalestate's guarantees, recompute parity under activation
checkpointing, microbatch max-reduction, the weight-cast cache, persistence,
while torchao's own matmuls, kernels and ``torch.compile`` support run
unchanged.

How: torchao's product (``matmul_with_hp_or_float8_args``) casts an operand
only if it is not already one of its float8 training tensors. The layers made
here cast input and weight through the manager's handle in ``forward``, wrap
each :class:`~scalestate.Quantized` as such a tensor (its FP8 data and
``Quantized.scale``, the exact multiplier torchao divides by), and hand them
to torchao's product. An identity on the product's output casts the output
gradient in backward through the ``GRAD_OUTPUT`` slot, so torchao's backward
finds it cast as well. torchao saves its operands for backward: here they are
the FP8 tensors, so a layer keeps one FP8 copy of its input, not the
high-precision one.

With the recipe :func:`matching_recipe` makes (:class:`~scalestate.CurrentScaling`
with torchao's amax floor, :data:`AMAX_FLOOR`) every cast has torchao's own
scale, for every input, so training is bit for bit that of
``torchao.float8.convert_to_float8_training`` with the same config. Only
per-tensor scaling is served (see
:func:`convert_to_float8_training` for what is refused, and why).

Needs the ``torchao`` extra: ``pip install "scalestate[torchao]"``.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch

from scalestate.errors import ConversionError, ConversionTypeError

# torchao's names come through the layer's module, which raises MissingDependencyError
# (saying what to install) when torchao is missing.
from scalestate.integrations._torchao_layer import (
    TORCHAO_EPS,
    Float8Linear,
    Float8LinearConfig,
    ManagedFloat8Linear,
    check_config,
    dtypes_of,
    format_of,
)
from scalestate.manager import ScalingStateManager
from scalestate.nn.convert import check_prefix, find_layers, slot_names, swap_layers
from scalestate.nn.linear import Linear as ScalestateLinear
from scalestate.recipe import CurrentScaling, DelayedScaling

__all__ = [
    "AMAX_FLOOR",
    "ManagedFloat8Linear",
    "convert_to_float8_training",
    "matching_recipe",
]

#: torchao's amax floor: its dynamic scaling divides by ``max(amax, AMAX_FLOOR)`` (``1e-12``, read
#: from ``torchao.float8.float8_utils.EPS``). :func:`matching_recipe` sets it as the recipe's ``amax_floor``.
AMAX_FLOOR: float = float(TORCHAO_EPS)


def matching_recipe(
    config: Float8LinearConfig | None = None, recipe: DelayedScaling | CurrentScaling | None = None
) -> DelayedScaling | CurrentScaling:
    """The recipe whose scales are torchao's own under ``config``: make the manager with it.

    ``recipe`` (default ``ss.CurrentScaling()``) with the format that casts
    each role to the config's dtype, ``power_of_2`` set to the config's
    ``round_scales_to_power_of_2``, and torchao's amax floor
    (``amax_floor=AMAX_FLOOR``, ``1e-12``). With ``ss.CurrentScaling`` the
    adapter then trains bit for bit as ``torchao.float8.convert_to_float8_training``
    with the same config, for every input, the tiniest amaxes included (torchao
    scales an amax below ``1e-12`` as ``1e-12``; a recipe without the floor
    follows it further down, to larger scales). With ``ss.DelayedScaling``
    its scales follow torchao's rule from the amax history.

    Args:
        config: torchao's ``Float8LinearConfig`` (default ``Float8LinearConfig()``).
        recipe: the per-tensor recipe to start from; its other fields are kept.

    Raises:
        ConversionError: no ``ss.Format`` casts the config's dtypes, or
            ``recipe`` is fine-grained.
        ConversionTypeError: ``config`` or ``recipe`` has the wrong type.

    Example:
        >>> import scalestate as ss
        >>> from torchao.float8 import Float8LinearConfig
        >>> from scalestate.integrations.torchao import matching_recipe
        >>> matching_recipe(Float8LinearConfig(emulate=True))
        CurrentScaling(format=Format.HYBRID, power_of_2=False, amax_floor=1e-12)
        >>> matching_recipe(recipe=ss.DelayedScaling(history_len=4)).amax_floor
        1e-12
    """
    if config is None:
        config = Float8LinearConfig()
    if not isinstance(config, Float8LinearConfig):
        raise ConversionTypeError(
            f"config must be a torchao.float8.Float8LinearConfig (or None for its default); got {type(config).__name__}"
        )
    if recipe is None:
        recipe = CurrentScaling()
    if not isinstance(recipe, (DelayedScaling, CurrentScaling)):
        raise ConversionTypeError(
            f"recipe must be an ss.DelayedScaling or ss.CurrentScaling (per-tensor scales, as torchao's tensorwise "
            f"training tensors carry); got {type(recipe).__name__}"
        )
    fmt = format_of(config)
    if fmt is None:
        wanted = ", ".join(f"{role.name}: {dtype}" for role, dtype in dtypes_of(config).items())
        raise ConversionError(
            f"no ss.Format casts the config's dtypes ({wanted}; INPUT and WEIGHT must share one, E4M3 or E5M2). "
            "Give the config target dtypes of one format, e.g. torchao's default Float8LinearConfig()"
        )
    power_of_2 = bool(config.round_scales_to_power_of_2)
    return attrs.evolve(recipe, format=fmt, power_of_2=power_of_2, amax_floor=AMAX_FLOOR)


def convert_to_float8_training(
    model: torch.nn.Module,
    manager: ScalingStateManager,
    *,
    config: Float8LinearConfig | None = None,
    module_filter_fn: Callable[[torch.nn.Module, str], bool] | None = None,
    prefix: str = "",
) -> torch.nn.Module:
    """Swap ``model``'s ``torch.nn.Linear`` layers for torchao float8 ones scaled by ``manager``.

    The counterpart of ``torchao.float8.convert_to_float8_training``, with the
    same conventions: every ``torch.nn.Linear`` (subclasses included) for which
    ``module_filter_fn(module, fqn)`` is true is replaced by a
    :class:`ManagedFloat8Linear`, in place; ``fqn`` is the module's path
    (``""`` for ``model`` itself, which is then returned converted). Each layer
    registers its slots under its path, after ``prefix`` if one is given
    (a converted root: ``prefix``, or ``"linear"``), and takes over the *same*
    parameter objects, so weights, ``state_dict`` keys and an optimizer built
    before are kept. A layer reachable by several paths is converted once,
    under its first path, and replaced at all of them. Nothing changes if any
    check fails (a name clash below is found once the new layers are built:
    the model is unchanged, their slots stay registered).

    Nothing the model holds is dropped (torchao's own function refuses a root
    ``Linear`` with children, and drops those of a nested one): a converted
    layer keeps its child modules, and any parameter or buffer besides
    ``weight`` and ``bias``, under the same names, and a ``torch.nn.Linear``
    among those children is converted too, at any depth, as in
    :func:`scalestate.nn.convert`.

    Drive the training loop as with any scalestate model: phase blocks (or
    none), and ``manager.step()`` after each optimizer step.

    Refused, with :class:`ConversionError` naming the alternative:

    * torchao's row-wise and axiswise recipes
      (``Float8LinearConfig.from_recipe_name("rowwise")``,
      ``"rowwise_with_gw_hp"``, any axiswise or disabled ``CastConfig``): the
      manager's scales here are per tensor.
    * ``enable_fsdp_float8_all_gather=True``: torchao would cast the weight
      shards with its own scales; scalestate's
      ``ss.nn.convert(..., fp8_all_gather=True)`` all-gathers in FP8 with the
      manager's.
    * a manager whose recipe is fine-grained
      (``manager.recipe.granularity(role) is not None``): use
      ``ss.nn.convert`` for those.
    * FP8 dtypes of the config that differ from the recipe's format
      (torchao's default, E4M3 forward and E5M2 for gradients, is
      ``ss.Format.HYBRID``), or ``round_scales_to_power_of_2`` differing from
      the recipe's ``power_of_2``.
    * a layer already converted to float8 (by torchao, by this function or
      :func:`scalestate.nn.convert`), and a model with no ``torch.nn.Linear``
      selected.
    * a ``prefix`` that is not a dotted path, and a layer holding a child,
      parameter or buffer under a name that ``ManagedFloat8Linear`` uses
      itself (keeping it would lose one of the two).

    Args:
        model: a ``torch.nn.Module``; converted in place and returned.
        manager: owns the new layers' scaling state.
        config: torchao's ``Float8LinearConfig``; default torchao's default
            (tensorwise, ``Float8LinearConfig()``). Its ``emulate``,
            ``pad_inner_dim`` and ``gemm_config_*`` keep their meaning for the products.
        module_filter_fn: ``module_filter_fn(module, fqn) -> bool``, torchao's
            argument order; only layers for which it is true are converted.
            ``fqn`` is the path in ``model``, without ``prefix``.
        prefix: prepended to every slot name (``prefix="encoder"``: the layer at
            ``"0"`` registers ``"encoder.0"``), so that models or parts
            converted separately share one manager; ``""`` (default) or a
            dotted path.

    Returns:
        ``model``, or the new layer if ``model`` itself is a converted ``torch.nn.Linear``.

    Raises:
        ConversionError: see above.
        ConversionTypeError: ``model``, ``manager``, ``config``,
            ``module_filter_fn`` or ``prefix`` has the wrong type.
        SlotError: a layer's path is already a slot name in ``manager``.

    Example:
        >>> import torch, scalestate as ss
        >>> from torchao.float8 import Float8LinearConfig
        >>> from scalestate.integrations.torchao import convert_to_float8_training
        >>> manager = ss.ScalingStateManager(ss.DelayedScaling(history_len=16), backend="emulation")
        >>> net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))
        >>> net = convert_to_float8_training(net, manager, config=Float8LinearConfig(emulate=True))
        >>> list(manager.handles)
        ['0', '2']
    """
    if not isinstance(model, torch.nn.Module):
        raise ConversionTypeError(
            f"model must be a torch.nn.Module; got {type(model).__name__}. Pass the module whose "
            "torch.nn.Linear layers should run in float8"
        )
    if module_filter_fn is not None and not callable(module_filter_fn):
        raise ConversionTypeError(
            f"module_filter_fn must be callable as module_filter_fn(module, fqn) -> bool; got "
            f"{type(module_filter_fn).__name__}"
        )
    check_prefix(prefix)
    if config is None:
        config = Float8LinearConfig()
    check_config(config, manager)
    linears = find_layers(model, lambda module: isinstance(module, torch.nn.Linear))
    chosen = {
        key: (module, paths) for key, (module, paths) in linears.items()
        if module_filter_fn is None or module_filter_fn(module, paths[0])
    }
    if not chosen:
        what = "none passes module_filter_fn" if linears else f"{type(model).__name__} contains none"
        raise ConversionError(
            f"found no torch.nn.Linear to convert ({what}); this adapter swaps torch.nn.Linear layers "
            "only. Pass the model that holds them, or a module_filter_fn that selects some"
        )
    fp8_layers = (Float8Linear, ScalestateLinear)
    done = [paths[0] or "<root>" for module, paths in chosen.values() if isinstance(module, fp8_layers)]
    if done:
        raise ConversionError(
            f"layer(s) {done} are already float8 layers; convert a model once, with one function: leave "
            "them out with module_filter_fn, or start from the torch.nn.Linear model"
        )
    names = slot_names(manager, chosen, prefix, lambda module: "linear")
    built: dict[int, torch.nn.Module] = {}
    for key, (module, _) in chosen.items():
        assert isinstance(module, torch.nn.Linear)  # find_layers matched only those
        built[key] = ManagedFloat8Linear.from_linear(module, config=config, manager=manager, name=names[key])
    return swap_layers(model, chosen, built)
