"""The Trainer and the Engine are composed of parts, each given what it needs when it is made, rather than mixins
that borrow their host's attributes: where a mixin declared the host's attributes, stubbed the host's methods with
``NotImplementedError`` and called back into the host through ``self``, the import graph was acyclic only because
the cycles had moved into ``self``. These checks read the code: the hosts have no bases of the project's, no
class of trainer/ or engine/ declares attributes that someone else assigns or stubs methods someone else defines,
and no part reads or calls the Trainer, reaches into a Trainer's or an Engine's private state, or reads off
``self`` what it never sets. A Trainer and an Engine, once made, are walked too: no part holds the Engine, and
the Trainer is held only by the three parts that hand it on (to callbacks, as ``Module.trainer``, to a
``ModelCheckpoint``'s ``best_checkpoint``). The modules stay under 400 lines, the split having been the point."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import stratagem
from stratagem.engine import Engine
from stratagem.trainer import Trainer

CORE = Path(stratagem.__file__).parent
#: The module of each host; every other module of its package is a part or a helper.
HOSTS = {"trainer": "_trainer.py", "engine": "_engine.py"}
#: The user's Module: its default steps raise ``NotImplementedError`` for the user to override, and ``Module.log``
#: hands a value to the Trainer it is attached to (through the Trainer's public ``log``).
USER_MODULE = "trainer/module.py"
#: The names under which a part could hold a host.
HOST_NAMES = {"trainer", "_trainer", "engine", "_engine", "host", "_host", "owner", "_owner", "_attach_to"}
#: The parts that hold the Trainer, each only to hand it on (``HOST_NAMES`` has their attributes, so that
#: ``_reach_backs`` fails on any read through them).
HANDS_ON_THE_TRAINER = {
    ("TrainerEvents", "_trainer"),  # trainer= of every callback and logger event
    ("RunSetup", "_attach_to"),  # Module.trainer while the module trains
    ("EvaluationRuns", "_trainer"),  # ModelCheckpoint.best_checkpoint(trainer) for ckpt_path="best"
}
MAX_LINES = 400
#: Decorators of classes whose annotated fields their generated constructor sets.
FIELD_CLASSES = {"define", "frozen", "mutable", "s", "attrs", "dataclass"}


def _modules(package: str) -> list[Path]:
    return sorted((CORE / package).glob("*.py"))


def _where(path: Path, node: ast.AST) -> str:
    return f"{path.relative_to(CORE)}:{getattr(node, 'lineno', '?')}"


def _name_of(node: ast.expr) -> str | None:
    """The last name of ``x`` or ``a.b.x``."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _decorated_by(node: ast.ClassDef, names: set[str]) -> bool:
    for decorator in node.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        if _name_of(target) in names:
            return True
    return False


def _bases(node: ast.ClassDef) -> set[str]:
    return {name for base in node.bases if (name := _name_of(base)) is not None}


@pytest.mark.parametrize("host", [Trainer, Engine], ids=["Trainer", "Engine"])
def test_the_hosts_have_no_base_class(host: type) -> None:
    assert host.__mro__ == (host, object), (
        f"{host.__name__} is built of {host.__mro__[1:-1]}; compose instead"
    )


def _stubs(path: Path) -> list[str]:
    """Methods standing in for someone else's: a body that only raises ``NotImplementedError``, or an
    ``if TYPE_CHECKING:`` block of method signatures inside a class."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ClassDef) or "Protocol" in _bases(node):
            continue
        for inner in ast.walk(node):
            if isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body = [
                    s
                    for s in inner.body
                    if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))
                ]
                raised = body[0].exc if len(body) == 1 and isinstance(body[0], ast.Raise) else None
                if raised is not None and _name_of(getattr(raised, "func", raised)) == "NotImplementedError":
                    found.append(f"{_where(path, inner)} {node.name}.{inner.name} raises NotImplementedError")
            if isinstance(inner, ast.If) and _name_of(inner.test) == "TYPE_CHECKING":
                names = [s.name for s in inner.body if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))]
                if names:
                    found.append(f"{_where(path, inner)} {node.name} declares {names} for type checkers only")
    return found


def _declared_attributes(path: Path) -> list[str]:
    """Class-level annotations without a value in a plain class: attributes the class reads but never sets
    (attrs classes and Protocols declare their fields so, and their constructors set them)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ClassDef) or "Protocol" in _bases(node):
            continue
        if _decorated_by(node, FIELD_CLASSES):
            continue
        for statement in node.body:
            if isinstance(statement, ast.AnnAssign) and statement.value is None:
                target = ast.unparse(statement.target)
                found.append(f"{_where(path, statement)} {node.name} declares {target} without setting it")
    return found


