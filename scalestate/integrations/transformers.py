"""Hugging Face transformers: FP8 ``Conv1D`` and a ``Trainer`` callback (``pip install "scalestate[transformers]"``).

- :class:`Conv1D`: transformers' ``Conv1D`` (GPT-2 and its relatives:
  ``y = x @ weight + bias`` with the weight stored ``(in_features,
  out_features)``) with its products in FP8, on the same parameters.
  Importing this module registers it with :func:`scalestate.nn.convert`
  (unless a conversion of ``Conv1D`` is registered already);
  :func:`scalestate.nn.convert` imports this module by itself when
  transformers is in use, so ``ss.nn.convert(gpt2, manager)`` converts every
  ``Conv1D`` and ``torch.nn.Linear`` of the model.
- :class:`ScalingStateCallback`: steps the manager once per optimizer step,
  saves its state into each checkpoint folder, and restores it when
  ``Trainer.train(resume_from_checkpoint=...)`` resumes, so that a resumed run
  is bitwise the uninterrupted one.
"""

from __future__ import annotations

import importlib.util
import os
import uuid
from typing import Any

import torch

from scalestate.atomic import atomic_save
from scalestate.errors import ArgumentTypeError, ConversionTypeError, MissingDependencyError, StateDictError
from scalestate.manager import ScalingStateManager
from scalestate.nn.base import WeightSlotModule, check_module_arguments
from scalestate.nn.linear import linear
from scalestate.nn.registry import ConversionRequest, adopt_parameters, register_conversion, registered_conversions

_EXTRA = 'pip install "scalestate[transformers]"'

try:
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
    from transformers.pytorch_utils import Conv1D as _HFConv1D
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
except ImportError as error:  # pragma: no cover - exercised by a test that hides transformers
    raise MissingDependencyError(
        f"scalestate.integrations.transformers needs transformers (and accelerate for its Trainer): {_EXTRA}"
    ) from error

__all__ = ["Conv1D", "ScalingStateCallback", "convert_conv1d"]

#: Key of the callback's entry in ``TrainerState.stateful_callbacks`` (saved in ``trainer_state.json``).
STATE_KEY = "scalestate"


