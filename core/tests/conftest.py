"""Fixtures shared by the core tests."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture
def make_distribution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[..., Path]:
    """Write a real installed distribution (``*.dist-info`` with entry points, plus its modules) onto a fresh
    ``sys.path`` entry, as pip would leave it: importlib.metadata finds it the ordinary way."""
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    created: list[str] = []

    def make(name: str, version: str, entry_points: dict[str, str], modules: dict[str, str]) -> Path:
        info = site / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        lines = ["[stratagem]"] + [f"{ep} = {target}" for ep, target in entry_points.items()]
        (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
        (info / "RECORD").write_text("")
        for module, source in modules.items():
            path = site / (module.replace(".", "/") + ".py")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(textwrap.dedent(source))
            created.append(module.split(".")[0])
        return site

    yield make
    for module in set(created):
        for loaded in [m for m in sys.modules if m == module or m.startswith(module + ".")]:
            del sys.modules[loaded]
