"""Command line: ``scalestate demo`` (also ``python -m scalestate demo``)."""

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
            "block (1 x B tiles, B x B weight blocks), mxfp8 (one E8M0 power of two per 32 elements); "
            "see docs/recipes.md"
        ),
    )
    demo.add_argument("--history-len", type=int, default=16, help="amax history of delayed scaling")
    demo.add_argument(
        "--block", type=int, default=None, metavar="B",
        help="tile and weight-block edge B of --recipe block; unset (None): 128, or the largest power of "
        "two <= --d-model when that is smaller, so that every weight spans at least one whole block",
    )
    demo.add_argument(
        "--no-fp32", action="store_true", help="skip the fp32 reference run (faster)"
    )
    demo.add_argument(
        "--ranks", type=int, default=1,
        help="data-parallel processes (DistributedDataParallel on gloo, CPU); under torchrun, its world size",
    )
    demo.add_argument("--quiet", action="store_true", help="no progress bars")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``scalestate`` command; returns the exit status."""
    args = _parser().parse_args(argv)
    from scalestate.demo.run import run_demo

    return run_demo(args)


if __name__ == "__main__":
    sys.exit(main())
