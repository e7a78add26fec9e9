"""``stratagem doctor``: load every entry point of the ``stratagem`` group and every name it registers, check
each against the hook specs and its declarations, and print one table; exit 1 when anything is wrong.

It honours ``STRATAGEM_PLUGINS`` and ``STRATAGEM_DISABLE_PLUGINS`` as every other command does (a disabled
plugin is a row of its own, never imported). Unlike the listings it imports each registered class, torch
included: that is where a wrong hook signature shows.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from stratagem import cli


def _add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "doctor",
        help="check every installed plugin: hook signatures, declarations, clashes, missing requirements",
        description="Load every plugin and every name it registers; check each hook implementation against the "
        "specs, the declared capabilities, name clashes, missing requirements and shipped certificates. Exits 1 "
        "when anything is wrong.",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")


def _disable_hint(entry_points: dict[str, list[str]], distribution: str) -> str:
    names = entry_points.get(distribution) or ["NAME"]
    return f"STRATAGEM_DISABLE_PLUGINS={','.join(names)}"


def _entry_points_by_distribution() -> dict[str, list[str]]:
    from stratagem.registry._manager import _entry_points

    found: dict[str, list[str]] = {}
    for ep in _entry_points():
        found.setdefault(ep.dist.name if ep.dist else "(unknown)", []).append(ep.name)
    return found


def _plugin_rows(registry: Any, entry_points: dict[str, list[str]]) -> list[Any]:
    """Rows for what went wrong before any name was registered: imports, registrations, clashes."""
    from stratagem.cli.doctor._checks import DISABLED, ERROR, Finding
    from stratagem.errors import StrategyConflictError
    from stratagem.registry._manager import DISABLE_ENV, _entry_points

    rows = []
    for broken in registry.broken:
        name = broken.entry_point.split(" = ")[0].split(" -> ")[0]
        row = Finding("plugin", name, broken.distribution, broken.version)
        if isinstance(broken.error, StrategyConflictError):
            first, second = broken.error.distributions
            row.add(
                ERROR,
                f"registers {broken.error.name!r}, which {first} registers too: only the first loaded counts. "
                f"Uninstall one, or {_disable_hint(entry_points, second)}",
            )
        else:
            row.add(
                ERROR,
                f"{type(broken.error).__name__}: {broken.error}. Fix or upgrade {broken.distribution}, or keep it "
                f"from loading: {_disable_hint(entry_points, broken.distribution)}",
            )
        rows.append(row)
    for name, conflict in sorted(registry.conflicts.items()):
        first, second = conflict.distributions
        row = Finding("strategy", name, f"{first} + {second}", "")
        row.add(
            ERROR,
            f"both {first} and {second} register the strategy {name!r}, so neither is usable. Uninstall one, or "
            f"{_disable_hint(entry_points, second)}",
        )
        rows.append(row)
    seen: dict[str, str] = {}
    for ep in _entry_points():
        dist = ep.dist.name if ep.dist else "(unknown)"
        if ep.name in seen and seen[ep.name] != dist:
            row = Finding("plugin", ep.name, f"{seen[ep.name]} + {dist}", "")
            row.add(
                ERROR,
                f"two distributions declare the entry point {ep.name!r}: STRATAGEM_PLUGINS and "
                f"{DISABLE_ENV} cannot tell them apart. Rename one's entry point",
            )
            rows.append(row)
        seen.setdefault(ep.name, dist)
    for plugin in registry.disabled:
        row = Finding("plugin", plugin.name, plugin.distribution, plugin.version)
        row.add(DISABLED, f"not loaded: {DISABLE_ENV} names it")
        rows.append(row)
    return rows


def _entry_row(kind: str, info: Any) -> Any:
    from stratagem.cli.doctor import _checks as checks
    from stratagem.cli.listing import certificate_status
    from stratagem.registry._manager import LAUNCHER_HOOKS, PLAN_HOOKS, STRATEGY_HOOKS
    from stratagem.registry._registry import _load_factory
    from stratagem.registry.capabilities import Capabilities, LauncherCapabilities

    row = checks.Finding(kind, info.name, info.plugin.distribution, info.plugin.version)
    if kind in ("strategy", "launcher"):
        expected = Capabilities if kind == "strategy" else LauncherCapabilities
        if not isinstance(info.capabilities, expected):
            row.add(
                checks.ERROR, f"capabilities={info.capabilities!r}: declare a stratagem.{expected.__name__}"
            )
            return row
        missing = info.capabilities.missing_requirements()
    else:
        missing = info.missing_requirements()
    for requirement in checks.missing_dependencies(info.plugin.distribution):
        row.add(
            checks.ERROR,
            f"{info.plugin.distribution} needs {requirement}, not installed: pip install '{requirement}'",
        )
    if missing:
        install = " ".join(f"'{m}'" for m in (getattr(info, "install", None) or missing))
        row.add(checks.NOTE, f"needs {', '.join(missing)} (not installed): pip install {install}")
        return row
    try:
        cls = _load_factory(info.name, info.factory, info.plugin)
    except Exception as error:
        cause = error.__cause__ or error
        row.add(checks.ERROR, f"importing {info.factory!r} failed: {type(cause).__name__}: {cause}")
        return row
    if kind == "strategy":
        from stratagem.strategies.base import Strategy

        # A strategy's hooks: those of a run, and the plan's (Strategy's own answers "simulate me").
        problems = checks.check_hook_class(
            cls, Strategy, "stratagem.strategies.Strategy", STRATEGY_HOOKS | PLAN_HOOKS
        )
        if not problems:
            problems = checks.check_contract_declarations(cls, info.capabilities)
    elif kind == "launcher":
        from stratagem.launchers.launcher import Launcher

        problems = checks.check_hook_class(cls, Launcher, "stratagem.launchers.Launcher", LAUNCHER_HOOKS)
    else:
        problems = checks.check_event_class(cls, kind)
    for problem in problems:
        row.add(checks.ERROR, problem)
    status, why_not = certificate_status(kind, info)
    if status:
        row.details.append(status)
    elif why_not:
        row.add(checks.NOTE, f"ships a certificate that does not certify it: {why_not}")
    return row


def diagnose() -> list[Any]:
    """One finding per plugin problem and per registered name, from a fresh discovery."""
    from stratagem.registry._manager import discover

    registry, _ = discover()
    entry_points = _entry_points_by_distribution()
    rows = _plugin_rows(registry, entry_points)
    rows += [_entry_row("strategy", info) for info in registry]
    rows += [_entry_row("launcher", info) for _, info in sorted(registry.launchers.items())]
    rows += [_entry_row("callback", info) for _, info in sorted(registry.callbacks.items())]
    rows += [_entry_row("logger", info) for _, info in sorted(registry.loggers.items())]
    return rows


@cli.command("doctor")
def _doctor(args: argparse.Namespace) -> int:
    import attrs

    from stratagem.cli.doctor._checks import ERROR

    rows = diagnose()
    errors = [row for row in rows if row.status == ERROR]
    if args.json:
        print(json.dumps({"findings": [attrs.asdict(r) for r in rows], "errors": len(errors)}, indent=2))
        return 1 if errors else 0
    headers = ("status", "kind", "name", "from")
    table = [
        (
            r.status.upper() if r.status == ERROR else r.status,
            r.kind,
            r.name,
            f"{r.distribution} {r.version}".strip(),
        )
        for r in rows
    ]
    widths = [max(len(h), *(len(t[i]) for t in table)) for i, h in enumerate(headers)]
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths)) + "  details")
    for row, cells in zip(rows, table):
        line = "  ".join(c.ljust(w) for c, w in zip(cells, widths))
        print(f"{line}  {'; '.join(row.details) or '-'}")
    if errors:
        print(f"\n{len(errors)} problem(s); each row says what to do.", file=sys.stderr)
        return 1
    print(f"\n{len(rows)} entries: nothing wrong.")
    return 0


cli._PARSER_EXTENSIONS.append(_add_parser)
