"""An add-on plugin that counts the strategy operations a contract run goes through.

It wraps every strategy hook with ``@hookimpl(wrapper=True)``, the way any add-on (compile, profiling) sits
around the chosen strategy, so what it records is what the Engine really called.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Generator
from typing import Any

from stratagem.hookspecs import hookimpl
from stratagem.registry._manager import STRATEGY_HOOKS

#: Hooks that return None unless the strategy runs the step itself; such results are counted apart too.
STEP_HOOKS = frozenset({"run_training_batch", "run_evaluation_batch"})


def _counting(hook: str) -> Any:
    @hookimpl(wrapper=True, specname=hook)
    def wrapper(self: HookRecorder) -> Generator[None, Any, Any]:
        self.calls[hook] += 1
        result = yield
        if hook in STEP_HOOKS and result is not None:
            self.calls[f"{hook}:owned"] += 1
        return result

    wrapper.__name__ = f"record_{hook}"
    return wrapper


class HookRecorder:
    """Counts calls of each strategy hook; ``calls`` maps hook name to count (and ``"<hook>:owned"`` to the
    calls of a step hook that returned a result: the strategy ran the step itself)."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()

    def snapshot(self) -> dict[str, int]:
        return dict(self.calls)


for _hook in sorted(STRATEGY_HOOKS):
    setattr(HookRecorder, f"record_{_hook}", _counting(_hook))
del _hook
