"""The `stratagem` command as a user runs it: a separate process, with whatever is installed."""

from __future__ import annotations

import json
import subprocess
import sys

import importlib_metadata


def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "stratagem", *args], capture_output=True, text=True, timeout=60, env=env
    )


def test_every_installed_plugin_is_listed_with_what_it_registers_or_its_error():
    result = run("strategies", "--json")
    assert result.returncode == 0, result.stderr
    listing = json.loads(result.stdout)
    launchers = run("launchers", "--json")
    assert launchers.returncode == 0, launchers.stderr
    callbacks = run("callbacks", "--json")
    assert callbacks.returncode == 0, callbacks.stderr
    named = json.loads(callbacks.stdout)
    plugins = (
        {row["plugin"] for row in listing["strategies"]}
        | {row["plugin"] for row in json.loads(launchers.stdout)["launchers"]}
        | {row["plugin"] for kind in named.values() for row in kind}
        | {b["entry_point"].split(" = ")[0] for b in listing["broken"]}
    )
    installed = {ep.name for ep in importlib_metadata.entry_points(group="stratagem")}
    assert installed <= plugins, (
        f"entry points without strategies, launchers or errors: {installed - plugins}"
    )
    assert [row["name"] for row in named["loggers"]][:4] == ["csv", "mlflow", "tensorboard", "wandb"]
    assert {"model_checkpoint", "learning_rate_monitor", "throughput"} <= {
        r["name"] for r in named["callbacks"]
    }
    single = next(row for row in listing["strategies"] if row["name"] == "single_device")
    assert single["distribution"] == "stratagem" and single["capabilities"]["world_sizes"] == [1, 1]
    assert listing["conflicts"] == []


def test_listings_do_not_import_torch_or_the_plugins_dependencies():
    code = (
        "import sys, io, contextlib\n"
        "from stratagem.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()): main(['strategies'])\n"
        "with contextlib.redirect_stdout(io.StringIO()): main(['launchers'])\n"
        "heavy = [m for m in ('torch', 'deepspeed', 'numpy', 'ray') if m in sys.modules]\n"
        "print(heavy)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_a_command_line_imports_the_module_of_its_command_alone():
    # `stratagem NAME` imports COMMAND_MODULE[NAME] only: each name must be the one its module registers.
    registered = (
        "import importlib, json\nfrom stratagem import cli\nfound = {}\n"
        "for module in cli.COMMAND_MODULES:\n"
        "    before = set(cli._COMMANDS)\n    importlib.import_module(module)\n"
        "    found.update({name: module for name in set(cli._COMMANDS) - before})\n"
        "print(json.dumps([found, cli.COMMAND_MODULE]))\n"
    )
    listing = (
        "import io, json, sys, contextlib\nfrom stratagem import cli\n"
        "with contextlib.redirect_stdout(io.StringIO()): cli.main(['launchers'])\n"
        "print(json.dumps(sorted(m for m in cli.COMMAND_MODULES if m in sys.modules)))\n"
    )
    outputs = []
    for code in (registered, listing):
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        outputs.append(json.loads(result.stdout))
    (found, table), loaded = outputs
    assert found == table
    assert loaded == ["stratagem.cli.listing"]
    usage = run("--help")
    assert usage.returncode == 0 and all(name in usage.stdout for name in table), usage.stdout
    wrong = run("strategy")
    assert (
        wrong.returncode == 2
        and "invalid choice: 'strategy'" in wrong.stderr
        and "strategies" in wrong.stderr
    )


def test_strategies_text_shows_capabilities():
    result = run("strategies")
    assert result.returncode == 0
    assert "single_device" in result.stdout and "checkpoints full,sharded" in result.stdout


def test_plugin_allow_list_from_environment():
    import os

    env = {**os.environ, "STRATAGEM_PLUGINS": ""}
    listing = json.loads(run("strategies", "--json", env=env).stdout)
    assert [row["name"] for row in listing["strategies"]] == ["single_device"]
