"""The files of a generated plugin package, by path inside its folder."""

from __future__ import annotations

import textwrap

from stratagem.cli.new import _hooks
from stratagem.cli.new._render import Base, check_name, render, resolve_base, template, values


def _hook_names(kind: str) -> list[str]:
    from stratagem import hookspecs
    from stratagem.registry._manager import STRATEGY_HOOKS

    if kind == "strategy":
        return sorted(STRATEGY_HOOKS)
    if kind == "launcher":
        return ["launch_workers"]
    return list(hookspecs.TRAINER_EVENTS)


def _texts(kind: str, name: str, base: Base | None) -> dict[str, str]:
    """What the module, its class and the README say about where the plugin starts from."""
    if kind == "strategy" and base is None:
        return {
            "DESCRIPTION": "Data parallel by hand: a replica per rank, gradients averaged after backward",
            "ABOUT_BASE": "data parallel written by hand on `stratagem.strategies.TorchDistributedStrategy`: "
            "`backward` averages the gradients over the ranks, and every other hook delegates to the base",
            "MODULE_DOC": f"``{name}``: data parallel written by hand over ``torch.distributed``.",
            "CLASS_DOC": "Every rank keeps a full replica; ``backward`` averages the gradients over the ranks, so "
            "every rank steps as one process on the global batch would. The other hooks delegate to "
            ":class:`stratagem.strategies.TorchDistributedStrategy` (process group, collectives, "
            "checkpoints, teardown): change those that should behave differently.",
        }
    if base is not None:
        what = f"``{base.name}`` (:class:`{base.module}.{base.class_name}`)"
        return {
            "DESCRIPTION": f"{base.name} as a starting point: every hook delegates to {base.class_name}",
            "ABOUT_BASE": f"starting from `{base.name}` (`{base.module}.{base.class_name}`): every hook "
            "delegates to it until you change it",
            "MODULE_DOC": f"``{name}``: starts from {base.name}'s behaviour; every hook delegates to it.",
            "CLASS_DOC": f"Starts from {what}: every hook below delegates to it. Change the hooks that should "
            "behave differently; each one's documentation says what it must do.",
        }
    if kind == "callback":
        return {
            "DESCRIPTION": "Counts optimizer steps and logs the count (a starting point)",
            "ABOUT_BASE": "",
            "MODULE_DOC": f"``{name}``: a Trainer callback.",
            "CLASS_DOC": "Counts optimizer steps, logs the count, and keeps it in checkpoints.\n\n"
            "Every Trainer event is written out below, in the order a run meets them: fill in those you "
            "need, delete the others.",
        }
    return {
        "DESCRIPTION": "Hyperparameters and metrics as JSON lines under default_root_dir (a starting point)",
        "ABOUT_BASE": "",
        "MODULE_DOC": f"``{name}``: a Trainer logger.",
        "CLASS_DOC": f"Writes the hyperparameters and the metrics as JSON lines to ``{name}.jsonl`` under the "
        "run's ``default_root_dir`` (or ``save_dir``), from global rank 0.\n\n"
        "Every Trainer event is written out below, in the order a run meets them: fill in those you "
        "need, delete the others.",
    }


def _docstring(text: str) -> str:
    """``text`` as a class docstring's body: paragraphs wrapped at the line length, indented for the class."""
    paragraphs = [textwrap.fill(" ".join(p.split()), 101) for p in text.split("\n\n")]
    return textwrap.indent("\n\n".join(paragraphs), "    ").lstrip()


def _imports(kind: str, base: Base | None, code: str) -> str:
    """The module's imports: the template's own (standard library, blank line, the rest), the typing names
    the hooks' annotations use, and those needed only by type checkers under ``TYPE_CHECKING``."""
    flavour = "strategy-plain" if kind == "strategy" and base is None else kind
    own = template(f"{flavour}/imports.tmpl")
    if own is None:
        assert base is not None
        own = f"from stratagem import hookimpl\nfrom {base.module} import {base.class_name}\n"
    blocks = own.strip("\n").split("\n\n")
    stdlib, third = (blocks[0], "\n\n".join(blocks[1:])) if len(blocks) > 1 else ("", blocks[0])
    typing_names, checking = _hooks.type_imports(code)
    if _hooks.uses_torch(code) and "import torch" not in own:
        checking = ["import torch", *checking]
    names = set(typing_names) | ({"TYPE_CHECKING"} if checking else set())
    lines = []
    for line in stdlib.splitlines():
        if line.startswith("from typing import "):
            names |= {n.strip() for n in line.removeprefix("from typing import ").split(",")}
        elif line:
            lines.append(line)
    if names:
        lines.append("from typing import " + ", ".join(sorted(names, key=lambda n: (not n.isupper(), n))))
    result = ["\n".join(lines), third]
    if checking:
        result.append("if TYPE_CHECKING:\n" + "\n".join(f"    {line}" for line in checking))
    return "\n\n".join(block for block in result if block)


def generate(kind: str, name: str, based_on: str | None = None) -> dict[str, str]:
    """``{path inside the package folder: content}`` for ``stratagem new KIND NAME [--based-on BASE]``."""
    check_name(kind, name)
    base = resolve_base(kind, based_on)
    given = {**values(kind, name, base), **_texts(kind, name, base)}
    flavour = "strategy-plain" if kind == "strategy" and base is None else kind

    def custom(hook: str) -> str | None:
        body = template(f"{flavour}/hooks/{hook}.tmpl")
        return None if body is None else render(body, given)

    if base is not None:
        base_cls, base_label = base.cls, base.class_name
    elif kind == "strategy":
        from stratagem.strategies import TorchDistributedStrategy

        base_cls, base_label = TorchDistributedStrategy, "TorchDistributedStrategy"
    else:
        base_cls, base_label = None, ""
    hooks = _hooks.stubs(_hook_names(kind), base_cls, base_label, custom)
    members = render(template(f"{flavour}/members.tmpl") or "", given)
    module_values = {
        **given,
        "CLASS_DOC": _docstring(given["CLASS_DOC"]),
        "IMPORTS": _imports(kind, base, members + hooks),
        "BASES": f"({base_label})" if base_label else "",
        "MEMBERS": members,
        "HOOKS": hooks,
    }
    package = given["PACKAGE"]
    files = {
        "pyproject.toml": render(template("common/pyproject.toml.tmpl") or "", given),
        ".gitignore": template("common/gitignore.tmpl") or "",
        ".github/workflows/ci.yml": render(template("common/ci.yml.tmpl") or "", given),
        "tests/test_contract.py": render(template("common/test_contract.py.tmpl") or "", given),
        f"src/{package}/__init__.py": render(template(f"{kind}/entry.py.tmpl") or "", given),
        f"src/{package}/{kind}.py": render(template("common/module.py.tmpl") or "", module_values),
        f"src/{package}/py.typed": "",
    }
    about = render(template(f"{kind}/about.md.tmpl") or "", given)
    files["README.md"] = render(template("common/README.md.tmpl") or "", {**given, "ABOUT": about.strip()})
    for path, text in files.items():
        if path.endswith(".py"):
            files[path] = _hooks.checked(text.rstrip("\n") + "\n", path)
    return files
