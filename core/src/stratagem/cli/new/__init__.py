"""``stratagem new strategy|launcher|callback|logger NAME [--based-on BASE]``: write a plugin package that installs
with ``pip install ./NAME`` and is certified by ``stratagem contract`` as generated.

The package holds a pyproject with the entry point, a torch-free entry-point module, the plugin class with every
hook written out (delegating to a documented base where there is one), a README, tests that run the contract
suite, and a CI workflow running them on CPU. The templates are package data (``templates/``); the hooks come
from the specs (:mod:`stratagem.cli.new._hooks`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from stratagem import cli

_KINDS = ("strategy", "launcher", "callback", "logger")


def _add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "new",
        help="write a new plugin package (strategy, launcher, callback or logger) that certifies as generated",
        description="Write the folder NAME: a plugin package with its entry point, the class with every hook, a "
        "README, tests that run the contract suite, and a CI workflow. Install it with `pip install ./NAME`.",
    )
    p.add_argument("kind", choices=_KINDS, help="what the plugin provides")
    p.add_argument(
        "name", help="the registered name (lower-case letters, digits, underscores), e.g. acme_ddp"
    )
    p.add_argument(
        "--based-on",
        metavar="NAME",
        help="start from this installed strategy's (or launcher's) behaviour: the class subclasses it and every "
        "hook delegates to it (launchers default to elastic; strategies to data parallel written by hand)",
    )
    p.add_argument(
        "--directory",
        default=".",
        metavar="DIR",
        help="where to create the folder NAME (default: here)",
    )


@cli.command("new")
def _new(args: argparse.Namespace) -> int:
    from stratagem.cli.new._package import generate

    target = Path(args.directory) / args.name
    if target.exists():
        print(f"stratagem new: {target} exists already; choose another name or --directory.", file=sys.stderr)
        return 2
    files = generate(args.kind, args.name, args.based_on)
    for relative, text in files.items():
        path = target / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    listing = (
        "strategies" if args.kind == "strategy" else "launchers" if args.kind == "launcher" else "callbacks"
    )
    flag = "" if args.kind == "strategy" else f"--{args.kind} "
    print(f"Wrote {target}/ ({len(files)} files): the {args.kind} {args.name}.")
    print("Next:")
    print(f"  pip install -e {target}            # then `stratagem {listing}` lists it")
    entry = next(path for path in files if path.endswith("__init__.py"))
    certificate = target / Path(entry).parent / "stratagem-certificate.json"
    print(f"  stratagem contract {flag}{args.name} --report {certificate}")
    print(f"  see {target}/README.md")
    return 0


cli._PARSER_EXTENSIONS.append(_add_parser)
