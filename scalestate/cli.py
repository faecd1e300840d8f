"""Command line: ``scalestate demo``, ``scalestate inspect`` and ``scalestate plot`` (also ``python -m scalestate``).

Exit statuses: 0 success; 1 the demo found a difference, or a checkpoint
could not be read or holds no usable manager state (a one-line message on
stderr, no traceback); 2 bad arguments; 3 ``inspect --check`` found flagged slots.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from scalestate.demo.train import RECIPE_NAMES

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="scalestate",
        description="scalestate: the scaling state of FP8 training in PyTorch.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = sub.add_parser(
        "demo",
        help="train a small language model in FP8 and check checkpointing parity",
        description=(
            "Train a small decoder-only transformer on the docstrings of Python's standard "
            "library, three times from the same seed: in fp32; in FP8 with activation "
            "checkpointing on every block; in FP8 without it. Each step has several "
            "microbatches. Report the FP8 loss against fp32, and whether parameters and "
            "scaling state of the two FP8 runs are bitwise equal. With --ranks N (or under "
            "torchrun) every run is data parallel on N processes, and the report also says "
            "whether every rank holds the same scaling state. Exit status 1 if anything differs."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    demo.add_argument("--steps", type=int, default=100, help="optimizer steps per run")
    demo.add_argument("--microbatches", type=int, default=4, help="microbatches per step")
    demo.add_argument("--microbatch-size", type=int, default=8, help="sequences per microbatch")
    demo.add_argument("--seq-len", type=int, default=64, help="tokens (bytes) per sequence")
    demo.add_argument("--d-model", type=int, default=128, help="model width")
    demo.add_argument("--layers", type=int, default=4, help="transformer blocks")
    demo.add_argument("--heads", type=int, default=4, help="attention heads")
    demo.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate")
    demo.add_argument("--seed", type=int, default=0, help="seed of initialisation and data")
    demo.add_argument(
        "--backend", default="emulation",
        help="scalestate backend of the FP8 runs (emulation, scaled_mm, auto, ...)",
    )
    demo.add_argument(
        "--recipe", choices=RECIPE_NAMES, default="delayed",
        help=(
            "FP8 scaling recipe: delayed or current (one scale per tensor), rowwise (one per row), "
            "block (1 x B tiles, B x B weight blocks), mxfp8 (one E8M0 power of two per 32 elements), "
            "nvfp4 (4-bit E2M1 with E4M3 scales per 16 elements; first block and head kept in high "
            "precision); see docs/recipes.md"
        ),
    )
    demo.add_argument("--history-len", type=int, default=16, help="amax history of delayed scaling")
    demo.add_argument(
        "--block", type=int, default=None, metavar="B",
        help="tile and weight-block edge B of --recipe block; unset (None): 128, or the largest power of "
        "two <= --d-model when that is smaller, so that every weight spans at least one whole block",
    )
    demo.add_argument(
        "--moe", action="store_true",
        help="mixture of experts: every block's MLP is --experts GELU experts, each token routed to --top-k "
        "of them (FP8 grouped experts, one slot per expert; the router stays in high precision)",
    )
    demo.add_argument("--experts", type=int, default=8, help="experts per MoE block (with --moe)")
    demo.add_argument("--top-k", type=int, default=2, help="experts per token (with --moe)")
    demo.add_argument(
        "--no-fp32", action="store_true", help="skip the fp32 reference run (faster)"
    )
    demo.add_argument(
        "--ranks", type=int, default=1,
        help="data-parallel processes (DistributedDataParallel on gloo, CPU); under torchrun, its world size",
    )
    demo.add_argument("--quiet", action="store_true", help="no progress bars")
    _add_checkpoint_commands(sub)
    return parser


def _add_checkpoint_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("checkpoint", metavar="CKPT", help="a file saved with torch.save")
    common.add_argument(
        "--key", metavar="PATH", default=None,
        help="dotted path of the manager state inside the checkpoint (e.g. 'fp8' or 'trainer.scaling'; "
        "list items by index); needed only when the file holds more than one",
    )
    common.add_argument(
        "--unsafe-load", action="store_true",
        help="load with torch.load(weights_only=False), for checkpoints that pickle other objects; "
        "only for files you trust",
    )
    inspect = sub.add_parser(
        "inspect", parents=[common],
        help="print a table of every slot of a saved scaling state, with the slots at risk flagged",
        description=(
            "Print every slot (name and role) of a scalestate manager state saved in CKPT: scale, newest "
            "and largest amax of the history, headroom and uncovered growth in bits, non-finite steps, and "
            "flags: low-headroom (the amax outgrew what its history covered by over 1 bit, delayed scaling), "
            "non-finite, no-amax (never recorded), constant (the same amax over the whole history), no-step "
            "(casts recorded, manager.step() never called). Numbered slots of one prefix (the experts of a "
            "grouped MoE layer) share one line per role, with the spread of their scales and the experts that "
            "never received tokens named. CKPT may hold the state itself or a dict or list "
            "holding it at any depth. See docs/cli.md and docs/diagnostics.md."
        ),
    )
    inspect.add_argument("--check", action="store_true", help="exit with status 3 if any slot is flagged")
    inspect.add_argument(
        "--per-expert", action="store_true",
        help="one line per expert of a grouped (MoE) layer, instead of one per layer and role with their spread",
    )
    plot = sub.add_parser(
        "plot", parents=[common],
        help="draw each slot's amax history and scale to a PNG (needs scalestate[plot])",
        description=(
            "Draw the amax history of every slot of a scalestate manager state saved in CKPT, one row of "
            "panels per slot name and one column per role, with the amax above which the current scale "
            "saturates (fp8_max / scale) dashed. Needs matplotlib: pip install \"scalestate[plot]\"."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    plot.add_argument("-o", "--output", required=True, metavar="PNG", help="the image file to write")
    plot.add_argument(
        "--max-slots", type=int, default=12, metavar="N",
        help="draw at most N slot names (flagged ones first); the title says how many were left out",
    )
    plot.add_argument("--dpi", type=int, default=100, help="pixels per inch (the figure is 12 inches wide)")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``scalestate`` command; returns the exit status."""
    args = _parser().parse_args(argv)
    if args.command in ("inspect", "plot"):
        return _checkpoint_command(args)
    from scalestate.demo.run import run_demo

    return run_demo(args)