def _reach_backs(path: Path, *, host_package: str) -> list[str]:
    """A private attribute read off a Trainer or an Engine (``trainer._x``, ``self._engine._x``), and in the
    Trainer's parts any attribute of the Trainer at all: they get it only to hand it to callbacks."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Attribute):
            continue
        holder = _name_of(node.value)
        if holder not in HOST_NAMES:
            continue
        private = node.attr.startswith("_") and not node.attr.startswith("__")
        reads_trainer = holder in {"trainer", "_trainer"} and host_package == "trainer"
        if private or (reads_trainer and str(path.relative_to(CORE)) != USER_MODULE):
            found.append(f"{_where(path, node)} {ast.unparse(node)}")
    return found


def _self_targets(node: ast.AST) -> set[str]:
    """The attributes of ``self`` that ``node`` assigns: ``self.x = ...``, ``self.a, self.b = ...``, and
    ``self.__dict__.update(x=...)`` (a class whose ``__setattr__`` forwards elsewhere)."""
    found = set()
    for inner in ast.walk(node):
        if (
            isinstance(inner, ast.Attribute)
            and isinstance(inner.ctx, ast.Store)
            and _name_of(inner.value) == "self"
        ):
            found.add(inner.attr)
        if isinstance(inner, ast.Call) and ast.unparse(inner.func) == "self.__dict__.update":
            found.update(keyword.arg for keyword in inner.keywords if keyword.arg is not None)
    return found


def _borrowed(path: Path) -> list[str]:
    """What a class without bases reads off ``self`` that it never defines or sets: a mixin's reach into the
    class it is mixed into (attrs classes set their annotated fields)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ClassDef) or node.bases:
            continue
        fields = _decorated_by(node, FIELD_CLASSES)
        own = _self_targets(node)
        for statement in node.body:
            if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(statement.name)
            elif isinstance(statement, ast.Assign):
                own.update(t.id for t in statement.targets if isinstance(t, ast.Name))
            elif (
                isinstance(statement, ast.AnnAssign)
                and isinstance(statement.target, ast.Name)
                and (statement.value is not None or fields)
            ):
                own.add(statement.target.id)
        read = {
            inner.attr
            for inner in ast.walk(node)
            if isinstance(inner, ast.Attribute)
            and isinstance(inner.ctx, ast.Load)
            and isinstance(inner.value, ast.Name)
            and inner.value.id == "self"
            and not inner.attr.startswith("__")
        }
        found += [
            f"{_where(path, node)} {node.name} reads self.{name}, which it never sets"
            for name in sorted(read - own)
        ]
    return found


def _imports_host(path: Path, package: str) -> list[str]:
    host = f"stratagem.{package}.{HOSTS[package][:-3]}"
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == host:
            found.append(f"{_where(path, node)} imports {host}")
    return found


@pytest.mark.parametrize("package", sorted(HOSTS))
def test_no_part_stubs_or_declares_what_another_class_provides(package: str) -> None:
    problems = []
    for path in _modules(package):
        if str(path.relative_to(CORE)) != USER_MODULE:
            problems += _stubs(path)
        problems += _declared_attributes(path)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("package", sorted(HOSTS))
def test_no_part_reaches_back_into_a_host(package: str) -> None:
    problems = []
    for path in _modules(package):
        if path.name not in (HOSTS[package], "__init__.py"):  # the package's face names the host it exports
            problems += _reach_backs(path, host_package=package) + _imports_host(path, package)
            problems += _borrowed(path)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("package", sorted(HOSTS))
def test_the_modules_stay_under_400_lines(package: str) -> None:
    long = {
        str(p.relative_to(CORE)): n
        for p in _modules(package)
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"split these by what they do: {long}"


def _holders(host: object) -> set[tuple[str, str]]:
    """``(class, attribute)`` of each part reachable from ``host`` (objects of the host's package, followed
    through their attributes and the lists, tuples and dicts they hold) that holds ``host`` or a bound method of
    it."""
    package = type(host).__module__.rsplit(".", 1)[0]
    found: set[tuple[str, str]] = set()
    seen = {id(host)}
    todo: list[object] = [host]
    while todo:
        obj = todo.pop()
        for name, value in vars(obj).items():
            values = list(value.values()) if isinstance(value, dict) else [value]
            if isinstance(value, (list, tuple)):
                values = list(value)
            for item in values:
                if item is host or getattr(item, "__self__", None) is host:
                    if obj is not host:
                        found.add((type(obj).__name__, name))
                elif (
                    id(item) not in seen
                    and type(item).__module__.startswith(package + ".")
                    and hasattr(item, "__dict__")
                ):
                    seen.add(id(item))
                    todo.append(item)
    return found


def test_no_engine_part_holds_the_engine() -> None:
    engine = Engine(strategy="single_device")
    try:
        assert _holders(engine) == set()
    finally:
        engine.teardown()


def test_the_trainer_is_held_only_by_the_parts_that_hand_it_on(tmp_path: Path) -> None:
    trainer = Trainer(
        strategy="single_device", default_root_dir=tmp_path, loggers=[], enable_progress_bar=False
    )
    try:
        assert _holders(trainer) <= HANDS_ON_THE_TRAINER
    finally:
        trainer.engine.teardown()
