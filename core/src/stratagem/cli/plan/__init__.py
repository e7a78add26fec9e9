"""``stratagem plan``: which strategy fits a model on a cluster, and with how much memory per device, found by
setting the model up under each strategy as ranks of a simulated world (:mod:`stratagem.planning`)."""

from __future__ import annotations

import argparse

from stratagem import cli


def _add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="per-device memory of a model under each strategy on a simulated cluster (no devices used)",
        description="Set the model up under each installed strategy as the ranks of a simulated world of "
        "--devices x --nodes processes, in this process, on fake tensors (shapes without storage), through "
        "each strategy's own hooks; print what the largest rank holds (parameters, gradients, optimizer "
        "state, activations of one micro-batch), what it sends per step, and whether it fits --memory.",
    )
    p.add_argument(
        "--model",
        required=True,
        help="demo (with --size), PATH/config.json (a Hugging Face config), or package.module:Class / "
        "path/file.py:Class (a stratagem.Module built without arguments; example_batch(batch_size, "
        "generator) for a step)",
    )
    p.add_argument("--size", default=None, help="--model demo only: parameters, e.g. 1B, 70B, 1T")
    p.add_argument("--devices", type=int, required=True, help="devices (processes) per node")
    p.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    p.add_argument("--memory", default=None, help="memory per device, with its unit: 80GB, 80GiB, 24GiB")
    p.add_argument("--precision", default="32-true", help="32-true (default), bf16-mixed, bf16-true, ...")
    p.add_argument("--optimizer", default="adamw", help="adamw (default), adam or sgd")
    p.add_argument("--batch", type=int, default=1, help="samples in one rank's micro-batch (default 1)")
    p.add_argument("--seq", type=int, default=2048, help="tokens per sample (default 2048)")
    p.add_argument(
        "--strategies",
        default=None,
        help="comma-separated names, each optionally with options in brackets: "
        "fsdp,fsdp_tp[tensor_parallel_size=8] (default: every installed one that accepts the world size)",
    )
    p.add_argument(
        "--ranks",
        default="largest",
        choices=["largest", "all"],
        help="largest (default): rank 0 and the far end of each mesh dimension; all: every rank",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="processes simulating ranks at once (default: the cores this process may use; 1: one at a time)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


cli._PARSER_EXTENSIONS.append(_add_parser)


@cli.command("plan")
def _plan(args: argparse.Namespace) -> int:
    import json
    import sys

    from stratagem.cli.plan import _plan_models, _plan_output
    from stratagem.planning import World, parse_bytes, plan
    from stratagem.registry._labels import split_top_level

    memory = None if args.memory is None else parse_bytes(args.memory)
    world = World(
        devices=args.devices,
        nodes=args.nodes,
        precision=args.precision,
        optimizer=args.optimizer,
        batch_size=args.batch,
        sequence_length=args.seq,
    )
    workload = _plan_models.workload(args.model, args.size)
    strategies = None if args.strategies is None else split_top_level(args.strategies)
    progress = None if args.quiet else (lambda line: print(line, file=sys.stderr, flush=True))
    result = plan(
        workload,
        world,
        memory=memory,
        strategies=strategies,
        ranks=args.ranks,
        progress=progress,
        workers=args.workers,
    )
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        _plan_output.print_plan(result)
    planned = [s for s in result.strategies if s.largest is not None]
    return 0 if planned else 2
