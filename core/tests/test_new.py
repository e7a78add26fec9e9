"""``stratagem new``: what it writes for each kind, and what it refuses. Installing and certifying the packages
is ``tests/test_plugin_kit.py``'s part."""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

from stratagem import hookspecs
from stratagem.cli.new._package import generate
from stratagem.errors import ConfigurationError, UnknownStrategyError
from stratagem.registry._manager import STRATEGY_HOOKS


def _hooks_of(source: str, class_name: str) -> dict[str, ast.FunctionDef]:
    tree = ast.parse(source)
    [cls] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name]
    return {
        f.name: f
        for f in cls.body
        if isinstance(f, ast.FunctionDef)
        and any(getattr(d, "id", None) == "hookimpl" for d in f.decorator_list)
    }


def test_a_strategy_based_on_ddp_delegates_every_hook_and_copies_its_declarations() -> None:
    files = generate("strategy", "acme_ddp", "ddp")
    assert sorted(files) == [
        ".github/workflows/ci.yml",
        ".gitignore",
        "README.md",
        "pyproject.toml",
        "src/stratagem_acme_ddp/__init__.py",
        "src/stratagem_acme_ddp/py.typed",
        "src/stratagem_acme_ddp/strategy.py",
        "tests/test_contract.py",
    ]
    module = files["src/stratagem_acme_ddp/strategy.py"]
    assert "from stratagem_ddp.strategy import DDPStrategy" in module
    assert "class AcmeDdpStrategy(DDPStrategy):" in module
    hooks = _hooks_of(module, "AcmeDdpStrategy")
    assert set(hooks) == STRATEGY_HOOKS
    from stratagem_ddp.strategy import DDPStrategy

    for name, function in hooks.items():
        # Each takes the spec's arguments that ddp's implementation takes (pluggy passes an implementation
        # the subset it names), in the spec's order, and passes them by name to the base.
        spec = [p.arg for p in ast.parse(f"def f{_signature(name)}: pass").body[0].args.args]
        taken = set(list(inspect.signature(getattr(DDPStrategy, name)).parameters)[1:])
        expected = [a for a in spec if a in taken]
        call = function.body[-1].value
        assert isinstance(call, ast.Call) and call.func.attr == name, name
        assert [k.arg for k in call.keywords] == expected, name
        assert [a.arg for a in function.args.args[1:]] == expected, name
    entry = files["src/stratagem_acme_ddp/__init__.py"]
    assert "import torch" not in entry and "stratagem_acme_ddp.strategy:AcmeDdpStrategy" in entry
    assert 'checkpoint_formats={"full"}' in entry and '"16-mixed"' in entry  # ddp's declarations
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads(files["pyproject.toml"])
    assert project["project"]["name"] == "stratagem-acme-ddp"
    assert project["project"]["entry-points"]["stratagem"] == {"acme_ddp": "stratagem_acme_ddp"}
    assert "stratagem-ddp>=0.1.0" in project["project"]["dependencies"]
    assert "stratagem-certificate.json" in project["tool"]["setuptools"]["package-data"]["stratagem_acme_ddp"]


def _signature(hook: str) -> str:
    import inspect

    params = ", ".join(inspect.signature(getattr(hookspecs, hook)).parameters)
    return f"({params})"


def test_the_default_strategy_averages_gradients_by_hand_and_its_preset_options_carry_over() -> None:
    module = generate("strategy", "acme_plain")["src/stratagem_acme_plain/strategy.py"]
    hooks = _hooks_of(module, "AcmePlainStrategy")
    assert set(hooks) == STRATEGY_HOOKS
    assert "self.average_gradients(model)" in ast.unparse(hooks["backward"])
    assert "class AcmePlainStrategy(TorchDistributedStrategy):" in module
    # A base name with preset options: they become the new name's.
    entry = generate("strategy", "acme_unused", "ddp_find_unused_parameters_true")[
        "src/stratagem_acme_unused/__init__.py"
    ]
    assert "find_unused_parameters=True," in entry


@pytest.mark.parametrize("kind", ["launcher", "callback", "logger"])
def test_other_kinds_implement_every_hook_of_their_kind(kind: str) -> None:
    files = generate(kind, f"acme_{kind}")
    module = files[f"src/stratagem_acme_{kind}/{kind}.py"]
    class_name = f"Acme{kind.capitalize()}"
    hooks = _hooks_of(module, class_name)
    expected = {"launch_workers"} if kind == "launcher" else set(hookspecs.TRAINER_EVENTS)
    assert set(hooks) == expected
    test = files["tests/test_contract.py"]
    flag = "" if kind == "strategy" else f'"--{kind}", '
    assert f'stratagem("contract", {flag}"acme_{kind}", "--report"' in test
    for path, text in files.items():
        if path.endswith(".py"):
            ast.parse(text)
    yaml = pytest.importorskip("yaml")
    workflow = yaml.safe_load(files[".github/workflows/ci.yml"])
    steps = " ".join(str(step) for step in workflow["jobs"]["test"]["steps"])
    assert "download.pytorch.org/whl/cpu" in steps and "python -m pytest" in steps


def test_bad_requests_are_refused_with_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="lower-case letters, digits and underscores"):
        generate("strategy", "Acme-DDP")
    with pytest.raises(
        ConfigurationError, match=r"installed already \(from stratagem-ddp\).*Pick another name"
    ):
        generate("strategy", "ddp")
    with pytest.raises(ConfigurationError, match="declares the entry point 'localsgd' already"):
        generate("callback", "localsgd")
    with pytest.raises(UnknownStrategyError, match="Did you mean 'ddp'"):
        generate("strategy", "acme", "ddq")
    with pytest.raises(ConfigurationError, match="--based-on applies to strategies and launchers"):
        generate("callback", "acme", "ddp")
    (tmp_path / "acme").mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "stratagem", "new", "callback", "acme", "--directory", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "exists already" in done.stderr
