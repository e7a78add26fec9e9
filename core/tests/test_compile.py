"""``compile=`` in one process: the options and their errors, which modules are compiled, compiling in place
(keys unchanged, Dynamo frames really compiled), a model compiled before it arrives, graph breaks, and where a
strategy puts compile through ``wrap_model``'s ``compiler``. Multi-process runs per strategy family are in
``tests/test_compile_strategies.py``; the contract suite's compile section in ``stratagem.contract``."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from stratagem import ConfigurationError, hookimpl
from stratagem.contract import _suite_model as m
from stratagem.engine import Engine
from stratagem.errors import CompileError
from stratagem.strategies import Strategy, _regions
from stratagem.strategies.compiling import CompileOptions, compile_options, dynamo_counts

EAGER = {"backend": "eager"}
AOT = {"backend": "aot_eager"}


def _engine() -> Engine:
    return Engine("single_device", accelerator="cpu")


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> torch.Tensor:
    tokens, targets = m.dataset(1)[step * 8 : (step + 1) * 8]
    loss = m.loss_fn(model(tokens), targets)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


# -------------------------------------------------------------------------------------------------
# options
# -------------------------------------------------------------------------------------------------


def test_an_unknown_backend_names_the_backends_and_the_closest() -> None:
    with pytest.raises(ConfigurationError) as caught:
        compile_options({"backend": "inductr"})
    message = str(caught.value)
    assert "backend='inductr' is not a torch.compile backend. Did you mean 'inductor'?" in message
    assert "aot_eager" in message and "eager" in message


def test_an_unknown_mode_names_the_modes_and_the_closest() -> None:
    with pytest.raises(ConfigurationError) as caught:
        compile_options({"mode": "max-autotun"})
    assert "mode='max-autotun' is not an inductor mode. Did you mean 'max-autotune'?" in str(caught.value)
    assert "reduce-overhead" in str(caught.value)
    with pytest.raises(ConfigurationError, match="inductor mode, and backend='aot_eager' takes none"):
        compile_options({"backend": "aot_eager", "mode": "default"})


def test_an_unknown_option_or_value_is_refused() -> None:
    with pytest.raises(
        ConfigurationError, match=r"unknown option\(s\) \['backnd'\]. Did you mean 'backend'\?"
    ):
        compile_options({"backnd": "eager"})
    with pytest.raises(ConfigurationError, match="fullgraph='yes': give True or False"):
        compile_options({"fullgraph": "yes"})
    with pytest.raises(ConfigurationError, match="compile=3: give True, False"):
        compile_options(3)


def test_the_forms_compile_takes() -> None:
    assert compile_options(True) == CompileOptions()
    assert compile_options(None) is None and compile_options(False) is None and compile_options("0") is None
    assert compile_options("1") == CompileOptions()
    assert compile_options("aot_eager") == CompileOptions(backend="aot_eager")
    assert compile_options("backend=eager,fullgraph=true,regional=Block") == CompileOptions(
        backend="eager", fullgraph=True, regional=frozenset({"Block"})
    )


# -------------------------------------------------------------------------------------------------
# which modules
# -------------------------------------------------------------------------------------------------


def _names(model: nn.Module, regional: object) -> list[str]:
    return [name for name, _ in _regions.find_regions(model, CompileOptions(regional=regional).regional)]


def test_regions_are_the_repeated_blocks_or_the_whole_model() -> None:
    contract = m.build_model()
    assert _names(contract, None) == ["blocks.0", "blocks.1"]
    assert _names(contract, True) == ["blocks.0", "blocks.1"]
    assert _names(contract, False) == [""]
    assert _names(contract, {"Block"}) == _names(contract, m.Block) == ["blocks.0", "blocks.1"]
    # torch.nn's own leaves repeat everywhere and are never blocks: an MLP compiles whole.
    mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    assert _names(mlp, None) == [""]
    with pytest.raises(ConfigurationError, match="Sequential has no repeated blocks"):
        _names(mlp, True)
    with pytest.raises(ConfigurationError, match=r"no module of ContractModel has such a class\. Classes in"):
        _names(contract, {"Bloc"})


# -------------------------------------------------------------------------------------------------
# compiling in place
# -------------------------------------------------------------------------------------------------


def test_compiled_in_place_trains_as_eager_with_the_same_keys() -> None:
    engine = _engine()
    model = m.build_model()
    eager = copy.deepcopy(model)
    keys = list(model.state_dict())
    optimizer = torch.optim.AdamW(model.parameters(), lr=m.LEARNING_RATE)
    model, optimizer = engine.setup(model, optimizer, compile=AOT)
    assert engine.compiled_regions == ["blocks.0", "blocks.1"]
    assert list(model.state_dict()) == keys and [n for n, _ in model.named_parameters()] == [
        n for n, _ in eager.named_parameters()
    ]
    eager_optimizer = torch.optim.AdamW(eager.parameters(), lr=m.LEARNING_RATE)
    before = dynamo_counts()["frames"]
    for step in range(3):
        compiled_loss = _step(model, optimizer, step)
        eager_loss = _step(eager, eager_optimizer, step)
        torch.testing.assert_close(compiled_loss, eager_loss, rtol=1e-6, atol=0)
    # Both blocks share one compiled frame: Dynamo really compiled, once.
    assert dynamo_counts()["frames"] - before == 1
    # A copy of the model (an EMA, a teacher) runs its own parameters through the compiled code.
    twin = copy.deepcopy(model)
    assert twin.blocks[0].forward.__self__ is twin.blocks[0]
    teardown(engine)


def test_torch_containers_compile_where_module_compile_compiles_nothing() -> None:
    """``nn.Module.compile()`` on a module whose forward is torch's own (``Sequential``) compiles no frame in
    torch 2.13: the pitfall a test that only checks "it ran" misses. Ours compiles it."""
    torch_way = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    torch_way.compile(backend="eager")
    before = dynamo_counts()["frames"]
    torch_way(torch.randn(2, 4))
    assert dynamo_counts()["frames"] == before
    engine = _engine()
    ours = engine.setup_module(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)), compile=EAGER)
    ours(torch.randn(2, 4))
    assert engine.compiled_regions == [""] and dynamo_counts()["frames"] == before + 1
    teardown(engine)


def test_a_model_compiled_before_is_unwrapped_and_compiled_again_with_one_note() -> None:
    model = m.build_model()
    model.blocks[1] = torch.compile(model.blocks[1], backend="eager")
    model.norm.compile(backend="eager")
    wrapped = torch.compile(model, backend="aot_eager")
    assert any("_orig_mod" in k for k in wrapped.state_dict())
    engine = _engine()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plain = engine.setup_module(wrapped)
    notes = [str(w.message) for w in caught if "came compiled by torch.compile" in str(w.message)]
    assert len(notes) == 1, notes
    assert "(the model, blocks.1, norm)" in notes[0] and "backend=aot_eager" in notes[0], notes[0]
    assert plain is model and not any("_orig_mod" in k for k in plain.state_dict())
    assert plain.norm._compiled_call_impl is None
    assert engine.compiled_regions == ["blocks.0", "blocks.1"]
    before = dynamo_counts()["frames"]
    plain(m.dataset(1)[:4][0])
    assert dynamo_counts()["frames"] > before
    teardown(engine)


class Breaky(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.linear(x)
        torch._dynamo.graph_break()
        return torch.relu(x)


def test_fullgraph_names_the_graph_break() -> None:
    engine = _engine()
    model = engine.setup_module(nn.Sequential(Breaky(), Breaky()), compile={**EAGER, "fullgraph": True})
    with pytest.raises(CompileError) as caught:
        model(torch.randn(2, 4))
    message = str(caught.value)
    assert message.startswith("compile(fullgraph=True): 0 (Breaky) cannot be compiled as one graph:"), message
    assert "graph_break()" in message and "fullgraph=False" in message, message
    teardown(engine)


def test_a_graph_break_is_reported_once_by_region() -> None:
    engine = _engine()
    model = engine.setup_module(nn.Sequential(Breaky(), Breaky(), Breaky()), compile=EAGER)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            model(torch.randn(2, 4))
    reports = [str(w.message) for w in caught if "stratagem compile" in str(w.message)]
    assert len(reports) == 1, reports
    assert reports[0].startswith("stratagem compile: a graph break in 0 (Breaky): "), reports[0]
    assert "graph_break()" in reports[0], reports[0]
    teardown(engine)


# -------------------------------------------------------------------------------------------------
# where a strategy puts compile
# -------------------------------------------------------------------------------------------------


class SaysNothing(Strategy):
    seen: list[bool] = []

    @hookimpl
    def wrap_model(self, model: nn.Module) -> nn.Module:
        type(self).seen = [_regions.is_compiled(b) for b in model.blocks]
        return Strategy.wrap_model(self, model)


class ChecksThenCompiles(Strategy):
    """Activation checkpointing, then compile, then (nothing to) wrap: the order a sharding strategy keeps."""

    @hookimpl
    def wrap_model(self, model: nn.Module, compiler: object) -> nn.Module:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for index, block in enumerate(model.blocks):
            model.blocks[index] = checkpoint_wrapper(block)
        compiler(model)
        return Strategy.wrap_model(self, model)


class ForgetsToCompile(Strategy):
    @hookimpl
    def wrap_model(self, model: nn.Module, compiler: object) -> nn.Module:
        return Strategy.wrap_model(self, model)


def test_a_strategy_that_says_nothing_gets_the_model_compiled_before_wrap_model() -> None:
    engine = Engine(SaysNothing(), accelerator="cpu")
    engine.setup_module(m.build_model(), compile=EAGER)
    assert SaysNothing.seen == [True, True]
    teardown(engine)


def test_a_strategy_that_takes_compiler_compiles_in_its_own_place() -> None:
    engine = Engine(ChecksThenCompiles(), accelerator="cpu")
    model = engine.setup_module(m.build_model(), compile=AOT)
    assert engine.compiled_regions == ["blocks.0", "blocks.1"]
    # The checkpoint wrapper is the compiled region: recomputation happens inside the compiled code.
    assert all(_regions.is_compiled(b) and hasattr(b, "_checkpoint_wrapped_module") for b in model.blocks)
    before = dynamo_counts()["frames"]
    tokens, targets = m.dataset(1)[:4]
    m.loss_fn(model(tokens), targets).backward()
    assert dynamo_counts()["frames"] > before
    assert sorted(k.replace("_checkpoint_wrapped_module.", "") for k in model.state_dict()) == sorted(
        m.build_model().state_dict()
    )
    teardown(engine)


def test_a_strategy_that_takes_compiler_must_call_it() -> None:
    engine = Engine(ForgetsToCompile(), accelerator="cpu")
    with pytest.raises(ConfigurationError, match="takes wrap_model's `compiler` but did not call it"):
        engine.setup_module(m.build_model(), compile=EAGER)
    engine.setup_module(m.build_model())  # without compile= nothing is expected of it
    teardown(engine)


NO_COMPILE_PLUGIN = """
from stratagem import Capabilities, hookimpl


@hookimpl
def register_strategies(register):
    register(
        "cannot_compile",
        "stratagem.strategies.single_device:SingleDeviceStrategy",
        description="declares compile=False",
        capabilities=Capabilities(max_world_size=1, compile=False),
    )
"""


def test_a_strategy_that_declares_it_cannot_compile_is_refused(make_distribution, monkeypatch) -> None:
    from stratagem.trainer import Trainer

    make_distribution(
        "no-compile", "0.1", {"nocompile": "no_compile_plugin"}, {"no_compile_plugin": NO_COMPILE_PLUGIN}
    )
    monkeypatch.setenv("STRATAGEM_PLUGINS", "nocompile")
    with pytest.raises(ConfigurationError) as caught:
        Trainer(strategy="cannot_compile", accelerator="cpu", compile=True)
    message = str(caught.value)
    assert "strategy 'cannot_compile' declares it cannot be compiled" in message, message
    assert "choose a strategy that compiles: single_device" in message, message
    Trainer(strategy="cannot_compile", accelerator="cpu")  # without compile= it is fine


def teardown(engine: Engine) -> None:
    engine.teardown()
