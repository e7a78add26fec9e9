"""The Trainer: options and bad input, the loop's pieces in one process, and a 2-process run against a
one-process reference on the global batch."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

import stratagem as sg
from stratagem import hookimpl
from stratagem.errors import CapabilityError, CheckpointError, ConfigurationError

WORKLOADS = Path(__file__).parent / "workloads"
sys.path.insert(0, str(WORKLOADS))
import sg_workloads as wl  # noqa: E402


def _trainer(tmp_path: Path, **options) -> sg.Trainer:
    options.setdefault("max_steps", 6)
    options.setdefault("enable_progress_bar", False)
    return sg.Trainer(
        strategy="single_device", accelerator="cpu", default_root_dir=tmp_path, seed=7, **options
    )


def _loader(batch: int = 8, shuffle: bool = False) -> DataLoader:
    return DataLoader(wl.dataset(), batch_size=batch, shuffle=shuffle)


def _params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


# -------------------------------------------------------------------------------------------------
# bad input: a clear error before anything runs
# -------------------------------------------------------------------------------------------------


class NoStep(sg.Module):
    def configure_optimizers(self):
        return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)


class NoOptimizer(wl.Regression):
    def configure_optimizers(self):
        return None


class EmptyList(wl.Regression):
    def configure_optimizers(self):
        return []


def test_bad_input_is_refused_before_training(tmp_path: Path) -> None:
    with pytest.raises(CapabilityError, match="16-mixed"):
        sg.Trainer(accelerator="cpu", precision="16-mixed")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigurationError, match="CUDA device"):
            sg.Trainer(accelerator="cuda", devices=2)
    with pytest.raises(ConfigurationError, match="accumulate_grad_batches"):
        sg.Trainer(accumulate_grad_batches=0)
    with pytest.raises(ConfigurationError, match="checkpoint_format"):
        sg.Trainer(checkpoint_format="zip")
    with pytest.raises(ConfigurationError, match="gradient_clip_val"):
        sg.Trainer(gradient_clip_val=-1)
    trainer = _trainer(tmp_path)
    with pytest.raises(ConfigurationError, match="training_step"):
        trainer.fit(NoStep(), _loader())
    with pytest.raises(ConfigurationError, match="returned nothing"):
        _trainer(tmp_path).fit(NoOptimizer(), _loader())
    with pytest.raises(ConfigurationError, match="returned nothing"):
        _trainer(tmp_path).fit(EmptyList(), _loader())
    with pytest.raises(CheckpointError, match="does not exist"):
        _trainer(tmp_path).fit(wl.Regression(), _loader(), ckpt_path=tmp_path / "missing.ckpt")
    with pytest.raises(ConfigurationError, match="iterable of batches"):
        _trainer(tmp_path).fit(wl.Regression(), None)


def test_devices_from_pytest_is_refused_with_advice(tmp_path: Path) -> None:
    trainer = sg.Trainer(strategy=wl.GradAverage(), accelerator="cpu", devices=2, default_root_dir=tmp_path)
    with pytest.raises(ConfigurationError, match="pytest"):
        trainer.fit(wl.Regression(), _loader())
    with pytest.raises(ConfigurationError, match="returned nothing"):
        sg.Trainer(strategy=wl.GradAverage(), accelerator="cpu", devices=2).fit(NoOptimizer(), _loader())


XDIST_TEST = """
import pytest
import sg_workloads as wl
from torch.utils.data import DataLoader

import stratagem as sg
from stratagem.errors import ConfigurationError


def test_fit_on_two_devices(tmp_path):
    trainer = sg.Trainer(strategy=wl.GradAverage(), accelerator="cpu", devices=2, default_root_dir=tmp_path)
    with pytest.raises(ConfigurationError, match="inside pytest would re-run pytest"):
        trainer.fit(wl.Regression(), DataLoader(wl.dataset(), batch_size=8))
