"""Leaving the process group when a script that used a Trainer ends (registered as its run is first set up)."""

from __future__ import annotations

import atexit
import contextlib
from typing import TYPE_CHECKING

from stratagem.launchers import _worker_start

if TYPE_CHECKING:
    from stratagem.engine import Engine

_TEARDOWN_REGISTERED: set[int] = set()


def _register_teardown(engine: Engine) -> None:
    """Leave the process group when the script ends normally (the Trainer may be used after ``fit``).

    Not after an uncaught exception: the barrier of the teardown would wait for peers that the launcher is
    stopping anyway.
    """
    if id(engine) in _TEARDOWN_REGISTERED:
        return
    _TEARDOWN_REGISTERED.add(id(engine))
    _worker_start.watch_uncaught()

    def teardown() -> None:
        if _worker_start.uncaught_exception():
            return
        # A peer that failed makes the barrier fail here too; the launcher reports that peer's error.
        with contextlib.suppress(Exception):
            engine.teardown()

    atexit.register(teardown)
