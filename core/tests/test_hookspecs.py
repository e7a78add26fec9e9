"""Every hook is typed, documented in code and in docs/hooks.md, and overridable only with its marker."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from stratagem import hookimpl, hookspecs
from stratagem.errors import HookImplementationError
from stratagem.strategies import Strategy

HOOKS = sorted(
    name for name, value in vars(hookspecs).items() if callable(value) and hasattr(value, "stratagem_spec")
)
DOCS = Path(__file__).resolve().parents[2] / "docs" / "hooks.md"
DESIGN_TABLE = {
    "register_strategies",
    "setup_environment",
    "model_init_context",
    "model_sharded_context",
    "wrap_model",
    "forward_context",
    "setup_optimizers",
    "backward",
    "optimizer_step",
    "clip_gradients",
    "no_sync",
    "distributed_sampler_kwargs",
    "save_checkpoint",
    "load_checkpoint",
    "all_reduce",
    "all_gather",
    "broadcast",
    "barrier",
    "teardown",
}
#: A strategy that runs the step itself (issue 28: pipelines); the base class returns None.
STEP_TABLE = {"check_batch_size", "run_training_batch", "run_evaluation_batch"}
#: The launcher plugins' hooks (DESIGN: "where it grows next").
LAUNCHER_TABLE = {"register_launchers", "launch_workers"}
#: Asked by the plan (issue 39: stratagem plan, strategy="auto"), never during a run.
PLAN_TABLE = {"estimate_memory"}
#: What each rank holds of the model, for Hugging Face weights in and out (issue 38).
WEIGHTS_TABLE = {"weight_shards"}
#: Callbacks and loggers: their discovery hooks and the Trainer's events (issue 18).
CALLBACK_TABLE = {"register_callbacks", "register_loggers", *hookspecs.TRAINER_EVENTS}
#: What to install for a name no plugin registers, declared by the plugins (issue 37: the core names none).
HINTS_TABLE = {"register_install_hints"}


def test_every_design_hook_exists():
    assert (
        set(HOOKS)
        == DESIGN_TABLE
        | STEP_TABLE
        | LAUNCHER_TABLE
        | CALLBACK_TABLE
        | HINTS_TABLE
        | WEIGHTS_TABLE
        | PLAN_TABLE
    )


def test_trainer_events_are_broadcast_hooks_and_no_strategy_operation():
    from stratagem.registry._manager import STRATEGY_HOOKS

    for name in hookspecs.TRAINER_EVENTS:
        assert not getattr(hookspecs, name).stratagem_spec.get("firstresult"), name
        assert name not in STRATEGY_HOOKS


@pytest.mark.parametrize("name", HOOKS)
def test_hook_has_summary_params_and_result_note(name):
    spec = getattr(hookspecs, name)
    doc = inspect.getdoc(spec)
    assert doc and doc.splitlines()[0].endswith("."), f"{name}: one-line summary"
    for param in inspect.signature(spec).parameters:
        assert f":param {param}:" in doc, f"{name}: no :param {param}:"
        assert inspect.signature(spec).parameters[param].annotation is not inspect.Parameter.empty
    firstresult = spec.stratagem_spec.get("firstresult", False)
    assert ("first non-``None`` result" in doc) == firstresult, f"{name}: firstresult note"


@pytest.mark.parametrize("name", HOOKS)
def test_hook_is_documented_in_reference(name):
    text = DOCS.read_text()
    heading = re.search(rf"^### `{name}\((.*?)\)`", text, re.MULTILINE)
    assert heading, f"docs/hooks.md has no section for {name}"
    documented = [a.strip().split(":")[0] for a in heading.group(1).split(",") if a.strip()]
    assert documented == list(inspect.signature(getattr(hookspecs, name)).parameters)


def test_override_without_marker_is_refused_at_class_definition():
    with pytest.raises(HookImplementationError) as caught:

        class Forgetful(Strategy):
            def wrap_model(self, model):
                return model

    message = str(caught.value)
    assert "Forgetful.wrap_model" in message and "without @stratagem.hookimpl" in message


def test_override_with_unknown_argument_is_refused():
    with pytest.raises(HookImplementationError, match=r"takes \['device'\]"):

        class Confused(Strategy):
            @hookimpl
            def wrap_model(self, model, device):
                return model


def test_override_with_fewer_arguments_is_accepted_and_called():
    from stratagem.registry._manager import StrategyHooks

    class Lean(Strategy):
        @hookimpl
        def setup_optimizers(self, optimizers):
            return optimizers[::-1]

    hooks = StrategyHooks(Lean(), addons=[])
    assert hooks.setup_optimizers(model=None, optimizers=[1, 2]) == [2, 1]
