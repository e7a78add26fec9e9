"""Every strategy hook of ``stratagem.hookspecs`` is exercised by the checks above.

The workers run with a recording add-on (``@hookimpl(wrapper=True)`` around every strategy operation), so
this counts what the Engine really called; ``register_strategies`` ran when the registry was built. A strategy
that runs the step itself (``owns_step``: its ``run_training_batch`` returns a result) is never asked for the
ordinary step's ``forward_context`` and ``backward``; its step hooks must answer on every call, as declared.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from stratagem.contract._comparisons import fail_on, skip_undeclared

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


def exercised_hooks(run: Any) -> Counter[str]:
    calls: Counter[str] = Counter()
    for results in (run.phase1, run.phase2):
        for result in results.values():
            calls.update(result.get("calls", {}))
    return calls


#: The hooks of the loops' ordinary step, which a strategy that runs the step itself never reaches.
ORDINARY_STEP = ("forward_context", "backward")


def test_every_hook_is_exercised(contract_run: Any) -> None:
    from stratagem.registry._manager import STRATEGY_HOOKS, get_registry

    if contract_run.subject.no_training:
        skip_undeclared("precisions", "32-true", contract_run.subject.no_training)
    calls = exercised_hooks(contract_run)
    owns_step = bool(calls["run_training_batch:owned"])
    problems = [
        f"hook {hook!r}: expected at least one call during the contract run, got none"
        for hook in sorted(STRATEGY_HOOKS)
        if not calls[hook] and not (owns_step and hook in ORDINARY_STEP)
    ]
    declared = bool(getattr(contract_run.subject.strategy_class, "owns_step", False))
    if owns_step != declared:
        problems.append(
            f"run_training_batch: returned a result {calls['run_training_batch:owned']} time(s) of "
            f"{calls['run_training_batch']}, but the strategy declares owns_step={declared}"
        )
    if owns_step and calls["run_training_batch:owned"] != calls["run_training_batch"]:
        problems.append("run_training_batch: returned a result on some calls and None on others")
    for hook in ORDINARY_STEP if owns_step else ():
        if calls[hook]:
            problems.append(
                f"hook {hook!r}: called {calls[hook]} time(s) although the strategy runs the step"
            )
    if contract_run.subject.registered not in get_registry():
        problems.append("register_strategies: expected it to have registered the strategy, got no entry")
    fail_on(problems, f"hooks exercised (calls: {dict(sorted(calls.items()))})")
