"""``stratagem strategies``, ``stratagem launchers`` and ``stratagem callbacks``: what is installed, with each
entry's distribution and declared capabilities (torch is never imported)."""

from __future__ import annotations

import argparse
import json

from stratagem import cli


def _add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("strategies", help="list installed strategies and their declared capabilities")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p = sub.add_parser("launchers", help="list installed launchers (how workers start) and what they can run")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p = sub.add_parser("callbacks", help="list the callbacks and loggers a Trainer can name")
    p.add_argument("--json", action="store_true", help="machine-readable output")


cli._PARSER_EXTENSIONS.append(_add_parsers)


def _strategy_rows(as_json: bool) -> tuple[list[dict], list[dict], list[dict]]:
    from stratagem.registry._manager import get_registry

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


@cli.command("strategies")
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


@cli.command("launchers")
def _launchers(args: argparse.Namespace) -> int:
    from stratagem.registry._manager import get_registry

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


@cli.command("callbacks")
def _callbacks(args: argparse.Namespace) -> int:
    from stratagem.registry._manager import get_registry

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
