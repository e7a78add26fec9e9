"""Callbacks and loggers: the events' exact order on two processes, EarlyStopping, best-k checkpoints across a
resume, the TensorBoard / MLflow / W&B / CSV loggers read back with the tools' own readers, a raising callback,
and bad input. The two-process checks share one launch (``workloads/callback_runs.py``)."""

from __future__ import annotations

import csv
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

import stratagem as sg
from stratagem import hookimpl
from stratagem.callbacks import EarlyStopping, ModelCheckpoint, Throughput
from stratagem.errors import ConfigurationError, HookImplementationError, MissingDependencyError

WORKLOADS = Path(__file__).parent / "workloads"
sys.path.insert(0, str(WORKLOADS))
import sg_workloads as wl  # noqa: E402

# -------------------------------------------------------------------------------------------------
# the two-process run, launched once
# -------------------------------------------------------------------------------------------------


class _Listener:
    """A TCP server that counts the connections it is offered: W&B pointed at it must make none."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self.running = True
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while self.running:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self.running = False
        self.thread.join()
        self.sock.close()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("callbacks")
    listener = _Listener()
    env = {
        **__import__("os").environ,
        "WANDB_MODE": "offline",
        "WANDB_BASE_URL": f"http://127.0.0.1:{listener.port}",
        "WANDB_SILENT": "true",
    }
    command = [sys.executable, str(WORKLOADS / "callback_runs.py"), "--part", "checks"]
    command += ["--root", str(tmp / "root"), "--out", str(tmp / "out")]
    command += ["--tracking-uri", f"sqlite:///{tmp / 'mlflow.db'}"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=200, env=env)
        during_run = listener.connections
        # The counter itself works: one connection of ours is seen.
        socket.create_connection(("127.0.0.1", listener.port), timeout=5).close()
        deadline = time.monotonic() + 5
        while listener.connections == during_run and time.monotonic() < deadline:
            time.sleep(0.05)
        assert listener.connections == during_run + 1
    finally:
        listener.close()
    assert done.returncode == 0, done.stderr[-5000:]
    ranks = {r: torch.load(tmp / f"out.rank{r}", weights_only=False) for r in (0, 1)}
    return {
        "tmp": tmp,
        "root": tmp / "root",
        "ranks": ranks,
        "stdout": done.stdout,
        "wandb_connections": during_run,
    }


def _expected_events(rank: int) -> list[tuple[str, int, Any]]:
    """docs/hooks.md's order for: 2 epochs of 4 batches, accumulate_grad_batches=2 (2 steps per epoch),
    log_every_n_steps=2, validation at each epoch's end, checkpoint_every_n_steps=3 (and at the end)."""
    zero = rank == 0
    train_keys, val_keys = ["epoch", "loss", "mse"], ["epoch", "val_mse"]
    events: list[tuple[str, int, Any]] = [("on_fit_start", 0, None)]
    if zero:
        events.append(("log_hyperparams", 0, 2))
    step = 0
    for epoch in (0, 1):
        events.append(("on_train_epoch_start", step, epoch))
        for batch_idx in range(4):
            events.append(("on_train_batch_start", step, batch_idx))
            if batch_idx % 2 == 1:  # the second batch of each accumulation steps the optimizer
                events.append(("on_before_optimizer_step", step, (step, True)))
                step += 1
            events.append(("on_train_batch_end", step, (batch_idx, step, True)))
            if batch_idx % 2 == 1 and step % 2 == 0 and zero:
                events.append(("log_metrics", step, (step, train_keys)))
            if batch_idx % 2 == 1 and step == 3:
                events.append(("on_save_checkpoint", step, "step-000003.ckpt"))
        events.append(("on_validation_start", step, None))
        if zero:
            events.append(("log_metrics", step, (step, val_keys)))
        events.append(("on_validation_end", step, ["val_mse"]))
        events.append(("on_train_epoch_end", step, epoch))
    events += [("on_save_checkpoint", 4, "step-000004.ckpt"), ("on_fit_end", 4, None)]
    return events


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_events_in_the_documented_order_on_every_rank(two_ranks: dict[str, Any]) -> None:
    for rank, result in two_ranks["ranks"].items():
        seen = result["events"]
        assert {r for _, r, _, _ in seen} == {rank}
        assert [(e, s, d) for e, _, s, d in seen] == _expected_events(rank), f"rank {rank}"
        # The resumed fit gets back what this rank's callback stored at step 4, then carries on from epoch 2.
        resumed = [(e, s, d) for e, _, s, d in result["resumed_events"]]
        saved_count = next(i for i, e in enumerate(result["events"]) if e[3] == "step-000004.ckpt") + 1
        assert result["resumed_state"] == {"rank": rank, "events": saved_count}
        head = [("on_load_checkpoint", 4, "step-000004.ckpt"), ("on_fit_start", 4, None)]
        head += [("log_hyperparams", 4, 2)] if rank == 0 else []
        assert resumed[: len(head) + 1] == [*head, ("on_train_epoch_start", 4, 2)]
        assert resumed[-1] == ("on_fit_end", 6, None)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_early_stopping_stops_both_ranks_at_the_step_the_reduced_metric_says(
    two_ranks: dict[str, Any],
) -> None:
    # The mean of the ranks' scores stops improving (by min_delta 0.2) after step 9: patience 2 -> step 15.
    # Rank 1's own scores would have stopped at step 9, rank 0's never.
    for result in two_ranks["ranks"].values():
        assert result["early"] == {"step": 15, "stopped_step": 15, "best": 3.5}
    assert "stopping at step 15" in two_ranks["stdout"]
    rows = list(csv.DictReader((two_ranks["root"] / "early" / "metrics.csv").open()))
    assert [int(r["step"]) for r in rows if r.get("val_score")] == [3, 6, 9, 12, 15]


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_model_checkpoint_keeps_the_two_best_and_last_across_a_resume(two_ranks: dict[str, Any]) -> None:
    # Mean scores 5, 1, 4 | resume | 2, 6, 3 at steps 3..18: the best two are steps 6 and 12, the last 18.
    directory = two_ranks["root"] / "best" / "checkpoints"
    for result in two_ranks["ranks"].values():
        assert result["best_9"]["best"] == [
            ["step-000006-val_score-1.ckpt", 1.0, 6],
            ["step-000009-val_score-4.ckpt", 4.0, 9],
        ]
        resumed, reference = result["best_18"], result["best_reference"]
        assert {k: resumed[k] for k in ("best", "last", "step")} == {
            "best": [["step-000006-val_score-1.ckpt", 1.0, 6], ["step-000012-val_score-2.ckpt", 2.0, 12]],
            "last": "step-000018-val_score-3.ckpt",
            "step": 18,
        }
        # Resuming from a checkpoint ModelCheckpoint wrote is exact: the run without a break ends the same.
        assert (resumed["batches"], reference["batches"]) == (9, 18)
        assert reference["best"] == resumed["best"] and reference["last"] == resumed["last"]
        for name, value in reference["params"].items():
            assert torch.equal(resumed["params"][name], value), name
        assert not torch.equal(resumed["params"]["net.0.weight"], result["best_9"]["params"]["net.0.weight"])
    assert sorted(p.name for p in directory.iterdir()) == [
        "last",
        "step-000006-val_score-1.ckpt",
        "step-000012-val_score-2.ckpt",
        "step-000018-val_score-3.ckpt",
    ]
    assert (directory / "last").read_text().strip() == "step-000018-val_score-3.ckpt"
    # Weights-only loadable, with the ranking as it stood when each was written, for each rank.
    saved = torch.load(directory / "step-000012-val_score-2.ckpt", weights_only=True)
    assert saved["state"]["progress"]["step"] == 12
    per_rank = saved["state"]["callbacks"]
    states = [per_rank["__stratagem_per_rank__"][r]["ModelCheckpoint[val_score]"] for r in (0, 1)]
    assert (
        states[0]
        == states[1]
        == {
            "best": [["step-000006-val_score-1.ckpt", 1.0, 6], ["step-000012-val_score-2.ckpt", 2.0, 12]],
            "last": "step-000012-val_score-2.ckpt",
        }
    )


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_model_checkpoint_on_a_step_cadence_keeps_the_newest(two_ranks: dict[str, Any]) -> None:
    directory = two_ranks["root"] / "loggers" / "every"
    kept = sorted(p.name for p in directory.iterdir())
    assert kept == ["last", "step-000006-kept.ckpt", "step-000008-kept.ckpt"], kept
    assert (directory / "last").read_text().strip() == "step-000008-kept.ckpt"
    assert (
        torch.load(directory / "step-000006-kept.ckpt", weights_only=True)["state"]["progress"]["step"] == 6
    )


