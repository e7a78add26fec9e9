"""``stratagem run``: start a script in N workers (also across nodes) through a launcher."""

from __future__ import annotations

import argparse
import os
import sys

from stratagem import cli


def _add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run",
        help="run a training script in N worker processes (torch's elastic agent)",
        description="Start SCRIPT in --devices workers per node with the rank environment set. For several "
        "nodes, run the same command on each with its --node-rank and the same --rdzv-endpoint.",
    )
    p.add_argument(
        "--strategy",
        default=None,
        help="strategy for Engine/Trainer(strategy='auto') in the script: a name, with options in brackets if "
        "any (fsdp_tp[tensor_parallel_size=2])",
    )
    p.add_argument("--devices", type=int, default=1, help="workers per node (default 1)")
    p.add_argument("--accelerator", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument(
        "--nnodes",
        default="1",
        help="number of nodes, or MIN:MAX for elastic membership (c10d rendezvous: a lost node's peers go on)",
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="restart the worker group this many times after a failure; the Trainer resumes from the newest "
        "complete checkpoint",
    )
    p.add_argument("--node-rank", type=int, default=None, help="this node's index (0 hosts the rendezvous)")
    p.add_argument(
        "--rdzv-endpoint", default=None, help="host:port of the rendezvous, the same on every node"
    )
    p.add_argument(
        "--rdzv-conf",
        default="",
        help="c10d rendezvous settings as key=value,... (e.g. last_call_timeout=5,join_timeout=600)",
    )
    p.add_argument(
        "--launcher",
        default=None,
        help="how the workers start: 'elastic' (torch's agent, the default) or an installed launcher plugin "
        "(`stratagem launchers` lists them)",
    )
    _add_compile_arguments(p, "the script's Engine.setup/Trainer where it passes no compile=")
    p.add_argument("script", help="the script to run (or -m followed by a module)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")


def _add_compile_arguments(p: argparse.ArgumentParser, where: str) -> None:
    p.add_argument(
        "--compile",
        action="store_true",
        help=f"torch.compile the model in {where} (after tensor parallelism and activation checkpointing, "
        "before data-parallel wrapping; each repeated block once)",
    )
    p.add_argument(
        "--compile-options",
        default=None,
        metavar="KEY=VALUE,...",
        help="compile options (implies --compile): backend, mode, fullgraph, dynamic, regional, e.g. "
        "backend=aot_eager or mode=max-autotune-no-cudagraphs",
    )


def compile_request(args: argparse.Namespace) -> str | None:
    """``--compile``/``--compile-options`` as the text ``STRATAGEM_COMPILE`` takes, checked (an unknown backend
    or mode fails here, naming those that exist); ``None`` without either."""
    if not args.compile and args.compile_options is None:
        return None
    text = args.compile_options or "1"
    from stratagem.strategies.compiling import compile_options

    compile_options(text)
    return text


cli._PARSER_EXTENSIONS.append(_add_parsers)


def _check_positive(name: str, value: int) -> None:
    from stratagem.errors import ConfigurationError

    if value < 1:
        raise ConfigurationError(f"{name} {value}: give a positive number.")


@cli.command("run")
def _run(args: argparse.Namespace) -> int:
    from stratagem.engine import STRATEGY_ENV
    from stratagem.errors import ConfigurationError
    from stratagem.launchers import _worker_start
    from stratagem.launchers.cluster import resolve_accelerator

    _check_positive("--devices", args.devices)
    _, max_nodes = _worker_start.parse_nnodes(args.nnodes)
    _worker_start.check_max_restarts(args.max_restarts)
    if args.script == "-m":
        if not args.args:
            raise ConfigurationError("stratagem run -m needs a module name.")
        command = [sys.executable, "-m", *args.args]
    else:
        if not os.path.isfile(args.script):
            raise ConfigurationError(f"{args.script}: no such script.")
        command = [sys.executable, args.script, *args.args]
    env = {}
    compile = compile_request(args)
    if compile is not None:
        from stratagem.engine import COMPILE_ENV

        env[COMPILE_ENV] = compile
    strategy: dict[str, object] = {}
    if args.strategy:
        from stratagem.registry._labels import parse_label
        from stratagem.registry._manager import get_registry

        # An unknown name fails here, naming the installed ones; the workers' strategy checks the options.
        name, options = (
            parse_label(args.strategy, "--strategy") if "[" in args.strategy else (args.strategy, {})
        )
        get_registry().get(name)
        env[STRATEGY_ENV] = args.strategy
        strategy = {"strategy": name, "strategy_options": options}
    from stratagem.engine import DEFAULT_LAUNCHER, LAUNCHER_ENV
    from stratagem.launchers import LaunchJob
    from stratagem.registry._manager import LauncherHooks, get_registry

    accelerator = resolve_accelerator(args.accelerator)
    name = args.launcher or os.environ.get(LAUNCHER_ENV) or DEFAULT_LAUNCHER
    info = get_registry().check_launcher(name, accelerator=accelerator, num_nodes=max_nodes)
    if max_nodes > 1 and not args.rdzv_endpoint and not info.capabilities.starts_all_nodes:
        raise ConfigurationError("--nnodes > 1 needs --rdzv-endpoint host:port (the same on every node).")
    chosen = info.create()
    job = LaunchJob(
        kind="script",
        command=command,
        nproc_per_node=args.devices,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        rdzv_endpoint=args.rdzv_endpoint,
        rdzv_configs=_rdzv_conf(args.rdzv_conf),
        accelerator=accelerator,
        env=_worker_start.worker_environment(accelerator, env, args.devices),
        max_restarts=args.max_restarts,
        **strategy,
    )
    LauncherHooks(chosen).launch_workers(job)
    return 0


def _rdzv_conf(text: str) -> dict[str, str]:
    from stratagem.errors import ConfigurationError

    conf = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigurationError(f"--rdzv-conf {text!r}: give key=value pairs separated by commas.")
        conf[key.strip()] = value.strip()
    return conf
