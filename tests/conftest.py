"""Fixtures shared by the repository-wide tests: their worker modules importable (here and, through the spawn
start method's copy of ``sys.path``, in workers), one inductor cache for the whole session, the docs site."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
DOCS_REQUIREMENTS = "pip install -r requirements-docs.txt"


def build_site(root: Path, out: Path) -> tuple[float, str]:
    """``mkdocs build --strict`` of the checkout at ``root`` into ``out``; fails the test on any warning."""
    pytest.importorskip(
        "mkdocstrings_handlers.python", reason=f"the docs tools are not installed: {DOCS_REQUIREMENTS}"
    )
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(root / "mkdocs.yml"), "-d", str(out)],
        cwd=root,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=180,
    )
    elapsed = time.perf_counter() - start
    log = done.stdout + done.stderr
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{log}"
    warnings = [line for line in log.splitlines() if line.startswith(("WARNING", "ERROR"))]
    assert not warnings, "\n".join(warnings)
    return elapsed, log


@pytest.fixture(scope="session")
def check_site() -> ModuleType:
    """docs/gen/check_site.py, the completeness check (a script beside the generators, not a package)."""
    spec = importlib.util.spec_from_file_location("check_site", ROOT / "docs" / "gen" / "check_site.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


@pytest.fixture(scope="session")
def build_docs() -> Callable[[Path, Path], tuple[float, str]]:
    """``build_docs(checkout, out)``: a strict build of another checkout (a modified copy, say)."""
    return build_site


@pytest.fixture(scope="session")
def built_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The documentation site of this checkout, built once per session (strictly: a warning fails it)."""
    out = tmp_path_factory.mktemp("site")
    elapsed, _ = build_site(ROOT, out)
    print(f"docs: mkdocs build --strict took {elapsed:.1f} s")
    return out


@pytest.fixture(scope="session")
def inductor_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """``TORCHINDUCTOR_CACHE_DIR`` for this session's workers, beside pytest's numbered temp dirs so that it
    outlives the session: a graph one test compiled, the next finds compiled (the same block compiles to the
    same code under ddp, fsdp and DeepSpeed), and a second session finds it warm."""
    path = tmp_path_factory.getbasetemp().parent / "stratagem-inductor-cache"
    path.mkdir(parents=True, exist_ok=True)
    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    yield path
    if before is None:
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
    else:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = before


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The runs across hosts (marker ``cluster``: tests/test_many_hosts.py, the SLURM and Ray clusters of two
    hosts) take about 11 minutes of a whole run on 2 cores, which CI's time cannot hold with the rest: a whole run
    leaves them out, saying so, unless STRATAGEM_CLUSTER_TESTS=1 or ``-m cluster`` asks for them. Naming their
    files runs them as well (this file is not loaded then)."""
    if os.environ.get("STRATAGEM_CLUSTER_TESTS") == "1" or "cluster" in (config.getoption("markexpr") or ""):
        return
    across = [item for item in items if item.get_closest_marker("cluster") is not None]
    if across:
        items[:] = [item for item in items if item.get_closest_marker("cluster") is None]
        config.hook.pytest_deselected(items=across)
