"""The ``stratagem`` command: the parser and the dispatch. Each command lives in a module of this package
(:data:`COMMAND_MODULES`) and imports what it needs when it runs, so that ``stratagem strategies`` answers
without importing torch."""

from __future__ import annotations

import argparse
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
# parser
# -------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stratagem", description="Distributed-training strategies by name.")
    sub = parser.add_subparsers(dest="command", required=True)

    for extend in _PARSER_EXTENSIONS:
        extend(sub)
    return parser


#: One module per command (or group of commands); each adds its parser here and registers its function with
#: :func:`command`. None of them imports anything heavy at module level.
COMMAND_MODULES = (
    "stratagem.cli.listing",
    "stratagem.cli.run",
    "stratagem.cli.demo",
    "stratagem.cli.checkpoint",
    "stratagem.cli.compare._command",
    "stratagem.cli.contract",
    "stratagem.cli.new",
    "stratagem.cli.doctor",
    "stratagem.cli.plan",
)
#: The module of each command: a command line that names one imports that module alone (the listings answer
#: sooner without the others' parsers and imports); anything else (``--help``, a wrong name) imports them all.
#: ``core/tests/test_cli.py`` checks it against what the modules register.
COMMAND_MODULE = {
    "strategies": "stratagem.cli.listing",
    "launchers": "stratagem.cli.listing",
    "callbacks": "stratagem.cli.listing",
    "run": "stratagem.cli.run",
    "demo": "stratagem.cli.demo",
    "checkpoint": "stratagem.cli.checkpoint",
    "compare": "stratagem.cli.compare._command",
    "contract": "stratagem.cli.contract",
    "new": "stratagem.cli.new",
    "doctor": "stratagem.cli.doctor",
    "plan": "stratagem.cli.plan",
}
#: Other modules add their subcommands here (kept in their own modules so this one stays light).
_PARSER_EXTENSIONS: list[Callable[[argparse._SubParsersAction], None]] = []


def _load_extensions(modules: Sequence[str] = COMMAND_MODULES) -> None:
    import importlib

    for module in modules:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as error:
            if error.name != module:
                raise


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    only = COMMAND_MODULE.get(argv[0]) if argv else None
    _load_extensions(COMMAND_MODULES if only is None else (only,))
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
