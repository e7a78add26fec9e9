"""Fixtures of the repository-wide tests: their worker modules importable (here and, through the spawn start
method's copy of ``sys.path``, in workers), and one inductor cache for the whole session."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


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
