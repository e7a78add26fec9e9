"""``stratagem contract NAME...``: certify strategies with the contract suite (pytest in a subprocess)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Sequence

from stratagem import cli


def pytest_command(names: Sequence[str], extra: Sequence[str] = ()) -> list[str]:
    """The pytest command line that runs the contract suite on ``names``."""
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
    for name in names:
        command += ["--stratagem-strategy", name]
    return [*command, *extra]


def _add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "contract",
        help="certify strategies with the contract suite",
        description="Run `pytest --pyargs stratagem.contract` on the named strategies.",
    )
    p.add_argument("names", nargs="+", metavar="NAME", help="strategy names, or 'all'")
    p.add_argument(
        "--pytest-args",
        default="",
        metavar="ARGS",
        help="more pytest arguments in one string, e.g. --pytest-args='-x --junitxml=report.xml'",
    )


@cli.command("contract")
def _contract(args: argparse.Namespace) -> int:
    import shlex

    # A subprocess: the suite launches workers and imports the strategies; this process stays clean.
    return subprocess.call(pytest_command(args.names, shlex.split(args.pytest_args)))


cli._PARSER_EXTENSIONS.append(_add_parser)
