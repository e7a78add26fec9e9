"""Fixtures shared by the core tests."""

from __future__ import annotations

import subprocess
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


class TempDir:
    """A temporary directory a test watches: ``left()`` lists what is in it, recursively."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def left(self) -> list[str]:
        return sorted(str(entry.relative_to(self.path)) for entry in self.path.rglob("*"))


@pytest.fixture
def temp_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> TempDir:
    """A fresh, empty temporary directory for this process (``tempfile.tempdir``) and the processes it starts
    (``TMPDIR``), so that a test can see what a run leaves there without other processes' files in the way.

    torch's compile cache (``torchinductor_<user>``, one per user and reused by every run) goes elsewhere:
    importing torch._dynamo creates it; no run leaves it.
    """
    return _watch_temp_dir(tmp_path, monkeypatch)


@pytest.fixture(scope="session")
def watch_temp_dir() -> Callable[[Path, pytest.MonkeyPatch], TempDir]:
    """:func:`temp_dir`'s set-up as a function, for a fixture of wider scope with a ``MonkeyPatch`` of its own."""
    return _watch_temp_dir


def _watch_temp_dir(root: Path, patch: pytest.MonkeyPatch) -> TempDir:
    """What :func:`temp_dir` sets up, under ``root``, undone with ``patch``."""
    import tempfile

    fresh = root / "temp-dir"
    fresh.mkdir()
    patch.setenv("TMPDIR", str(fresh))
    patch.setenv("TORCHINDUCTOR_CACHE_DIR", str(root / "inductor-cache"))
    patch.setattr(tempfile, "tempdir", str(fresh))
    return TempDir(fresh)


@pytest.fixture
def stratagem_cli(capsys: pytest.CaptureFixture[str]) -> Callable[..., subprocess.CompletedProcess]:
    """``stratagem_cli(*args)``: the ``stratagem`` command run in this process (``stratagem.cli.main``, which
    ``python -m stratagem`` calls and exits with), its exit status and output as a ``CompletedProcess``. For a
    command refused before it starts anything, a new interpreter would add seconds of imports and check nothing
    more."""
    from stratagem.cli import main

    def run(*args: str) -> subprocess.CompletedProcess:
        capsys.readouterr()
        message = ""
        try:
            code = main(list(args))
        except SystemExit as exit_:
            # As the interpreter exits: None is 0, a number is the status, anything else is printed and 1.
            code = exit_.code if isinstance(exit_.code, int) else 0 if exit_.code is None else 1
            message = "" if exit_.code is None or isinstance(exit_.code, int) else f"{exit_.code}\n"
        out = capsys.readouterr()
        return subprocess.CompletedProcess(["stratagem", *args], code, out.out, out.err + message)

    return run
