"""``Engine.launch(fn)`` for a function that cannot travel to spawned workers, by re-running the script.

A function that pickles is sent to spawned workers as it is. A lambda, a closure or a ``functools.partial``
of a local function does not pickle; when the process runs a script, the workers run the script again
instead, and when they reach the same ``launch`` call they run its function there. Each ``launch`` call of a
script has a number; a re-run worker replays the results of the calls before its own (the launching process
hands them over), runs its own call's function, sends rank 0's result back through a private directory and
ends. The launching process then continues the script with that result, as it would after a spawn.
"""

from __future__ import annotations

import os
import pickle
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stratagem.checkpoint import _scratch
from stratagem.errors import ConfigurationError

#: In a re-run worker: the number of the ``launch`` call whose function it runs.
CALL_ENV = "STRATAGEM_LAUNCH_CALL"
#: In a re-run worker: the directory holding earlier calls' results, where rank 0 writes its own.
RESULTS_ENV = "STRATAGEM_LAUNCH_RESULTS"
_RESULT_FILE = "result.pkl"

_calls_made = 0
#: In the launching process: the result of each ``launch`` call so far, for re-run workers to replay.
_results: list[Any] = []


def how_started() -> str:
    """``"script"`` for a file, ``-m module`` or ``-c`` code that workers can run again; ``"pytest"`` under
    pytest (re-running it would re-run the test session); ``"interactive"`` for a REPL or a notebook."""
    argv0 = sys.argv[0] if sys.argv else ""
    main = sys.modules.get("__main__")
    if not argv0 or "ipykernel" in sys.modules:
        return "interactive"
    if Path(argv0).name in ("pytest", "py.test") or argv0.endswith(os.path.join("pytest", "__main__.py")):
        return "pytest"
    # A pytest-xdist worker: `python -c` reading its code from a pipe, pytest loaded as a library. (A process
    # that one starts inherits the variable, not the module.)
    if os.environ.get("PYTEST_XDIST_WORKER") and "xdist.plugin" in sys.modules:
        return "pytest"
    if argv0 == "-c" or hasattr(main, "__file__") or getattr(main, "__spec__", None) is not None:
        return "script"
    return "interactive"


def why_not_spawnable(fn: Callable[..., Any], args: tuple[Any, ...]) -> str | None:
    """Why ``fn(engine, *args)`` cannot be sent to spawned workers, or ``None`` if it can."""
    try:
        pickle.dumps((fn, args))
    except Exception as error:  # pickling raises several types (PicklingError, AttributeError, TypeError)
        return f"{type(error).__name__}: {error}"
    main = sys.modules.get("__main__")
    if getattr(fn, "__module__", None) == "__main__" and not hasattr(main, "__file__"):
        # Pickled by reference to __main__, which a spawned worker cannot import from a REPL or notebook.
        return f"{getattr(fn, '__qualname__', fn)!r} is defined in an interactive session"
    return None


def next_call() -> int:
    """Number this process's next ``launch`` call (1, 2, ...)."""
    global _calls_made
    _calls_made += 1
    return _calls_made


def record(result: Any) -> None:
    _results.append(result)


def target_call() -> int | None:
    """In a re-run worker, the number of the ``launch`` call to run; otherwise ``None``."""
    value = os.environ.get(CALL_ENV)
    return int(value) if value else None


def replayed_result(call: int) -> Any:
    """What the launching process got from an earlier call: a re-run worker passes through it unchanged."""
    with open(Path(os.environ[RESULTS_ENV]) / f"call-{call}.pkl", "rb") as file:
        return pickle.load(file)  # written by the launching process that started this worker


def send_result(result: Any, call: int) -> None:
    """Rank 0 of a re-run worker group: hand ``result`` to the launching process."""
    path = Path(os.environ[RESULTS_ENV]) / _RESULT_FILE
    try:
        data = pickle.dumps(result)
    except Exception as error:
        raise ConfigurationError(
            f"launch call {call}: rank 0's result cannot be sent back to the launching process ({error}). "
            "Return plain data (numbers, strings, tensors, lists and dicts of them)."
        ) from error
    path.write_bytes(data)


def run_script_for(call: int, run_script: Callable[[dict[str, str]], None]) -> Any:
    """Re-run this script in workers (``run_script(env)``) to run launch call ``call``; return rank 0's result."""
    with _scratch.folder("launch") as directory:  # private: mode 0700
        for number, result in enumerate(_results, start=1):
            (directory / f"call-{number}.pkl").write_bytes(pickle.dumps(result))
        run_script({CALL_ENV: str(call), RESULTS_ENV: str(directory)})
        produced = directory / _RESULT_FILE
        if not produced.is_file():
            raise ConfigurationError(
                f"The workers re-ran this script but did not reach launch call {call}: the script must make the "
                "same launch() calls in the same order on every run (no branching on randomness or time "
                "before them)."
            )
        with open(produced, "rb") as file:
            return pickle.load(file)  # written by this process's own workers
