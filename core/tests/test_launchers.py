"""Launchers chosen by name like strategies: the registry, capability checks and errors before anything
starts, the environment variable, and the listing. (Launching itself: test_launcher.py, test_engine.py, and
each launcher plugin's own tests.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

import stratagem as sg
from stratagem.engine import LAUNCHER_ENV
from stratagem.errors import ConfigurationError, UnknownLauncherError
from stratagem.launchers import ElasticLauncher, Launcher, LauncherCapabilities
from stratagem.registry._registry import LauncherInfo, PluginInfo, Registry


def test_elastic_is_built_in_and_the_default(monkeypatch) -> None:
    monkeypatch.delenv(LAUNCHER_ENV, raising=False)
    engine = sg.Engine(strategy="single_device", accelerator="cpu")
    assert not engine.needs_launch  # one process: nothing to launch, no launcher resolved
    info = sg.get_registry().get_launcher("elastic")
    assert info.plugin.distribution == "stratagem" and info.capabilities.multi_node
    assert isinstance(info.create(), ElasticLauncher)


def test_unknown_names_say_what_exists(monkeypatch) -> None:
    monkeypatch.delenv(LAUNCHER_ENV, raising=False)
    with pytest.raises(UnknownLauncherError) as caught:
        sg.Engine(strategy="ddp", accelerator="cpu", devices=2, launcher="elastc")
    message = str(caught.value)
    assert (
        "Unknown launcher 'elastc'. Did you mean 'elastic'?" in message and "Installed launchers:" in message
    )
    monkeypatch.setenv(LAUNCHER_ENV, "elastc")  # the same rules for the environment variable
    with pytest.raises(UnknownLauncherError, match="Did you mean 'elastic'"):
        sg.Engine(strategy="ddp", accelerator="cpu", devices=2)


def test_a_launcher_that_is_not_installed_says_where_launchers_come_from() -> None:
    # Only the built-ins load: the core alone names no plugin package, and says where to look.
    code = (
        "import stratagem as sg\n"
        "from stratagem.strategies import TorchDistributedStrategy\n"
        "try:\n    sg.Trainer(strategy=TorchDistributedStrategy(), accelerator='cpu', devices=2, launcher='ray')\n"
        "except sg.StratagemError as e:\n    print(e)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "STRATAGEM_PLUGINS": ""},
    )
    assert (
        "Unknown launcher 'ray'. Installed launchers: elastic. Other launchers come with plugin packages: "
        "`stratagem launchers` lists what is installed" in done.stdout
    ), done.stdout + done.stderr


def test_capabilities_are_checked_before_anything_starts() -> None:
    registry = Registry()
    register = registry.launcher_registrar(PluginInfo(name="t", distribution="test-launchers", version="0"))
    register(
        "cpu_only",
        ElasticLauncher,
        description="a launcher for CPU workers on one node",
        capabilities=LauncherCapabilities(accelerators={"cpu"}, multi_node=False),
    )
    register("anything", ElasticLauncher, description="d", capabilities=LauncherCapabilities(multi_node=True))
    assert registry.check_launcher("cpu_only", accelerator="cpu", num_nodes=1).name == "cpu_only"
    with pytest.raises(
        ConfigurationError, match=r"cannot run accelerator 'cuda'.*Launchers that can: anything"
    ):
        registry.check_launcher("cpu_only", accelerator="cuda", num_nodes=1)
    with pytest.raises(ConfigurationError, match=r"cannot run 2 nodes \(it runs on one node\)"):
        registry.check_launcher("cpu_only", accelerator="cpu", num_nodes=2)
    with pytest.raises(ValueError, match="lower-case"):
        register("Bad Name", ElasticLauncher, description="d")
    with pytest.raises(sg.StrategyConflictError):
        register("cpu_only", ElasticLauncher, description="again")


class _Tagged(Launcher):
    def __init__(self, tag: str = "none") -> None:
        self.tag = tag


def test_launcher_options_reach_the_named_launcher(monkeypatch) -> None:
    monkeypatch.delenv(LAUNCHER_ENV, raising=False)
    plugin = PluginInfo(name="t", distribution="test-launchers", version="0")
    info = LauncherInfo(
        name="tagged", factory=_Tagged, description="d", capabilities=LauncherCapabilities(), plugin=plugin
    )
    monkeypatch.setitem(sg.get_registry().launchers, "tagged", info)
    common = dict(strategy="ddp", accelerator="cpu", devices=2, launcher="tagged")
    trainer = sg.Trainer(**common, launcher_options={"tag": "x"})
    launcher = trainer.engine._launching.launcher
    assert launcher.tag == "x" and launcher.registered_name == "tagged"
    with pytest.raises(ConfigurationError, match=r"launcher_options for launcher 'tagged': .*'tga'"):
        sg.Engine(**common, launcher_options={"tga": "x"})
    with pytest.raises(ConfigurationError, match="give the options to its constructor"):
        sg.Engine(**{**common, "launcher": _Tagged()}, launcher_options={"tag": "x"})


class _AllNodes(Launcher):
    """Starts every node's workers from this process (as stratagem-ray's does); here it runs nothing."""

    def __init__(self, tag: str = "none") -> None:
        self.tag = tag

    @sg.hookimpl
    def launch_workers(self, job: Any) -> dict[int, Any]:
        return {0: (self.tag, job.max_nodes, job.nproc_per_node)}


def test_an_instance_built_by_hand_has_its_registered_capabilities(monkeypatch) -> None:
    # Trainer(num_nodes=4, launcher=RayLauncher(address=...)): the instance has no registered name, its class
    # does. Found by its class, it may start every node, and what it cannot run is refused before launching.
    plugin = PluginInfo(name="t", distribution="test-launchers", version="0")
    for name, factory, nodes in (("all_nodes", _AllNodes, True), ("one_node", _Tagged, False)):
        info = LauncherInfo(
            name=name,
            factory=f"{factory.__module__}:{factory.__qualname__}",
            description="d",
            capabilities=LauncherCapabilities(multi_node=nodes, starts_all_nodes=nodes),
            plugin=plugin,
        )
        monkeypatch.setitem(sg.get_registry().launchers, name, info)
    engine = sg.Engine(strategy="ddp", accelerator="cpu", devices=2, num_nodes=2, launcher=_AllNodes("x"))
    assert engine.launch(print) == ("x", 2, 2)
    with pytest.raises(ConfigurationError, match=r"Launcher 'one_node' cannot run 2 nodes"):
        sg.Engine(strategy="ddp", accelerator="cpu", devices=1, num_nodes=2, launcher=_Tagged())


def test_elastic_cannot_start_other_nodes_from_one_process() -> None:
    engine = sg.Engine(strategy="ddp", accelerator="cpu", devices=1, num_nodes=2)
    with pytest.raises(ConfigurationError, match="start one launcher per node"):
        engine.launch(print)


def test_listing() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "stratagem", "launchers", "--json"], capture_output=True, text=True, timeout=60
    )
    rows = {row["name"]: row for row in json.loads(done.stdout)["launchers"]}
    assert rows["elastic"]["capabilities"] == {
        "accelerators": ["cpu", "cuda"],
        "multi_node": True,
        "starts_all_nodes": False,
        "requires": [],
    }