def _csv_rows(path: Path) -> list[dict[str, str]]:
    return list(csv.DictReader(path.open()))


def _column(rows: list[dict[str, str]], name: str) -> dict[int, float]:
    return {int(r["step"]): float(r[name]) for r in rows if r.get(name)}


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_tensorboard_event_files_hold_the_scalars_at_their_steps(two_ranks: dict[str, Any]) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root = two_ranks["root"] / "loggers"
    files = list((root / "tensorboard").glob("events.out.tfevents.*"))
    assert len(files) == 1, files  # rank 0 alone writes
    accumulator = EventAccumulator(str(root / "tensorboard"))
    accumulator.Reload()
    rows = _csv_rows(root / "metrics.csv")
    for name, steps in (("loss", [2, 4, 6, 8]), ("val_score", [3, 6]), ("lr-0/pg0", [2, 4, 6, 8])):
        events = accumulator.Scalars(name)
        assert [e.step for e in events] == steps, name
        expected = _column(rows, name)
        for event in events:
            assert event.value == pytest.approx(expected[event.step], rel=1e-6), (name, event.step)
    assert [e.value for e in accumulator.Scalars("val_score")] == [5.0, 1.0]  # the mean of the two ranks
    assert all(e.value == pytest.approx(0.05) for e in accumulator.Scalars("lr-0/pg0"))
    rates = [e.value for e in accumulator.Scalars("throughput/samples_per_sec")]
    tokens = [e.value for e in accumulator.Scalars("throughput/tokens_per_sec")]
    mfu = [e.value for e in accumulator.Scalars("throughput/mfu")]
    assert len(rates) == 4 and all(r > 0 for r in rates)
    for rate, token, util in zip(rates, tokens, mfu):
        assert token == pytest.approx(16 * rate, rel=1e-5)
        assert util == pytest.approx(rate * 1e6 / (1e12 * 2), rel=1e-5)
    # The hyperparameters, through TensorBoard's HParams plugin.
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    content = accumulator.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    session = HParamsPluginData.FromString(content).session_start_info
    assert session.hparams["trainer/max_steps"].number_value == 8
    assert session.hparams["model/note"].string_value == "two ranks"


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_mlflow_run_params_and_metric_history_in_a_sqlite_store(two_ranks: dict[str, Any]) -> None:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{two_ranks['tmp'] / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("callbacks-test")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1  # rank 0 alone
    run = runs[0]
    assert run.info.status == "FINISHED" and run.info.run_name == "two-ranks"
    params = run.data.params
    assert params["trainer/max_steps"] == "8" and params["trainer/log_every_n_steps"] == "2"
    assert params["trainer/world_size"] == "2" and params["strategy/name"] == "GradAverage"
    assert params["model/width"] == "32" and params["model/note"] == "two ranks"
    rows = _csv_rows(two_ranks["root"] / "loggers" / "metrics.csv")
    for name, steps in (("loss", [2, 4, 6, 8]), ("val_score", [3, 6])):
        history = sorted(client.get_metric_history(run.info.run_id, name), key=lambda m: m.step)
        assert [m.step for m in history] == steps
        expected = _column(rows, name)
        assert [m.value for m in history] == pytest.approx([expected[s] for s in steps], rel=1e-9)


def _wandb_records(path: Path) -> list[Any]:
    """The records of a ``.wandb`` transaction log (LevelDB log framing: 32 KiB blocks, 7-byte record
    headers) parsed with W&B's own protobuf messages."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, pending, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = pb.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def _key(item: Any) -> str:
    return item.key or "/".join(item.nested_key)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_wandb_offline_run_directory_holds_the_metrics_and_no_network_was_used(
    two_ranks: dict[str, Any],
) -> None:
    import json

    root = two_ranks["root"] / "loggers" / "wandb"
    runs = list(root.glob("offline-run-*"))
    assert len(runs) == 1, runs  # rank 0 alone
    (log,) = runs[0].glob("run-*.wandb")
    records = _wandb_records(log)
    history: dict[int, dict[str, float]] = {}
    config: dict[str, Any] = {}
    for record in records:
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {_key(i): json.loads(i.value_json) for i in record.history.item}
            step = int(items["_step"]) if "_step" in items else record.history.step.num
            history.setdefault(step, {}).update(items)
        elif kind == "run":
            config.update({_key(i): json.loads(i.value_json) for i in record.run.config.update})
    rows = _csv_rows(two_ranks["root"] / "loggers" / "metrics.csv")
    for name, steps in (("loss", [2, 4, 6, 8]), ("val_score", [3, 6])):
        assert sorted(s for s, items in history.items() if name in items) == steps, name
        expected = _column(rows, name)
        assert [history[s][name] for s in steps] == pytest.approx([expected[s] for s in steps], rel=1e-9)
    assert config["trainer/max_steps"] == 8 and config["model/width"] == 32
    assert two_ranks["wandb_connections"] == 0


# -------------------------------------------------------------------------------------------------
# a raising callback
# -------------------------------------------------------------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_a_raising_callback_ends_the_run_like_a_worker_error(tmp_path: Path) -> None:
    command = [sys.executable, str(WORKLOADS / "callback_runs.py"), "--part", "raise"]
    command += ["--root", str(tmp_path / "root"), "--out", str(tmp_path / "out")]
    start = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - start
    assert done.returncode != 0
    assert "rank 1" in done.stderr
    assert done.stderr.count("RuntimeError: callback gives up on rank 1") == 1, done.stderr
    assert done.stderr.count("Traceback (most recent call last)") == 1, done.stderr
    assert "on_train_batch_end" in done.stderr  # the traceback goes through the callback
    assert elapsed < 60  # the Trainer's timeout is 60 s: nobody waited for it
    # The failing rank's callbacks saw the exception before it propagated.
    events = torch.load(tmp_path / "out.rank1", weights_only=False)
    assert events[-1][0] == "on_exception" and "callback gives up" in events[-1][3]
    time.sleep(0.5)
    assert wl.processes_mentioning(str(tmp_path / "root")) == []


# -------------------------------------------------------------------------------------------------
# bad input, in one process
# -------------------------------------------------------------------------------------------------


def _trainer(tmp_path: Path, **options: Any) -> sg.Trainer:
    options.setdefault("max_steps", 6)
    return sg.Trainer(
        strategy="single_device",
        accelerator="cpu",
        default_root_dir=tmp_path,
        enable_progress_bar=False,
        **options,
    )


def test_unknown_names_list_what_exists_with_the_closest(tmp_path: Path) -> None:
    with pytest.raises(KeyError) as caught:
        _trainer(tmp_path, loggers=["tensorbord"])
    message = str(caught.value)
    assert "Unknown logger 'tensorbord'. Did you mean 'tensorboard'?" in message
    assert "Installed loggers: csv, mlflow, tensorboard, wandb" in message
    with pytest.raises(
        KeyError, match=r"Unknown callback 'throughputs'\. Did you mean 'throughput'\?"
    ) as caught:
        _trainer(tmp_path, callbacks=["throughputs"])
    assert "learning_rate_monitor, model_checkpoint, throughput" in str(caught.value)


def test_mode_and_other_options_are_checked_when_made() -> None:
    with pytest.raises(ConfigurationError, match=r"EarlyStopping\(mode='minimum'\): use 'min'.*or 'max'"):
        EarlyStopping("val_loss", mode="minimum")
    with pytest.raises(ConfigurationError, match=r"ModelCheckpoint\(mode='best'\)"):
        ModelCheckpoint("val_loss", mode="best")
    with pytest.raises(ConfigurationError, match=r"save_top_k=0"):
        ModelCheckpoint("val_loss", save_top_k=0)
    with pytest.raises(ConfigurationError, match="both flops_per_sample and peak_flops"):
        Throughput(flops_per_sample=1e9)


def test_a_monitor_never_logged_fails_at_the_first_validation_naming_what_exists(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path, val_check_interval=3, callbacks=[EarlyStopping("val_acc", mode="max")])
    loader = DataLoader(wl.dataset(), batch_size=8)
    with pytest.raises(ConfigurationError) as caught:
        trainer.fit(wl.Regression(), loader, loader)
    message = str(caught.value)
    assert "EarlyStopping(monitor='val_acc'): no metric 'val_acc' has been logged by step 3" in message
    assert "Logged metrics: val_mse" in message
    assert trainer.global_step == 3


def test_callback_objects_are_checked_when_the_trainer_is_made(tmp_path: Path) -> None:
    class Typo:
        @hookimpl
        def on_fit_strat(self, trainer: Any) -> None: ...

    class Nothing:
        def on_fit_start(self, trainer: Any) -> None: ...

    class WrongArgument:
        @hookimpl
        def on_fit_start(self, trainer: Any, model: Any) -> None: ...

    with pytest.raises(
        HookImplementationError, match=r"'on_fit_strat' is not a Trainer event.*'on_fit_start'"
    ):
        _trainer(tmp_path, callbacks=[Typo()])
    with pytest.raises(ConfigurationError, match="Nothing implements no Trainer event"):
        _trainer(tmp_path, callbacks=[Nothing()])
    with pytest.raises(HookImplementationError, match="WrongArgument"):
        _trainer(tmp_path, callbacks=[WrongArgument()])
    with pytest.raises(ConfigurationError, match=r"give an instance, EarlyStopping\(\.\.\.\)"):
        _trainer(tmp_path, callbacks=[EarlyStopping])
    assert _trainer(tmp_path, loggers=False).loggers == _trainer(tmp_path, loggers=[]).loggers == []
    assert [type(logger).__name__ for logger in _trainer(tmp_path).loggers] == ["CSVLogger"]


PLUGIN = """
from stratagem import hookimpl

CALLS = []


class Counting:
    @hookimpl
    def on_train_batch_end(self, step):
        CALLS.append(step)


@hookimpl
def register_callbacks(register):
    register("counting", "fancy_plugin:Counting", description="counts steps")


@hookimpl
def register_loggers(register):
    register(
        "fancy",
        "fancy_plugin:Counting",
        description="needs a tracker that is not installed",
        requires=["fancy-tracker-not-installed>=1"],
        install="stratagem-fancy[tracker]",
    )
"""


def test_entry_point_callbacks_are_opt_in_and_a_missing_extra_names_the_pip_command(
    tmp_path: Path, make_distribution: Any
) -> None:
    from stratagem.registry._manager import get_registry

    make_distribution("fancy-plugin", "1.0", {"fancy": "fancy_plugin"}, {"fancy_plugin": PLUGIN})
    get_registry(refresh=True)
    try:
        import fancy_plugin

        # Installed but not named: never called.
        _trainer(tmp_path / "a", max_steps=3).fit(wl.Regression(), DataLoader(wl.dataset(), batch_size=8))
        assert fancy_plugin.CALLS == []
        _trainer(tmp_path / "b", max_steps=3, callbacks=["counting"]).fit(
            wl.Regression(), DataLoader(wl.dataset(), batch_size=8)
        )
        assert fancy_plugin.CALLS == [1, 2, 3]
        # A missing dependency fails when the Trainer is made (before any launch), with the pip command.
        with pytest.raises(MissingDependencyError) as caught:
            sg.Trainer(strategy=wl.GradAverage(), accelerator="cpu", devices=2, loggers=["fancy"])
        assert "Logger 'fancy' needs fancy-tracker-not-installed>=1" in str(caught.value)
        assert "pip install 'stratagem-fancy[tracker]'" in str(caught.value)
        info = get_registry().get_callback("tensorboard", "logger")
        assert info.requires == ("tensorboard",) and info.install == ("stratagem[tensorboard]",)
    finally:
        get_registry(refresh=True)


class Paced(wl.Regression):
    """Each training step takes at least 20 ms and each validation batch 1 s: a known throughput."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        time.sleep(0.02)
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        time.sleep(1.0)
        super().validation_step(batch, batch_idx)


def test_throughput_against_a_known_step_time_with_validation_excluded(tmp_path: Path) -> None:
    from stratagem.callbacks import LearningRateMonitor

    trainer = _trainer(
        tmp_path,
        max_steps=5,
        log_every_n_steps=2,
        val_check_interval=3,
        limit_val_batches=1,
        callbacks=[
            Throughput(sequence_length=10, flops_per_sample=2e6, peak_flops=1e9),
            LearningRateMonitor(),
        ],
    )
    loader = DataLoader(wl.dataset(), batch_size=8)
    trainer.fit(Paced(), loader, loader)
    rows = _csv_rows(tmp_path / "metrics.csv")
    rates = _column(rows, "throughput/samples_per_sec")
    assert sorted(rates) == [2, 4]
    # At most 8 samples per 20 ms = 400/s; the loop's own work and a loaded machine's late wake-ups cost some
    # (at a load average of 15 a rate fell below 60/s). The window from step 2 to 4 holds the 1 s validation at
    # step 3: counted, it would bring that rate below 16 / 1.04 s = 15.4/s.
    for step, rate in rates.items():
        assert 20 < rate <= 400, (step, rate)
    for step, rate in rates.items():
        assert _column(rows, "throughput/tokens_per_sec")[step] == pytest.approx(10 * rate)
        assert _column(rows, "throughput/mfu")[step] == pytest.approx(rate * 2e6 / 1e9)
    assert _column(rows, "lr-0/pg0") == {2: 0.05, 4: 0.05}


def test_a_resumed_fit_continues_the_same_mlflow_run(tmp_path: Path) -> None:
    from mlflow import MlflowClient

    from stratagem.loggers import MLflowLogger

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    loader = DataLoader(wl.dataset(), batch_size=8)
    for steps, ckpt_path in ((4, None), (6, "last")):
        logger = MLflowLogger(tracking_uri=uri, experiment_name="resume")
        trainer = _trainer(
            tmp_path, max_steps=steps, log_every_n_steps=2, checkpoint_every_n_steps=2, loggers=[logger]
        )
        trainer.fit(wl.Regression(), loader, ckpt_path=ckpt_path)
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("resume").experiment_id])
    assert run.info.run_id == logger.run_id and run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "loss")
    assert sorted(m.step for m in history) == [2, 4, 6]
