"""``stratagem contract NAME... [--launcher NAME] [--callback NAME] [--logger NAME] [--report FILE]``: certify
plugins with the contract suite (pytest in a subprocess), optionally writing a certificate; ``stratagem contract
--verify FILE`` checks a certificate against its own outcomes, its declarations and what is installed."""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from stratagem import cli


def pytest_command(
    names: Sequence[str],
    extra: Sequence[str] = (),
    launchers: Sequence[str] = (),
    *,
    callbacks: Sequence[str] = (),
    loggers: Sequence[str] = (),
    report: str | None = None,
    share_launches: bool = False,
) -> list[str]:
    """The pytest command line that runs the contract suite on the given strategies and other plugins."""
    command = [
        sys.executable,
        "-m",
        "pytest",
        "--pyargs",
        "stratagem.contract",
        "-ra",
        "-p",
        "no:cacheprovider",
    ]
    for option, given in (
        ("--stratagem-strategy", names),
        ("--stratagem-launcher", launchers),
        ("--stratagem-callback", callbacks),
        ("--stratagem-logger", loggers),
    ):
        for name in given:
            command += [option, name]
    if report:
        command += ["--stratagem-report", str(Path(report).absolute())]
    if share_launches:
        command.append("--stratagem-share-launches")
    return [*command, *extra]


def _add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "contract",
        help="certify strategies, launchers, callbacks and loggers with the contract suite",
        description="Run `pytest --pyargs stratagem.contract` on the named plugins; --report writes a "
        "certificate, --verify checks one.",
    )
    p.add_argument("names", nargs="*", metavar="NAME", help="strategy names, or 'all'")
    for flag, kind, listing in (
        ("--launcher", "launcher", "launchers"),
        ("--callback", "callback", "callbacks"),
        ("--logger", "logger", "callbacks"),
    ):
        p.add_argument(
            flag,
            action="append",
            default=[],
            metavar="NAME",
            help=f"certify this {kind} too (repeatable, or 'all'); see `stratagem {listing}`",
        )
    p.add_argument(
        "--report",
        metavar="FILE",
        help="write the certificate (JSON) here; exits non-zero unless its verdict is passed",
    )
    p.add_argument(
        "--verify",
        metavar="FILE",
        help="check a certificate instead of running the suite: its verdict recomputed from its outcomes and "
        "declarations, its suite version, and what is installed",
    )
    p.add_argument(
        "--share-launches",
        action="store_true",
        help="certify the strategies of one world size in the same two launches (faster; a worker that "
        "crashes fails all of them)",
    )
    p.add_argument(
        "--pytest-args",
        default="",
        metavar="ARGS",
        help="more pytest arguments in one string, e.g. --pytest-args='-x --junitxml=report.xml'",
    )


@cli.command("contract")
def _contract(args: argparse.Namespace) -> int:
    import shlex

    if args.verify:
        return verify(args.verify)
    if not (args.names or args.launcher or args.callback or args.logger):
        print(
            "stratagem contract: name a strategy (`stratagem contract fsdp`), a launcher (`--launcher ray`), a "
            "callback (`--callback NAME`) or a logger (`--logger NAME`); `stratagem strategies`, `stratagem "
            "launchers` and `stratagem callbacks` list them. `--verify FILE` checks a certificate.",
            file=sys.stderr,
        )
        return 2
    command = pytest_command(
        args.names,
        shlex.split(args.pytest_args),
        args.launcher,
        callbacks=args.callback,
        loggers=args.logger,
        report=args.report,
        share_launches=args.share_launches,
    )
    # A subprocess: the suite launches workers and imports the plugins; this process stays clean.
    status = subprocess.call(command)
    if not args.report:
        return status
    return _after_report(Path(args.report), status)


def _after_report(path: Path, status: int) -> int:
    from stratagem.contract import _certificate as certificate

    if not path.exists():
        print(f"stratagem contract: the suite wrote no certificate (pytest exit {status})", file=sys.stderr)
        return status or 1
    document = certificate.load(path)
    if document.get("verdict") != "passed":
        reasons = [r for s in document["subjects"] for r in certificate.recompute(s)[1]]
        print(f"stratagem contract: verdict failed ({path}): " + "; ".join(reasons), file=sys.stderr)
        return status or 1
    return status


def installed_subjects(document: Any) -> dict[tuple[str, str], dict[str, Any]]:
    """What each subject of ``document`` that is installed here declares now, as a certificate records it."""
    from stratagem.contract import _certificate as certificate
    from stratagem.errors import StratagemError
    from stratagem.registry._manager import get_registry

    registry = get_registry()
    found: dict[tuple[str, str], dict[str, Any]] = {}
    subjects = document.get("subjects") if isinstance(document, dict) else None
    for subject in subjects if isinstance(subjects, list) else []:
        kind, name = subject.get("kind"), subject.get("registered_name")
        try:
            if kind == "strategy":
                info = registry.get(name)
            elif kind == "launcher":
                info = registry.get_launcher(name)
            elif kind in ("callback", "logger"):
                info = registry.get_callback(name, kind)
            else:
                continue
        except StratagemError:
            continue
        declarations = certificate.capability_declarations(kind, info)
        if kind == "strategy":
            from stratagem.contract._runner import subject_for

            declarations["contract_tolerance"] = subject_for(subject["name"]).tolerance
        found[(kind, name)] = {
            "distribution": info.plugin.distribution,
            "version": info.plugin.version,
            "declarations": declarations,
        }
    return found


def verify(path: str) -> int:
    from stratagem.contract import _certificate as certificate

    try:
        document = certificate.load(path)
    except (OSError, ValueError) as error:
        print(f"stratagem contract --verify: {error}", file=sys.stderr)
        return 2
    installed = installed_subjects(document)
    problems = certificate.problems(document, installed)
    if problems:
        print(f"{path}: REJECTED", file=sys.stderr)
        for problem in problems:
            print(f"  - {problem}", file=sys.stderr)
        return 1
    for subject in document["subjects"]:
        tally = ", ".join(f"{n} {k.replace('_', ' ')}" for k, n in certificate.counts(subject).items() if n)
        where = (
            "installed here"
            if (subject["kind"], subject["registered_name"]) in installed
            else "not installed here"
        )
        print(f"{certificate.label(subject)}: passed ({tally}; {where})")
    print(
        f"{path}: valid; verdict passed, contract suite {document['suite_version']}, stratagem "
        f"{document['stratagem_version']}, torch {document['torch_version']}, Python {document['python_version']}"
    )
    return 0


cli._PARSER_EXTENSIONS.append(_add_parser)