def _checkpoint_command(args: argparse.Namespace) -> int:
    from rich.console import Console

    from scalestate.errors import ScaleStateError
    from scalestate.report import (
        FLAG_HELP,
        load_checkpoint,
        plot_stats,
        select_state,
        stats_from_state_dict,
        stats_table,
    )

    prog = f"scalestate {args.command}"
    if args.command == "plot" and (args.max_slots < 1 or args.dpi < 10):
        print(f"{prog}: --max-slots must be >= 1 and --dpi >= 10; got {args.max_slots} and {args.dpi}",
              file=sys.stderr)
        return 2
    try:
        obj = load_checkpoint(args.checkpoint, weights_only=not args.unsafe_load)
        path, state = select_state(obj, args.key)
        stats = stats_from_state_dict(state)
    except ScaleStateError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1
    where = f"{args.checkpoint}" + (f" [{path}]" if path else "")
    recipe = stats.recipe
    if args.command == "plot":
        try:
            drawn, names, _ = plot_stats(stats, args.output, max_slots=args.max_slots, dpi=args.dpi, title=where)
        except (ImportError, OSError) as exc:
            print(f"{prog}: {exc}", file=sys.stderr)
            return 1
        left = f" ({names - drawn} left out: --max-slots)" if drawn < names else ""
        print(f"wrote {args.output}: {drawn} of {names} slot names{left}")
        return 0
    console = Console(width=None if sys.stdout.isatty() else 160, soft_wrap=False)
    console.print(f"{where}: {recipe!r}, step {stats.iteration}, {len(stats.slots())} slots", markup=False,
                  highlight=False)
    if not stats.slots():
        console.print("  no slots: the manager had no module registered when this state was saved", markup=False,
                      highlight=False)
    else:
        console.print(stats_table(stats, per_expert=args.per_expert))
    risky = stats.at_risk()
    used = sorted({f for s in risky for f in s.flags}, key=list(FLAG_HELP).index)
    for flag in used:
        console.print(f"  {flag.value}: {FLAG_HELP[flag]}", markup=False, highlight=False)
    console.print(f"{len(risky)} of {len(stats.slots())} slots flagged", markup=False, highlight=False)
    return 3 if args.check and risky else 0


if __name__ == "__main__":
    sys.exit(main())