class Conv1D(WeightSlotModule, _HFConv1D):
    """transformers' ``Conv1D`` with input, weight and gradient cast to FP8 by a manager.

    ``y = x @ weight + bias`` with ``weight`` of shape ``(nx, nf)`` =
    ``(in_features, out_features)``, as in transformers. The products are those
    of :class:`scalestate.nn.Linear` on ``weight.t()``, bit for bit (see
    ``weight_transposed`` in :func:`scalestate.nn.linear`); the weight
    parameter itself is cast, once per scale epoch. Parameters and
    ``state_dict`` keys and shapes are transformers' own, and it is still an
    instance of ``transformers.pytorch_utils.Conv1D``. Usually made by
    :func:`scalestate.nn.convert`, which keeps the converted layer's
    parameter objects.

    Args:
        nf: output features.
        nx: input features.
        manager: owns its scaling state.
        name: its slot name (default ``"conv1d"``, ``"conv1d_1"``, ... unique in the manager).
        device, dtype: of the parameters; on ``"meta"`` nothing is allocated or initialized.
        fp8_all_gather: under FSDP2, all-gather the weight in FP8 (as in
            :class:`scalestate.nn.Linear`).

    Example:
        >>> import torch, scalestate as ss
        >>> from scalestate.integrations.transformers import Conv1D
        >>> m = ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation")
        >>> layer = Conv1D(16, 32, manager=m, name="attn.c_proj")
        >>> layer.weight.shape, layer(torch.randn(2, 5, 32)).shape
        (torch.Size([32, 16]), torch.Size([2, 5, 16]))
    """

    def __init__(
        self,
        nf: int,
        nx: int,
        *,
        manager: ScalingStateManager,
        name: str | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        fp8_all_gather: bool = False,
    ) -> None:
        check_module_arguments(manager, fp8_all_gather)
        # transformers' __init__ allocates and initializes on the default device; set the same attributes here.
        torch.nn.Module.__init__(self)
        self.nf = nf
        self.nx = nx
        self.weight = torch.nn.Parameter(torch.empty(nx, nf, device=device, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(nf, device=device, dtype=dtype))
        if not self.weight.is_meta:
            torch.nn.init.normal_(self.weight, std=0.02)  # transformers' initialization
        self.bind_slot(manager, name, "conv1d", fp8_all_gather)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """FP8 ``x @ weight + bias``."""
        return linear(x, self.weight, self.bias, self.handle, weight_transposed=True)

    def __repr__(self) -> str:
        extra = ", fp8_all_gather=True" if self.fp8_all_gather else ""
        return f"Conv1D(nf={self.nf}, nx={self.nx}, slot={self.handle.name!r}{extra})"


def convert_conv1d(module: torch.nn.Module, request: ConversionRequest) -> Conv1D:
    """The conversion :func:`scalestate.nn.convert` applies to transformers' ``Conv1D``.

    Registered when this module is imported; pass it to
    :func:`scalestate.nn.register_conversion` (``subclasses=True``) to also
    convert subclasses of ``Conv1D``.
    """
    if not isinstance(module, _HFConv1D):
        raise ConversionTypeError(f"convert_conv1d converts transformers' Conv1D; got {type(module).__name__}")
    new = Conv1D(
        module.nf,
        module.nx,
        manager=request.manager,
        name=request.name,
        device="meta",
        fp8_all_gather=request.fp8_all_gather,
    )
    return adopt_parameters(new, module, request)


if _HFConv1D not in registered_conversions():
    register_conversion(_HFConv1D, convert_conv1d)


class ScalingStateCallback(TrainerCallback):
    """Drives a manager from a Hugging Face ``Trainer``: step, save, resume.

    - ``on_step_end`` (once per optimizer step, after the optimizer, whatever
      ``gradient_accumulation_steps`` is): ``manager.step()``. Microbatches
      need no phase calls: casts are classified by themselves (recompute under
      gradient checkpointing, evaluation under ``torch.no_grad()``).
    - ``on_save``: ``manager.state_dict()`` into the checkpoint folder the
      Trainer has just written (``<output_dir>/checkpoint-<step>/scalestate.pt``;
      ``scalestate_<process_index>.pt`` on each process when there are
      several), with ``torch.save`` made crash-safe: a dict of ``"manager"``
      (the state dict), ``"run"``, ``"iteration"`` and ``"global_step"``, which
      ``torch.load(path, weights_only=True)`` reads.
    - ``on_train_begin`` of a resumed run: the Trainer does not hand the
      checkpoint path to callbacks, so the callback finds it, and checks it
      found the right one. At every step it writes a marker (a run id and the
      manager's iteration) into ``TrainerState.stateful_callbacks``, which
      lands in each checkpoint's ``trainer_state.json``; the resumed Trainer
      loads that file and passes the state to the callback. The callback then
      looks for the state file whose marker matches in
      ``args.resume_from_checkpoint`` (if set) and in
      ``<output_dir>/checkpoint-<global_step>`` (where the Trainer saved it,
      and what ``resume_from_checkpoint=True`` picks), and loads it. If none
      matches, it raises ``StateDictError`` rather than go on with another
      state: pass the folder as ``TrainingArguments(resume_from_checkpoint=...)``.

    Args:
        manager: the manager of the model's FP8 layers.
        restore: load the state when resuming (default). ``False``: leave the
            manager as it is (e.g. loaded by hand, or a checkpoint saved
            without this callback).

    Raises:
        ArgumentTypeError: ``manager`` is not a manager, or ``restore`` not a bool.
        MissingDependencyError: accelerate (which the Trainer needs) is missing.

    Example:
        >>> import scalestate as ss
        >>> from scalestate.integrations.transformers import ScalingStateCallback
        >>> manager = ss.ScalingStateManager(ss.DelayedScaling(), backend="emulation")
        >>> callback = ScalingStateCallback(manager)
        >>> # model = ss.nn.convert(model, manager)
        >>> # Trainer(model, args, train_dataset=..., callbacks=[callback]).train()
    """

    def __init__(self, manager: ScalingStateManager, *, restore: bool = True) -> None:
        if not isinstance(manager, ScalingStateManager):
            raise ArgumentTypeError(f"ScalingStateCallback needs a ScalingStateManager; got {type(manager).__name__}")
        if not isinstance(restore, bool):
            raise ArgumentTypeError(f"restore must be True or False; got {restore!r}")
        if importlib.util.find_spec("accelerate") is None:
            raise MissingDependencyError(f"the transformers Trainer needs accelerate: {_EXTRA}")
        self.manager = manager
        self.restore = restore
        self._run: str | None = None

    @staticmethod
    def state_file_name(args: TrainingArguments) -> str:
        """The state file's name in a checkpoint folder, for this process."""
        return "scalestate.pt" if args.world_size <= 1 else f"scalestate_{args.process_index}.pt"

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """A new run gets a run id; a resumed one loads the manager's state (see the class docstring)."""
        marker = _stateful(state).get(STATE_KEY)
        if state.global_step == 0 or not self.restore:
            self._run = marker["run"] if isinstance(marker, dict) and state.global_step else uuid.uuid4().hex
            return
        if not isinstance(marker, dict):
            raise StateDictError(
                f"resuming at step {state.global_step} from a checkpoint whose trainer_state.json has no "
                f"{STATE_KEY!r} entry: it was saved without ScalingStateCallback. Pass "
                "ScalingStateCallback(manager, restore=False) to go on with the manager's current state"
            )
        self._run = marker["run"]
        name = self.state_file_name(args)
        saved_at = os.path.join(str(args.output_dir), f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        candidates = [
            os.path.join(folder, name) for folder in (args.resume_from_checkpoint, saved_at) if isinstance(folder, str)
        ]
        seen = []
        for path in candidates:
            if not os.path.isfile(path):
                seen.append(f"{path}: no such file")
                continue
            saved = torch.load(path, map_location="cpu", weights_only=True)
            found = {"run": saved.get("run"), "iteration": saved.get("iteration")}
            if found == {"run": marker["run"], "iteration": marker["iteration"]}:
                self.manager.load_state_dict(saved["manager"])
                return
            seen.append(f"{path}: saved by another run or at another step ({found})")
        raise StateDictError(
            f"cannot find the scaling state to resume from at step {state.global_step} "
            f"(run {marker['run']}, iteration {marker['iteration']}): " + "; ".join(seen) + ". Pass the "
            "checkpoint folder you resume from as TrainingArguments(resume_from_checkpoint=...), or "
            "ScalingStateCallback(manager, restore=False) to go on with the manager's current state"
        )

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """``manager.step()``, once per optimizer step; the marker for the next checkpoint."""
        self.manager.step()
        if self._run is None:  # a Trainer loop that skipped on_train_begin
            self._run = uuid.uuid4().hex
        _stateful(state)[STATE_KEY] = {"run": self._run, "iteration": self.manager.iteration}

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """The manager's state into the checkpoint folder just written."""
        folder = os.path.join(str(args.output_dir), f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        if not os.path.isdir(folder):
            raise StateDictError(
                f"the Trainer saved a checkpoint, but {folder} does not exist (a hyperparameter search saves "
                "into run folders of its own); save the manager's state yourself with "
                "torch.save(manager.state_dict(), path)"
            )
        payload = {
            "run": self._run,
            "iteration": self.manager.iteration,
            "global_step": state.global_step,
            "manager": self.manager.state_dict(),
        }
        atomic_save(payload, os.path.join(folder, self.state_file_name(args)))


def _stateful(state: TrainerState) -> dict[str, Any]:
    """``state.stateful_callbacks`` (a dict at run time, whatever its annotation says)."""
    callbacks: Any = state.stateful_callbacks
    if callbacks is None:
        callbacks = {}
        state.stateful_callbacks = callbacks
    if not isinstance(callbacks, dict):
        raise ArgumentTypeError(f"TrainerState.stateful_callbacks is a {type(callbacks).__name__}, expected a dict")
    return callbacks
