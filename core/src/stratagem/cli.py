"""The ``stratagem`` command. Each subcommand imports what it needs when it runs, so that
``stratagem strategies`` answers without importing torch."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence

_COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {}


def command(
    name: str,
) -> Callable[[Callable[[argparse.Namespace], int]], Callable[[argparse.Namespace], int]]:
    def decorate(function: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
        _COMMANDS[name] = function
        return function

    return decorate


# -------------------------------------------------------------------------------------------------
# stratagem strategies
# -------------------------------------------------------------------------------------------------


def _strategy_rows(as_json: bool) -> tuple[list[dict], list[dict], list[dict]]:
    from stratagem._manager import get_registry

    registry = get_registry()
    rows = [info.to_json() for info in registry]
    broken = [
        {
            "entry_point": b.entry_point,
            "distribution": b.distribution,
            "version": b.version,
            "error": str(b.error),
        }
        for b in registry.broken
    ]
    conflicts = [
        {"name": n, "distributions": list(c.distributions), "error": str(c)}
        for n, c in registry.conflicts.items()
    ]
    return rows, broken, conflicts


@command("strategies")
def _strategies(args: argparse.Namespace) -> int:
    rows, broken, conflicts = _strategy_rows(args.json)
    if args.json:
        print(json.dumps({"strategies": rows, "broken": broken, "conflicts": conflicts}, indent=2))
        return 0
    width = max([len(r["name"]) for r in rows] + [4])
    for row in rows:
        caps = row["capabilities"]
        low, high = caps["world_sizes"]
        sizes = f"{low}" if low == high else f"{low}..{high if high is not None else 'n'}"
        print(f"{row['name']:<{width}}  {row['description']}")
        print(
            f"{'':<{width}}  from {row['distribution']} {row['version']}; accelerators {','.join(caps['accelerators'])}; "
            f"precisions {','.join(caps['precisions'])}; checkpoints {','.join(caps['checkpoint_formats'])}; "
            f"world size {sizes}"
        )
        if row["missing"]:
            quoted = " ".join(f"'{m}'" for m in row["missing"])
            print(f"{'':<{width}}  needs {', '.join(row['missing'])}: pip install {quoted}")
    for item in broken:
        print(f"BROKEN  {item['entry_point']} ({item['distribution']} {item['version']}): {item['error']}")
    for item in conflicts:
        print(f"CONFLICT  {item['error']}")
    return 0


@command("launchers")
def _launchers(args: argparse.Namespace) -> int:
    from stratagem._manager import get_registry

    rows = [info.to_json() for _, info in sorted(get_registry().launchers.items())]
    if args.json:
        print(json.dumps({"launchers": rows}, indent=2))
        return 0
    width = max([len(r["name"]) for r in rows] + [4])
    for row in rows:
        caps = row["capabilities"]
        nodes = "several nodes" if caps["multi_node"] else "one node"
        print(f"{row['name']:<{width}}  {row['description']}")
        print(
            f"{'':<{width}}  from {row['distribution']} {row['version']}; accelerators "
            f"{','.join(caps['accelerators'])}; {nodes}"
        )
        if row["missing"]:
            quoted = " ".join(f"'{m}'" for m in row["missing"])
            print(f"{'':<{width}}  needs {', '.join(row['missing'])}: pip install {quoted}")
    return 0


@command("callbacks")
def _callbacks(args: argparse.Namespace) -> int:
    from stratagem._manager import get_registry

    registry = get_registry()
    tables = {"callbacks": registry.callbacks, "loggers": registry.loggers}
    rows = {kind: [info.to_json() for _, info in sorted(table.items())] for kind, table in tables.items()}
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    width = max([len(r["name"]) for kind in rows.values() for r in kind] + [4])
    for kind, entries in rows.items():
        print(f"{kind} (Trainer({kind}=[...]), by name):")
        for row in entries:
            print(
                f"  {row['name']:<{width}}  {row['description']} (from {row['distribution']} {row['version']})"
            )
            if row["missing"]:
                print(f"  {'':<{width}}  needs {', '.join(row['missing'])}: pip install {row['install']}")
    return 0


# -------------------------------------------------------------------------------------------------
# parser
# -------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stratagem", description="Distributed-training strategies by name.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("strategies", help="list installed strategies and their declared capabilities")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p = sub.add_parser("launchers", help="list installed launchers (how workers start) and what they can run")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p = sub.add_parser("callbacks", help="list the callbacks and loggers a Trainer can name")
    p.add_argument("--json", action="store_true", help="machine-readable output")

    for extend in _PARSER_EXTENSIONS:
        extend(sub)
    return parser


#: Other modules add their subcommands here (kept in their own modules so this one stays light).
_PARSER_EXTENSIONS: list[Callable[[argparse._SubParsersAction], None]] = []


def _load_extensions() -> None:
    import importlib

    for module in (
        "stratagem.cli_run",
        "stratagem.cli_checkpoint",
        "stratagem.cli_compare",
        "stratagem.cli_contract",
    ):
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as error:
            if error.name != module:
                raise


def main(argv: Sequence[str] | None = None) -> int:
    _load_extensions()
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return _COMMANDS[args.command](args)
    except KeyboardInterrupt:
        return 130
    except Exception as error:
        from stratagem.errors import StratagemError

        if isinstance(error, StratagemError):
            print(f"stratagem: {error}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    # Under `python -m stratagem.cli` this file runs as __main__, a second copy of the module; subcommand
    # modules register on the importable `stratagem.cli`, so dispatch through that one.
    from stratagem.cli import main as _main

    sys.exit(_main())
