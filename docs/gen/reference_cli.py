"""The command line's page, generated from the argument parsers the ``stratagem`` command itself builds
(``stratagem.cli.build_parser`` after its command modules have added theirs): every command, subcommand and
argument, with its help, choices and default."""

from __future__ import annotations

import argparse
import importlib


def parser() -> argparse.ArgumentParser:
    cli = importlib.import_module("stratagem.cli")
    cli._load_extensions()
    return cli.build_parser()


def _subcommands(p: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    """``[(name, help, parser), ...]`` of ``p``'s subcommands, in the order they were added."""
    found = []
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
            found += [(name, helps.get(name, ""), sub) for name, sub in action.choices.items()]
    return found


def _cell(text: object) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _argument_row(p: argparse.ArgumentParser, action: argparse.Action) -> str:
    formatter = p._get_formatter()
    if action.option_strings:
        names = ", ".join(f"`{o}`" for o in action.option_strings)
        takes = "" if action.nargs == 0 else formatter._format_args(action, action.dest.upper())
    else:
        names = f"`{formatter._metavar_formatter(action, action.dest)(1)[0]}`"
        takes = {
            "?": "optional",
            "*": "zero or more",
            "+": "one or more",
            argparse.REMAINDER: "the rest",
        }.get(
            action.nargs,
            "",  # type: ignore[arg-type]
        )
    if action.choices is not None:
        takes = "one of " + ", ".join(f"`{c}`" for c in action.choices)
    elif takes and action.option_strings:
        takes = f"`{takes}`"
    default = action.default
    shown_default = (
        ""
        if default in (None, False, argparse.SUPPRESS) or action.nargs == 0 or default == []
        else f"`{default}`"
    )
    help_text = formatter._expand_help(action) if action.help else ""
    return f"| {names} | {_cell(takes)} | {_cell(shown_default)} | {_cell(help_text)} |"


def _command_section(path: str, help_text: str, p: argparse.ArgumentParser, level: int) -> list[str]:
    p.formatter_class = lambda prog: argparse.HelpFormatter(prog, width=100)
    lines = [f"{'#' * level} `{path}`", ""]
    if help_text:
        lines += [help_text[:1].upper() + help_text[1:] + ".", ""]
    if p.description and p.description != help_text:
        lines += [p.description, ""]
    lines += ["```text", p.format_usage().strip(), "```", ""]
    rows = [
        _argument_row(p, a)
        for a in p._actions
        if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))
    ]
    if rows:
        lines += ["| argument | takes | default | what it does |", "| --- | --- | --- | --- |", *rows, ""]
    for name, sub_help, sub in _subcommands(p):
        lines += _command_section(f"{path} {name}", sub_help, sub, min(level + 1, 4))
    return lines


def cli_page() -> str:
    top = parser()
    lines = [
        "# Command line",
        "",
        "Every command of `stratagem` (also `python -m stratagem`), generated from its argument parsers when "
        "the site is built. `stratagem COMMAND --help` prints the same.",
        "",
        "| command | what it does |",
        "| --- | --- |",
    ]
    commands = _subcommands(top)
    lines += [f"| [`{name}`](#stratagem-{name}) | {_cell(help_text)} |" for name, help_text, _ in commands]
    lines.append("")
    for name, help_text, sub in commands:
        lines += _command_section(f"stratagem {name}", help_text, sub, 2)
    return "\n".join(lines) + "\n"
