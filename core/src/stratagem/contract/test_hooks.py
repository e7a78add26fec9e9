"""Every strategy hook of ``stratagem.hookspecs`` is exercised by the checks above.

The workers run with a recording add-on (``@hookimpl(wrapper=True)`` around every strategy operation), so
this counts what the Engine really called; ``register_strategies`` ran when the registry was built.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from stratagem.contract._checks import fail_on, skip_undeclared

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


def exercised_hooks(run: Any) -> Counter[str]:
    calls: Counter[str] = Counter()
    for results in (run.phase1, run.phase2):
        for result in results.values():
            calls.update(result.get("calls", {}))
    return calls


def test_every_hook_is_exercised(contract_run: Any) -> None:
    from stratagem.registry._manager import STRATEGY_HOOKS, get_registry

    if contract_run.subject.no_training:
        skip_undeclared("precisions", "32-true", contract_run.subject.no_training)
    calls = exercised_hooks(contract_run)
    problems = [
        f"hook {hook!r}: expected at least one call during the contract run, got none"
        for hook in sorted(STRATEGY_HOOKS)
        if not calls[hook]
    ]
    if contract_run.subject.registered not in get_registry():
        problems.append("register_strategies: expected it to have registered the strategy, got no entry")
    fail_on(problems, f"hooks exercised (calls: {dict(sorted(calls.items()))})")
