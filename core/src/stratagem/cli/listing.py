"""``stratagem strategies``, ``stratagem launchers`` and ``stratagem callbacks``: what is installed, with each
entry's distribution, declared capabilities and certificate, and the plugins ``STRATAGEM_DISABLE_PLUGINS``
kept from loading (torch is never imported; a certificate is a JSON file the plugin ships)."""

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


_shipped: dict[str, tuple[object, str]] = {}


def certificate_status(kind: str, info: object) -> tuple[str, str]:
    """``("certified" | "certified for X.Y" | "", why not)`` from the certificate the entry's plugin ships."""
    import os

    from stratagem.contract import CERTIFICATE_FILE

    plugin = info.plugin  # type: ignore[attr-defined]
    if not plugin.location or not os.path.isfile(os.path.join(plugin.location, CERTIFICATE_FILE)):
        return "", ""
    from stratagem.contract import _certificate as certificate

    if plugin.location not in _shipped:
        _shipped[plugin.location] = certificate.shipped_certificate(plugin.location)
    document, problem = _shipped[plugin.location]
    if document is None:
        return "", problem
    declarations = certificate.capability_declarations(kind, info)
    name = info.name  # type: ignore[attr-defined]
    return certificate.shipped_status(document, kind, name, plugin.distribution, plugin.version, declarations)


def _row(kind: str, info: object) -> dict:
    row = info.to_json()  # type: ignore[attr-defined]
    row["certificate"], problem = certificate_status(kind, info)
    if problem:
        row["certificate_problem"] = problem
    return row


def _origin(row: dict) -> str:
    status = f" ({row['certificate']})" if row.get("certificate") else ""
    return f"from {row['distribution']} {row['version']}{status}"


def _disabled_rows() -> list[dict]:
    from stratagem.registry._manager import DISABLE_ENV, get_registry

    return [
        {
            "entry_point": d.name,
            "distribution": d.distribution,
            "version": d.version,
            "disabled_by": DISABLE_ENV,
        }
        for d in sorted(get_registry().disabled, key=lambda d: d.name)
    ]


def _broken_rows() -> list[dict]:
    from stratagem.registry._manager import get_registry

    return [
        {
            "entry_point": b.entry_point,
            "distribution": b.distribution,
            "version": b.version,
            "error": str(b.error),
        }
        for b in get_registry().broken
    ]


def _print_broken(rows: list[dict]) -> None:
    for item in rows:
        print(f"BROKEN  {item['entry_point']} ({item['distribution']} {item['version']}): {item['error']}")


def _print_disabled(rows: list[dict]) -> None:
    for item in rows:
        print(
            f"DISABLED  {item['entry_point']} ({item['distribution']} {item['version']}): not loaded, "
            f"{item['disabled_by']} names it"
        )


def _strategy_rows(as_json: bool) -> tuple[list[dict], list[dict], list[dict]]:
    from stratagem.registry._manager import get_registry

    registry = get_registry()
    rows = [_row("strategy", info) for info in registry]
    broken = _broken_rows()
    conflicts = [
        {"name": n, "distributions": list(c.distributions), "error": str(c)}
        for n, c in registry.conflicts.items()
    ]
    return rows, broken, conflicts


@cli.command("strategies")
def _strategies(args: argparse.Namespace) -> int:
    rows, broken, conflicts = _strategy_rows(args.json)
    disabled = _disabled_rows()
    if args.json:
        listing = {"strategies": rows, "broken": broken, "conflicts": conflicts, "disabled": disabled}
        print(json.dumps(listing, indent=2))
        return 0
    width = max([len(r["name"]) for r in rows] + [4])
    for row in rows:
        caps = row["capabilities"]
        low, high = caps["world_sizes"]
        sizes = f"{low}" if low == high else f"{low}..{high if high is not None else 'n'}"
        print(f"{row['name']:<{width}}  {row['description']}")
        print(
            f"{'':<{width}}  {_origin(row)}; accelerators {','.join(caps['accelerators'])}; "
            f"precisions {','.join(caps['precisions'])}; checkpoints {','.join(caps['checkpoint_formats'])}; "
            f"world size {sizes}"
            + (
                ""
                if caps.get("auto_priority") is None
                else f"; strategy='auto' priority {caps['auto_priority']}"
            )
        )
        if row["missing"]:
            quoted = " ".join(f"'{m}'" for m in row["missing"])
            print(f"{'':<{width}}  needs {', '.join(row['missing'])}: pip install {quoted}")
    _print_broken(broken)
    for item in conflicts:
        print(f"CONFLICT  {item['error']}")
    _print_disabled(disabled)
    return 0


@cli.command("launchers")
def _launchers(args: argparse.Namespace) -> int:
    from stratagem.registry._manager import get_registry

    rows = [_row("launcher", info) for _, info in sorted(get_registry().launchers.items())]
    broken, disabled = _broken_rows(), _disabled_rows()
    if args.json:
        print(json.dumps({"launchers": rows, "broken": broken, "disabled": disabled}, indent=2))
        return 0
    width = max([len(r["name"]) for r in rows] + [4])
    for row in rows:
        caps = row["capabilities"]
        nodes = "several nodes" if caps["multi_node"] else "one node"
        print(f"{row['name']:<{width}}  {row['description']}")
        print(f"{'':<{width}}  {_origin(row)}; accelerators {','.join(caps['accelerators'])}; {nodes}")
        if row["missing"]:
            quoted = " ".join(f"'{m}'" for m in row["missing"])
            print(f"{'':<{width}}  needs {', '.join(row['missing'])}: pip install {quoted}")
    _print_broken(broken)
    _print_disabled(disabled)
    return 0


@cli.command("callbacks")
def _callbacks(args: argparse.Namespace) -> int:
    from stratagem.registry._manager import get_registry

    registry = get_registry()
    tables = {"callbacks": registry.callbacks, "loggers": registry.loggers}
    rows = {
        kind: [_row(kind[:-1], info) for _, info in sorted(table.items())] for kind, table in tables.items()
    }
    broken, disabled = _broken_rows(), _disabled_rows()
    if args.json:
        print(json.dumps({**rows, "broken": broken, "disabled": disabled}, indent=2))
        return 0
    width = max([len(r["name"]) for kind in rows.values() for r in kind] + [4])
    for kind, entries in rows.items():
        print(f"{kind} (Trainer({kind}=[...]), by name):")
        for row in entries:
            print(f"  {row['name']:<{width}}  {row['description']} ({_origin(row)})")
            if row["missing"]:
                print(f"  {'':<{width}}  needs {', '.join(row['missing'])}: pip install {row['install']}")
    _print_broken(broken)
    _print_disabled(disabled)
    return 0
