"""A Griffe extension for the site (named in mkdocs.yml, and used by the page generators).

- The code's docstrings are written for Sphinx-style readers (``:class:`X```, ``::`` before a literal block);
  the site renders Markdown. Roles become links where the target is documented on the site, plain code where
  it is not.
- Configuration classes are ``attrs`` classes, whose ``__init__`` attrs writes at run time: static analysis
  sees none, so their ``:param:`` lines would match no signature. The extension gives each one the
  ``__init__`` attrs would make (its options, in order, with their defaults).
- The house documents a constant with a ``#:`` comment above it (as Sphinx's autodoc reads them); Griffe reads
  docstrings only, so those comments become the attribute's docstring.
- Each hook spec is labelled with its pluggy options (``firstresult``, ``historic``).
"""

from __future__ import annotations

import re
from typing import Any

import griffe

# :class:`X`, :func:`~pkg.mod.f`, :meth:`Engine.setup`, ... (which role it is does not matter here).
_ROLE = re.compile(r":(?:py:)?[a-z]+:`(~?)([^`<>]+?)`")
# "text::" ending a line before an indented literal block reads as "text:" in Markdown.
_LITERAL_INTRO = re.compile(r"(\S)::[ \t]*$", re.MULTILINE)
_HOOKSPEC_OPTIONS = ("firstresult", "historic", "warn_on_impl")
_ATTRS_CLASS_DECORATORS = ("attrs.define", "attrs.frozen", "attrs.mutable", "attr.s", "attr.attrs")
_ATTRS_FIELDS = ("attrs.field", "attr.ib", "attr.attrib")


def _qualify(target: str, obj: griffe.Object) -> str:
    """The full path of ``target`` as seen from ``obj``'s docstring (``target`` itself if not found)."""
    if target.startswith(("stratagem.", "stratagem_")):
        return target
    head = target.split(".")[0]
    for scope in (obj, obj.parent, obj.module):
        if scope is not None and head in scope.members:
            return f"{scope.path}.{target}"
    return target


def to_markdown(text: str, obj: griffe.Object) -> str:
    """``text`` (a docstring of ``obj``) with its Sphinx roles and literal-block markers in Markdown."""

    def role(match: re.Match[str]) -> str:
        short, target = match.group(1), match.group(2).strip()
        shown = target.rsplit(".", 1)[-1] if short else target
        # "optional": autorefs links it where the target is on the site and leaves plain code otherwise.
        return f'<autoref identifier="{_qualify(target, obj)}" optional><code>{shown}</code></autoref>'

    return _LITERAL_INTRO.sub(r"\1:", _ROLE.sub(role, text))


def _call_path(expr: Any) -> str:
    return str(expr.function) if isinstance(expr, griffe.ExprCall) else str(expr)


def _keywords(expr: Any) -> dict[str, Any]:
    if not isinstance(expr, griffe.ExprCall):
        return {}
    return {arg.name: arg.value for arg in expr.arguments if isinstance(arg, griffe.ExprKeyword)}


def _attrs_decorator(cls: griffe.Class) -> Any:
    for decorator in cls.decorators:
        if _call_path(decorator.value) in _ATTRS_CLASS_DECORATORS:
            return decorator.value
    return None


def _attrs_parameters(cls: griffe.Class, kw_only: bool) -> list[griffe.Parameter]:
    parameters = []
    for name, member in cls.members.items():
        if member.is_alias or not member.is_attribute or "instance-attribute" not in member.labels:
            continue
        if str(member.annotation or "").startswith(("ClassVar", "typing.ClassVar")):
            continue
        value = member.value
        field = _keywords(value) if _call_path(value) in _ATTRS_FIELDS else None
        if field is not None and str(field.get("init", "True")) == "False":
            continue
        if field is None:
            default = value
        elif "default" in field:
            default = field["default"]
        elif "factory" in field:
            default = f"{field['factory']}()"
        else:
            default = None
        keyword_only = kw_only or (field is not None and str(field.get("kw_only", "False")) == "True")
        parameters.append(
            griffe.Parameter(
                str(field.get("alias", name)).strip("'\"")
                if field and "alias" in field
                else name.lstrip("_"),
                annotation=member.annotation,
                kind=griffe.ParameterKind.keyword_only
                if keyword_only
                else griffe.ParameterKind.positional_or_keyword,
                default=default,
                docstring=member.docstring,
            )
        )
    return parameters


def _set_attrs_init(cls: griffe.Class) -> None:
    decorator = _attrs_decorator(cls)
    if decorator is None or "__init__" in cls.members:
        return
    kw_only = str(_keywords(decorator).get("kw_only", "False")) == "True"
    parameters: list[griffe.Parameter] = []
    try:
        bases = [base for base in reversed(cls.mro()) if _attrs_decorator(base) is not None]
    except ValueError:
        bases = []
    for base in bases:
        parameters.extend(_attrs_parameters(base, kw_only))
    parameters.extend(_attrs_parameters(cls, kw_only))
    self_parameter = griffe.Parameter("self", kind=griffe.ParameterKind.positional_or_keyword)
    init = griffe.Function(
        "__init__",
        lineno=0,
        endlineno=0,
        parent=cls,
        parameters=griffe.Parameters(self_parameter, *parameters),
    )
    cls.set_member("__init__", init)


def _doc_comment(attr: griffe.Object) -> griffe.Docstring | None:
    """The ``#:`` comment lines right above ``attr``'s assignment, as a docstring."""
    try:
        lines = attr.lines_collection[attr.filepath]  # type: ignore[index]
    except (KeyError, TypeError):
        return None
    comment: list[str] = []
    index = (attr.lineno or 0) - 2
    while index >= 0 and lines[index].strip().startswith("#:"):
        comment.insert(0, lines[index].strip()[2:].strip())
        index -= 1
    if not comment:
        return None
    return griffe.Docstring("\n".join(comment), lineno=index + 2, parent=attr)


class StratagemDocstrings(griffe.Extension):
    def on_class(self, *, cls: griffe.Class, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        _set_attrs_init(cls)

    def on_module(self, *, mod: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        # A loaded package's top module gets no on_object event; converting twice changes nothing.
        if mod.docstring is not None:
            mod.docstring.value = to_markdown(mod.docstring.value, mod)

    def on_object(self, *, obj: griffe.Object, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        if obj.is_attribute and obj.docstring is None:
            obj.docstring = _doc_comment(obj)
        if obj.docstring is not None:
            obj.docstring.value = to_markdown(obj.docstring.value, obj)
        if obj.is_function:
            for decorator in obj.decorators:  # type: ignore[attr-defined]
                if _call_path(decorator.value).endswith("hookspec"):
                    options = _keywords(decorator.value)
                    obj.labels.update(o for o in _HOOKSPEC_OPTIONS if str(options.get(o, "")) == "True")
