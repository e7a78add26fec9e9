"""``stratagem contract NAME... [--launcher NAME]``: certify strategies and launchers with the contract suite
(pytest in a subprocess)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Sequence

from stratagem import cli


def pytest_command(
    names: Sequence[str],
    extra: Sequence[str] = (),
    launchers: Sequence[str] = (),
    share_launches: bool = False,
) -> list[str]:
    """The pytest command line that runs the contract suite on the strategies ``names`` and ``launchers``."""
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
    for name in launchers:
        command += ["--stratagem-launcher", name]
    if share_launches:
        command.append("--stratagem-share-launches")
    return [*command, *extra]


def _add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "contract",
        help="certify strategies (and launchers) with the contract suite",
        description="Run `pytest --pyargs stratagem.contract` on the named strategies and launchers.",
    )
    p.add_argument("names", nargs="*", metavar="NAME", help="strategy names, or 'all'")
    p.add_argument(
        "--launcher",
        action="append",
        default=[],
        metavar="NAME",
        help="certify this launcher too (repeatable, or 'all'); see `stratagem launchers`",
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

    if not args.names and not args.launcher:
        print(
            "stratagem contract: name a strategy (`stratagem contract fsdp`) or a launcher "
            "(`stratagem contract --launcher ray`); `stratagem strategies` and `stratagem launchers` list them.",
            file=sys.stderr,
        )
        return 2
    # A subprocess: the suite launches workers and imports the strategies; this process stays clean.
    command = pytest_command(args.names, shlex.split(args.pytest_args), args.launcher, args.share_launches)
    return subprocess.call(command)


cli._PARSER_EXTENSIONS.append(_add_parser)
