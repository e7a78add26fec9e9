"""Registration through the installed distribution's entry point, declared capabilities, lazy imports."""

from __future__ import annotations

import json
import subprocess
import sys

import importlib_metadata
import pytest

from stratagem import get_registry
from stratagem.errors import CapabilityError


def test_entry_point_of_the_installed_distribution() -> None:
    points = [ep for ep in importlib_metadata.entry_points(group="stratagem") if ep.name == "ddp"]
    assert len(points) == 1
    assert points[0].value == "stratagem_ddp._plugin"
    assert points[0].dist is not None and points[0].dist.name == "stratagem-ddp"


def test_both_names_registered_with_capabilities() -> None:
    registry = get_registry(refresh=True)
    for name in ("ddp", "ddp_find_unused_parameters_true"):
        info = registry.get(name)
        assert info.plugin.distribution == "stratagem-ddp"
        assert info.factory == "stratagem_ddp.strategy:DDPStrategy"
        caps = info.capabilities
        assert caps.accelerators == {"cpu", "cuda"}
        assert caps.precisions == {"32-true", "bf16-mixed", "bf16-true", "16-mixed", "16-true"}
        assert caps.checkpoint_formats == {"full"}
        assert caps.min_world_size == 1 and caps.max_world_size is None
    assert dict(registry.get("ddp_find_unused_parameters_true").preset_options) == {
        "find_unused_parameters": True
    }
    assert dict(registry.get("ddp").preset_options) == {}


def test_alias_creates_a_strategy_with_the_preset_and_accepts_overrides() -> None:
    registry = get_registry()
    alias = registry.get("ddp_find_unused_parameters_true")
    assert alias.create().config.find_unused_parameters is True
    assert alias.create(static_graph=True).config.static_graph is True
    assert registry.get("ddp").create().config.find_unused_parameters is False


def test_requests_checked_against_declarations() -> None:
    registry = get_registry()
    registry.check_request("ddp", accelerator="cpu", precision="bf16-mixed", world_size=8)
    registry.check_request("ddp", accelerator="cuda", precision="16-mixed", world_size=2)
    with pytest.raises(CapabilityError):
        registry.check_request("ddp", accelerator="cpu", precision="16-mixed", world_size=2)
    with pytest.raises(CapabilityError):
        registry.check_request("ddp", checkpoint_format="sharded")


def test_listing_strategies_does_not_import_torch() -> None:
    code = (
        "import sys, json; from stratagem import get_registry; r = get_registry(); "
        "print(json.dumps([r.names(), [str(b) for b in r.broken], 'torch' in sys.modules, "
        "'stratagem_ddp._plugin' in sys.modules]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    names, broken, torch_loaded, plugin_loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert {"ddp", "ddp_find_unused_parameters_true"} <= set(names)
    assert broken == []
    assert plugin_loaded is True
    assert torch_loaded is False
