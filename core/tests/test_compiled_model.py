"""A model that reaches a Trainer entry point compiled by ``torch.compile`` (``trainer.fit(torch.compile(model))``)
or ``Module.compile()``, in one process: the options torch.compile was given, read back; every entry point
unwraps it and compiles it in the framework's place with those options; the Trainer's ``compile=`` wins. The
same under each strategy family on real runs is ``tests/test_compile_strategies.py`` (and the pp plugin's)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import stratagem as sg
from stratagem.contract import _suite_model as m
from stratagem.strategies import _regions
from stratagem.strategies.compiling import CompileOptions, dynamo_counts, unwrap_compiled

NOTE = "stratagem: the model came compiled by torch.compile"


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Any:
    """Dynamo keeps compiled code per code object, across tests: none is left for a later test that counts the
    frames it compiles (test_compile.py's)."""
    yield
    torch._dynamo.reset()


class Steps(m.StepModule):
    """The contract model with every step an entry point calls."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.compute_loss(self(batch[0]), batch[1]))

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", self.compute_loss(self(batch[0]), batch[1]))

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])


class Seen:
    """What a callback sees as the Trainer's module."""

    def __init__(self) -> None:
        self.modules: list[Any] = []

    @sg.hookimpl
    def on_train_batch_end(self, trainer: Any, outputs: Any, batch: Any, batch_idx: int, step: int) -> None:
        self.modules.append(trainer.module)


def _trainer(root: Path, **options: Any) -> sg.Trainer:
    return sg.Trainer(
        strategy="single_device", accelerator="cpu", enable_progress_bar=False, loggers=[], default_root_dir=root,
        **options,
    )  # fmt: skip


def _loader() -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(m.dataset(1), batch_size=m.PER_RANK_BATCH)


def _notes(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith(NOTE)]


def test_the_options_torch_compile_was_given_are_read_back() -> None:
    cases = [
        ({"backend": "aot_eager", "fullgraph": True, "dynamic": False}, CompileOptions(backend="aot_eager", fullgraph=True, dynamic=False)),
        # torch keeps the settings a mode stands for, not its name: the mode is found from them.
        ({"mode": "max-autotune-no-cudagraphs", "dynamic": True}, CompileOptions(mode="max-autotune-no-cudagraphs", dynamic=True)),
        ({"mode": "reduce-overhead"}, CompileOptions(mode="reduce-overhead")),
        ({"mode": "default"}, CompileOptions()),
    ]  # fmt: skip
    for given, expected in cases:
        model = m.build_model()
        plain, where, found = unwrap_compiled(torch.compile(model, **given))
        assert (plain, where, found) == (model, [""], expected), given
    # Module.compile() compiles in place: its options are read from what it set.
    model = m.build_model()
    model.compile(backend="eager", fullgraph=True)
    plain, where, found = unwrap_compiled(model)
    assert (plain, where, found) == (model, [""], CompileOptions(backend="eager", fullgraph=True))
    assert model._compiled_call_impl is None


def test_fit_takes_a_compiled_module_and_the_other_entry_points_its_wrapper_after(
    tmp_path: Path, capsys
) -> None:
    module = Steps()
    keys = list(module.state_dict())
    compiled = torch.compile(module, backend="aot_eager", dynamic=False)
    seen = Seen()
    trainer = _trainer(tmp_path, max_steps=2, checkpoint_every_n_steps=2, callbacks=[seen])
    before = dynamo_counts()["frames"]
    trainer.fit(compiled, _loader())
    # The Trainer holds the user's module, compiled in place per block with the options torch.compile was given.
    assert trainer.module is module and seen.modules == [module, module]
    assert trainer.engine.compiled_regions == ["blocks.0", "blocks.1"]
    assert trainer._setup.compile == CompileOptions(backend="aot_eager", dynamic=False)
    assert dynamo_counts()["frames"] > before
    notes = _notes(capsys.readouterr().out)
    assert len(notes) == 1 and "(the model)" in notes[0], notes
    assert "(backend=aot_eager, dynamic=False)" in notes[0], notes
    saved = torch.load(tmp_path / "checkpoints" / "step-000002.ckpt", weights_only=True)["model"]["model"]
    assert list(saved) == keys
    # The wrapper again: the set-up module, its compiled blocks left as they are, and no second note.
    assert "val_loss" in trainer.validate(compiled, dataloaders=_loader())
    assert "test_loss" in trainer.test(compiled, dataloaders=_loader())
    assert len(trainer.predict(compiled, dataloaders=_loader())) == len(_loader())
    assert all(_regions.is_compiled(block) for block in module.blocks)
    assert _notes(capsys.readouterr().out) == []


@pytest.mark.parametrize("method", ["validate", "test", "predict"])
def test_an_evaluation_entry_point_takes_a_compiled_module_first(tmp_path: Path, capsys, method: str) -> None:
    module = Steps()
    trainer = _trainer(tmp_path)
    getattr(trainer, method)(torch.compile(module, backend="eager"), dataloaders=_loader())
    assert trainer.module is module and trainer.engine.compiled_regions == ["blocks.0", "blocks.1"]
    notes = _notes(capsys.readouterr().out)
    assert len(notes) == 1 and "(backend=eager)" in notes[0], notes


def test_the_trainers_compile_option_wins(tmp_path: Path, capsys) -> None:
    module = Steps()
    trainer = _trainer(tmp_path / "eager", compile={"backend": "eager", "regional": False})
    trainer.validate(torch.compile(module, backend="aot_eager"), dataloaders=_loader())
    assert trainer.module is module and trainer.engine.compiled_regions == [""]
    assert "(backend=eager, regional=False)" in _notes(capsys.readouterr().out)[0]

    module = Steps()
    module.blocks[1] = torch.compile(module.blocks[1], backend="eager")
    trainer = _trainer(tmp_path / "off", compile=False)
    trainer.validate(torch.compile(module, backend="aot_eager"), dataloaders=_loader())
    assert trainer.module is module and trainer.engine.compiled_regions == []
    assert not any(_regions.is_compiled(block) for block in module.blocks)
    assert _notes(capsys.readouterr().out) == [
        f"{NOTE} (the model, blocks.1); unwrapped and not compiled (compile=False)."
    ]
