"""``stratagem compare``: memory and speed of several strategies on the same model (see :mod:`stratagem.cli.compare`)."""

from __future__ import annotations

import argparse
import json

from stratagem import cli


def _add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "compare",
        help="train the same model under several strategies; table of memory per rank and it/s",
        description="Run each strategy in turn (a multi-process launch each) on the same model and data, and "
        "print peak memory per rank, the bytes of parameters + gradients + optimizer state per rank, and "
        "iterations per second, one column per strategy.",
    )
    p.add_argument(
        "--strategies",
        required=True,
        help="comma-separated registered names, each optionally with options in brackets: "
        "ddp,fsdp,fsdp[SHARD_GRAD_OP],fsdp[NO_SHARD],fsdp_cpu_offload (a bare value in brackets is the "
        "sharding_strategy; otherwise key=value,...)",
    )
    p.add_argument("--devices", type=int, default=2, help="processes (default 2)")
    p.add_argument("--accelerator", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument(
        "--model",
        default="medium",
        help="small (0.07 M parameters), medium (50 M, default), or PATH:Class (a .py file or module and a "
        "model class with example_batch(batch_size, generator))",
    )
    p.add_argument("--steps", type=int, default=20, help="training steps per strategy (default 20)")
    p.add_argument("--batch-size", type=int, default=16, help="samples per rank and step (default 16)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default=None, metavar="OUT.png", help="also draw the table as a bar chart")
    p.add_argument("--json", action="store_true", help="print the measurements as JSON instead of a table")
    p.add_argument("--no-progress-bar", action="store_true")


cli._PARSER_EXTENSIONS.append(_add_parser)


@cli.command("compare")
def _compare(args: argparse.Namespace) -> int:
    from stratagem.cli import compare

    columns = compare.parse_columns(args.strategies)
    if args.plot:
        compare.require_matplotlib()
    results = compare.run(
        columns,
        model=args.model,
        steps=args.steps,
        devices=args.devices,
        accelerator=args.accelerator,
        batch_size=args.batch_size,
        seed=args.seed,
        progress=not args.no_progress_bar,
    )
    if args.json:
        data = compare.to_json(
            results, model=args.model, devices=args.devices, steps=args.steps, batch_size=args.batch_size
        )
        if args.plot:
            data["plot"] = args.plot
        print(json.dumps(data, indent=2))
    else:
        print(compare.format_table(results, model=args.model, devices=args.devices, steps=args.steps))
    if args.plot:
        compare.plot(results, args.plot, model=args.model, devices=args.devices)
        if not args.json:
            print(f"Plot written to {args.plot}")
    return 0
