"""The hook methods of a generated plugin class, written from :mod:`stratagem.hookspecs` itself: a hook added to
the specs appears in the next generated package with its arguments, types and documentation.

A stub delegates to the base class's implementation (``return super().hook(arg=arg)``), taking the arguments
that implementation takes; an event of a callback or logger, which has no base, is a documented no-op. A
template may replace any stub with a body of its own (``templates/<kind>/hooks/<hook>.tmpl``).
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from collections.abc import Callable, Iterable
from typing import Any

from stratagem import hookspecs

#: The public module the generated code imports each type the specs name from (for type checkers only).
TYPE_IMPORTS = {
    "ClusterEnvironment": "stratagem",
    "Compiler": "stratagem.strategies",
    "LaunchJob": "stratagem.launchers",
    "StepOutput": "stratagem.strategies",
}
_WIDTH = 110


def spec_order(names: Iterable[str]) -> list[str]:
    """``names`` in the order the specs define them (the order of a run)."""
    wanted = set(names)
    return [name for name in vars(hookspecs) if name in wanted]


def _spec(name: str) -> inspect.Signature:
    return inspect.signature(getattr(hookspecs, name))


def summary(name: str) -> str:
    """The first paragraph of the spec's documentation, on one line."""
    doc = inspect.getdoc(getattr(hookspecs, name)) or ""
    return " ".join(doc.split("\n\n")[0].split())


def _annotation(value: Any) -> str:
    if value is inspect.Parameter.empty:
        return "Any"
    return value if isinstance(value, str) else inspect.formatannotation(value)


def _docstring(text: str, indent: str) -> str:
    # Room for the quotes: three before the first line, three after a docstring of one line.
    lines = textwrap.wrap(text, _WIDTH - len(indent) - 6, break_on_hyphens=False) or [""]
    if len(lines) == 1:
        return f'{indent}"""{lines[0]}"""\n'
    body = "\n".join(f"{indent}{line}" if line else "" for line in lines[1:])
    return f'{indent}"""{lines[0]}\n{body}\n{indent}"""\n'


def base_arguments(base: type | None, name: str) -> list[str]:
    """The arguments ``base``'s implementation of hook ``name`` takes (the spec's, without a base)."""
    spec_args = list(_spec(name).parameters)
    function = getattr(base, name, None) if base is not None else None
    if function is None:
        return spec_args
    params = list(inspect.signature(function).parameters.values())[1:]
    return [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.name in spec_args]


def stub(name: str, base: type | None, base_label: str, custom: Callable[[str], str | None]) -> str:
    """One hook method: the template's own body for it, or a stub delegating to ``base``."""
    spec = _spec(name)
    args = base_arguments(base, name)
    params = ", ".join(["self", *(f"{a}: {_annotation(spec.parameters[a].annotation)}" for a in args)])
    returns = _annotation(spec.return_annotation)
    head = f"    @hookimpl\n    def {name}({params}) -> {returns}:\n"
    if len(head.splitlines()[1]) > _WIDTH:
        inner = "".join(f"        {p},\n" for p in params.split(", "))
        head = f"    @hookimpl\n    def {name}(\n{inner}    ) -> {returns}:\n"
    body = custom(name)
    if body is not None:
        return head + body
    if base is None:
        return head + _docstring(summary(name), "        ")
    call = ", ".join(f"{a}={a}" for a in args)
    doc = _docstring(f"{summary(name)} Delegates to {base_label}.{name}.", "        ")
    return head + doc + f"        return super().{name}({call})\n"


def stubs(
    names: Iterable[str], base: type | None, base_label: str, custom: Callable[[str], str | None]
) -> str:
    return "\n".join(stub(name, base, base_label, custom) for name in spec_order(names))


def type_imports(code: str) -> tuple[list[str], list[str]]:
    """``(typing names, import lines for TYPE_CHECKING)`` that the annotations in ``code`` need."""
    words = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", code))
    typing_names = sorted(n for n in ("Any", "ContextManager") if n in words)
    modules: dict[str, list[str]] = {}
    for type_name, module in sorted(TYPE_IMPORTS.items()):
        if type_name in words:
            modules.setdefault(module, []).append(type_name)
    lines = [f"from {module} import {', '.join(names)}" for module, names in sorted(modules.items())]
    return typing_names, lines


def uses_torch(code: str) -> bool:
    return re.search(r"\btorch\.", code) is not None


def checked(source: str, label: str) -> str:
    """``source``, after checking that it parses (a template bug shows here, not in the user's package)."""
    try:
        ast.parse(source)
    except SyntaxError as error:
        raise RuntimeError(f"stratagem new: the generated {label} does not parse: {error}") from None
    return source
