"""``stratagem demo``: a small character-level transformer language model trained on text shipped here.

``corpus.txt`` is original prose written for this package (a short story, then sentences assembled from a small
grammar), free to use like the rest of the package.
"""

from __future__ import annotations

import argparse

from stratagem import cli
from stratagem.cli.run import _add_compile_arguments, compile_request


def _add_parsers(sub: argparse._SubParsersAction) -> None:
    d = sub.add_parser(
        "demo",
        help="train a small transformer LM on text shipped with stratagem (checkpoint, resume, memory report)",
    )
    d.add_argument("--strategy", default="auto")
    d.add_argument("--devices", type=int, default=1)
    d.add_argument("--steps", type=int, default=200)
    d.add_argument("--accelerator", default="cpu", choices=["auto", "cpu", "cuda"])
    d.add_argument("--precision", default="32-true")
    d.add_argument("--batch-size", type=int, default=16)
    d.add_argument(
        "--root-dir", default=None, help="keep checkpoints and metrics.csv here (default: a temp dir)"
    )
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--no-progress-bar", action="store_true")
    d.add_argument(
        "--launcher", default="auto", help="how the workers start (`stratagem launchers` lists them)"
    )
    _add_compile_arguments(d, "the demo's Trainer")


cli._PARSER_EXTENSIONS.append(_add_parsers)


@cli.command("demo")
def _demo(args: argparse.Namespace) -> int:
    from stratagem.cli.demo.lm import run

    run(
        strategy=args.strategy,
        devices=args.devices,
        steps=args.steps,
        accelerator=args.accelerator,
        precision=args.precision,
        batch_size=args.batch_size,
        root_dir=args.root_dir,
        seed=args.seed,
        progress_bar=not args.no_progress_bar,
        launcher=args.launcher,
        compile=compile_request(args) or False,
    )
    return 0