"""


def test_devices_from_a_pytest_xdist_worker_is_refused_with_advice(tmp_path: Path) -> None:
    # pytest-xdist runs tests in `python -c` processes that read their code from a pipe: nothing a worker could
    # run again, and no sign of pytest in the command line.
    pytest.importorskip("xdist", reason="needs pytest-xdist (requirements-test.txt)")
    (tmp_path / "test_xdist_fit.py").write_text(XDIST_TEST)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "xdist", "-n", "1", "-q", "-p", "no:cacheprovider"],
        cwd=tmp_path,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(WORKLOADS), os.environ.get("PYTHONPATH")])),
        },
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and "1 passed" in done.stdout, done.stdout[-3000:] + done.stderr[-2000:]


# -------------------------------------------------------------------------------------------------
# the loop in one process
# -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("accumulate, clip", [(1, None), (3, None), (1, 0.05)])
def test_fit_matches_a_plain_pytorch_loop(tmp_path: Path, accumulate: int, clip: float | None) -> None:
    module = wl.Regression()
    trainer = _trainer(tmp_path, max_steps=5, accumulate_grad_batches=accumulate, gradient_clip_val=clip)
    trainer.fit(module, _loader(batch=4))
    expected = wl.reference_loop(accumulate, 4, 5, clip)
    for name, value in _params(module).items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-6)
    assert trainer.global_step == 5
    assert len(module.losses) == 5 * accumulate


def test_accumulation_equals_the_larger_batch(tmp_path: Path) -> None:
    small, large = wl.Regression(), wl.Regression()
    _trainer(tmp_path / "a", max_steps=4, accumulate_grad_batches=2).fit(small, _loader(batch=4))
    _trainer(tmp_path / "b", max_steps=4).fit(large, _loader(batch=8))
    for (name, a), b in zip(_params(small).items(), _params(large).values()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)


def test_epochs_schedulers_validation_csv_and_checkpoints(tmp_path: Path, capsys) -> None:
    module = wl.Regression(scheduler=True)
    trainer = _trainer(
        tmp_path,
        max_steps=None,
        max_epochs=2,
        val_check_interval=4,
        checkpoint_every_n_steps=5,
        keep_last_k=2,
        log_every_n_steps=3,
        enable_progress_bar=True,
    )
    trainer.fit(module, _loader(batch=16), _loader(batch=32))
    # 96 samples / 16 = 6 steps per epoch; StepLR(step_size=3, gamma=0.7) stepped once per optimizer step.
    assert trainer.global_step == 12 and trainer.current_epoch == 2
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.05 * 0.7**4)
    out = capsys.readouterr().out
    assert "validation at step 4" in out and "validation at step 12" in out
    assert "step 12/12" in out and "it/s" in out and "ETA" in out and "loss" in out
    rows = list(csv.DictReader((tmp_path / "metrics.csv").open()))
    train_rows = [r for r in rows if r["loss"]]
    assert [int(r["step"]) for r in train_rows] == [3, 6, 9, 12]
    assert all(float(r["loss"]) == pytest.approx(float(r["mse"])) for r in train_rows)
    assert [int(r["step"]) for r in rows if r["val_mse"]] == [4, 8, 12]
    # Periodic checkpoints at 5 and 10 and the final one at 12; keep_last_k=2 keeps the newest two.
    checkpoints = tmp_path / "checkpoints"
    assert sorted(p.name for p in checkpoints.glob("step-*")) == ["step-000010.ckpt", "step-000012.ckpt"]
    assert (checkpoints / "last").read_text().strip() == "step-000012.ckpt"
    saved = torch.load(checkpoints / "step-000012.ckpt", weights_only=True)
    assert saved["state"]["progress"] == {"step": 12, "epoch": 2, "batch_in_epoch": 0, "samples_in_epoch": 0}
    assert saved["state"]["extras"] == {"extra_counter": 12}
    assert "lr_scheduler_0" in saved["state"]
    # validate() afterwards reuses the set-up model.
    values = trainer.validate(module, _loader(batch=32))
    assert set(values) == {"val_mse"} and values["val_mse"] == pytest.approx(
        trainer.logged_metrics["val_mse"]
    )


def test_resume_from_last_continues_and_a_fresh_start_without_any(tmp_path: Path, capsys) -> None:
    first = wl.Regression()
    _trainer(tmp_path, max_steps=4, checkpoint_every_n_steps=4).fit(first, _loader(batch=4))
    resumed = wl.Regression()
    trainer = _trainer(tmp_path, max_steps=7, checkpoint_every_n_steps=4)
    trainer.fit(resumed, _loader(batch=4), ckpt_path="last")
    assert "Resumed from" in capsys.readouterr().out
    assert trainer.global_step == 7 and len(resumed.losses) == 3 and resumed.extra_counter == 7
    fresh = _trainer(tmp_path / "empty", max_steps=2)
    fresh.fit(wl.Regression(), _loader(batch=4), ckpt_path="last")
    assert "training from the start" in capsys.readouterr().out
    # A checkpoint written by Engine.save has no training position: refused with advice.
    engine_ckpt = tmp_path / "engine.ckpt"
    fresh.engine.save(engine_ckpt, {"model": fresh.model, "optimizer": fresh.optimizers[0]})
    with pytest.raises(CheckpointError, match="training position"):
        _trainer(tmp_path / "other").fit(wl.Regression(), _loader(), ckpt_path=engine_ckpt)


def test_metrics_must_be_scalars_with_a_known_reduction(tmp_path: Path) -> None:
    class Bad(wl.Regression):
        def training_step(self, batch, batch_idx):
            self.log("vector", torch.ones(3))
            return super().training_step(batch, batch_idx)

    with pytest.raises(ConfigurationError, match="scalar"):
        _trainer(tmp_path).fit(Bad(), _loader())


# -------------------------------------------------------------------------------------------------
# two processes against one process on the global batch
# -------------------------------------------------------------------------------------------------


def _reference_trainer(tmp_path: Path, accumulate: int, batch: int, steps: int) -> tuple[dict, sg.Trainer]:
    module = wl.Regression()
    trainer = _trainer(tmp_path, max_steps=steps, accumulate_grad_batches=accumulate, log_every_n_steps=2)
    trainer.fit(module, _loader(batch=batch))
    return _params(module), trainer


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_two_processes_match_one_process_on_the_global_batch(tmp_path: Path) -> None:
    command = [sys.executable, str(WORKLOADS / "sg_workloads.py"), "--devices", "2", "--steps", "10"]
    command += [
        "--batch",
        "4",
        "--accumulate",
        "1",
        "2",
        "--root",
        str(tmp_path),
        "--out",
        str(tmp_path / "out"),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=140)
    assert done.returncode == 0, done.stderr
    ranks = [torch.load(tmp_path / f"out.rank{r}", weights_only=False) for r in (0, 1)]
    for i, accumulate in enumerate((1, 2)):
        expected, reference = _reference_trainer(tmp_path / f"ref{accumulate}", accumulate, batch=8, steps=10)
        for rank in ranks:
            result = rank[i]
            assert result["world_size"] == 2 and result["step"] == 10
            for name, value in result["params"].items():
                torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-5, msg=name)
            # Gradients were synchronised on the last batch of each accumulation only.
            assert result["synced_backwards"] == 10
            assert result["skipped_backwards"] == 10 * (accumulate - 1)
            # The logged loss is reduced across ranks: the global batch's loss.
            assert result["logged"]["loss"] == pytest.approx(reference.logged_metrics["loss"], abs=1e-5)
    # Rank 0 alone draws the progress line and writes the CSV.
    assert done.stdout.count("step 10/10") == 2
    assert (tmp_path / "run0" / "metrics.csv").is_file()


class Eager(wl.Regression):
    """Layers built in __init__ (under Trainer.init_module) rather than in configure_model."""

    def __init__(self) -> None:
        super().__init__()
        wl.Regression.configure_model(self)

    def configure_model(self) -> None:
        pass


def test_init_module_with_empty_init_builds_on_meta_and_trains(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path, max_steps=3)
    with trainer.init_module(empty_init=True):
        module = Eager()
    assert all(p.is_meta for p in module.parameters())
    trainer.fit(module, _loader())
    params = list(module.parameters())
    assert not any(p.is_meta for p in params) and all(torch.isfinite(p).all() for p in params)
    # The optimizer built over the meta parameters was pointed at the materialised ones, and stepped them.
    assert trainer.optimizers[0].param_groups[0]["params"][0] is params[0]
    assert len(module.losses) == 3 and module.losses[0] != module.losses[-1]


# -------------------------------------------------------------------------------------------------
# a strategy that wraps in place: every step runs inside the model's own call
# -------------------------------------------------------------------------------------------------


class InPlaceHooks(sg.SingleDeviceStrategy):
    """Wraps like FSDP2 does: hooks on the user's module itself, which must run around every step (they
    gather the root's parameters there). Records whether each step ran between the pre- and post-hook."""

    def __init__(self) -> None:
        super().__init__()
        self.inside = False
        self.calls: list[tuple[str, bool]] = []

    @hookimpl
    def wrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        def enter(module: torch.nn.Module, args: Any) -> None:
            self.inside = True

        def leave(module: torch.nn.Module, args: Any, output: Any) -> None:
            self.inside = False

        model.register_forward_pre_hook(enter)
        model.register_forward_hook(leave)
        return model


class CallsSubmodules(wl.Regression):
    """Like most real models: the step calls the layers directly, never ``self(x)``."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.trainer.strategy.calls.append(("training_step", self.trainer.strategy.inside))
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.trainer.strategy.calls.append(("validation_step", self.trainer.strategy.inside))


def test_steps_run_inside_the_call_of_a_model_wrapped_in_place(tmp_path: Path) -> None:
    strategy = InPlaceHooks()
    trainer = sg.Trainer(
        strategy=strategy,
        accelerator="cpu",
        max_steps=3,
        val_check_interval=2,
        limit_val_batches=2,
        default_root_dir=tmp_path,
        enable_progress_bar=False,
    )
    trainer.fit(CallsSubmodules(), _loader(), val_dataloaders=_loader())
    assert trainer.model is trainer.module  # wrapped in place
    steps = [inside for name, inside in strategy.calls if name == "training_step"]
    validations = [inside for name, inside in strategy.calls if name == "validation_step"]
    assert steps == [True, True, True]
    assert validations == [True, True]
