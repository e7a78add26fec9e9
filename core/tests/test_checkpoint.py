"""Checkpoints in one process: round trips, bad input, refusal to run pickled code, the CLI."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import stratagem as sg
from stratagem import CheckpointError
from stratagem.checkpoint import FORMAT_VERSION, _offline

sys.path.insert(0, str(Path(__file__).parent))
import ckpt_workers as W

FORMATS = ["full", "sharded"]


@pytest.fixture
def engine() -> sg.Engine:
    return sg.Engine(strategy="single_device", accelerator="cpu")


def _live_state() -> dict[str, Any]:
    model, optimizer = W.trained(seed=0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 2)
    optimizer.step()  # no gradients: a no-op that keeps the scheduler's order check quiet
    scheduler.step()
    return {
        "model": model,
        "optimizer": optimizer,
        "scheduler": scheduler,
        "step": 3,
        "extras": {"name": "run", "losses": [1.5, 0.5], "t": torch.arange(4)},
        "rng": sg.PerRank(torch.get_rng_state()),
    }


def _save(engine: sg.Engine, tmp_path: Path, fmt: str) -> tuple[Path, dict[str, Any]]:
    state = _live_state()
    path = tmp_path / f"ckpt-{fmt}"
    engine.save(path, state, format=fmt)
    return path, state


# -------------------------------------------------------------------------------------------------
# round trips and the on-disk layout
# -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip(engine: sg.Engine, tmp_path: Path, fmt: str) -> None:
    path, state = _save(engine, tmp_path, fmt)
    model, optimizer = W.fresh()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 2)
    rest = engine.load(path, {"model": model, "optimizer": optimizer, "scheduler": scheduler})
    assert W.same_state((model, optimizer), (state["model"], state["optimizer"]))
    assert scheduler.state_dict() == state["scheduler"].state_dict()
    assert rest["step"] == 3
    assert rest["extras"]["name"] == "run" and rest["extras"]["losses"] == [1.5, 0.5]
    assert torch.equal(rest["extras"]["t"], torch.arange(4))
    assert torch.equal(rest["rng"], state["rng"].value)  # this rank's own value back


def test_full_layout_is_plain_data(engine: sg.Engine, tmp_path: Path) -> None:
    path, _ = _save(engine, tmp_path, "full")
    payload = torch.load(path, weights_only=True)
    assert set(payload) == {"stratagem", "model", "optimizers", "state"}
    meta = payload["stratagem"]
    assert meta["format_version"] == FORMAT_VERSION and meta["format"] == "full"
    assert meta["strategy"] == "single_device" and meta["world_size"] == 1
    assert type(meta["torch_version"]) is str and meta["stratagem_version"]
    # Optimizer state keyed by parameter name, so it loads under any strategy.
    assert set(payload["optimizers"]["optimizer"]["state"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}


def test_sharded_layout(engine: sg.Engine, tmp_path: Path) -> None:
    path, _ = _save(engine, tmp_path, "sharded")
    assert {".metadata", "stratagem.json", "state.pt"} <= {p.name for p in path.iterdir()}
    meta = json.loads((path / "stratagem.json").read_text())
    assert meta["format"] == "sharded" and meta["world_size"] == 1
    assert torch.load(path / "state.pt", weights_only=True)["step"] == 3


def test_unsaveable_state_names_the_entry(engine: sg.Engine, tmp_path: Path) -> None:
    path, _ = _save(engine, tmp_path, "full")
    before = path.read_bytes()
    with pytest.raises(CheckpointError, match=r"state\['bad'\]\[0\] is a builtins.object"):
        engine.save(path, {"model": torch.nn.Linear(2, 2), "bad": [object()]}, format="full")
    assert path.read_bytes() == before


# -------------------------------------------------------------------------------------------------
# bad input
# -------------------------------------------------------------------------------------------------


def test_truncated_file(engine: sg.Engine, tmp_path: Path) -> None:
    path, _ = _save(engine, tmp_path, "full")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated, corrupt"):
        engine.load(path, {"model": W.small_model()})


def test_not_a_checkpoint(engine: sg.Engine, tmp_path: Path) -> None:
    path = tmp_path / "plain.pt"
    torch.save({"weight": torch.zeros(2)}, path)
    with pytest.raises(CheckpointError, match="has no stratagem metadata"):
        engine.load(path, {"model": W.small_model()})
    with pytest.raises(CheckpointError, match="does not exist"):
        engine.load(tmp_path / "nothing", {"model": W.small_model()})


def test_directory_without_metadata(engine: sg.Engine, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match=r"without stratagem\.json"):
        engine.load(empty, {"model": W.small_model()})
    path, _ = _save(engine, tmp_path, "sharded")
    (path / ".metadata").unlink()
    with pytest.raises(CheckpointError, match=r"has no torch.distributed.checkpoint index \(.metadata\)"):
        engine.load(path, {"model": W.small_model()})


@pytest.mark.parametrize("fmt", FORMATS)
def test_newer_format_version(engine: sg.Engine, tmp_path: Path, fmt: str) -> None:
    path, _ = _save(engine, tmp_path, fmt)
    if fmt == "full":
        payload = torch.load(path, weights_only=True)
        payload["stratagem"]["format_version"] = FORMAT_VERSION + 1
        torch.save(payload, path)
    else:
        meta = json.loads((path / "stratagem.json").read_text())
        meta["format_version"] = FORMAT_VERSION + 1
        (path / "stratagem.json").write_text(json.dumps(meta))
    with pytest.raises(
        CheckpointError, match=f"format version {FORMAT_VERSION + 1}, newer.*Upgrade stratagem"
    ):
        engine.load(path, {"model": W.small_model()})


class Other(torch.nn.Module):
    """Like W.small_model() but wider in the middle and with one more layer."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))
        self.head = torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


@pytest.mark.parametrize("fmt", FORMATS)
def test_mismatched_keys_and_shapes(engine: sg.Engine, tmp_path: Path, fmt: str) -> None:
    path, state = _save(engine, tmp_path, fmt)
    # Same keys as the saved Sequential where it fits ("0.*", "2.*"), different shapes, one extra layer.
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))
    model.add_module("3", torch.nn.Linear(3, 3))
    with pytest.raises(CheckpointError) as info:
        engine.load(path, {"model": model})
    message = str(info.value)
    assert "missing from the checkpoint: 3.bias, 3.weight" in message
    assert "shape of 0.weight: checkpoint (10, 6), model (12, 6)" in message
    assert "shape of 2.weight: checkpoint (3, 10), model (3, 12)" in message
    assert "strict=False" in message

    saved_head = state["model"][2].bias.detach().clone()  # (3,) fits the new "2.bias"
    optimizer = torch.optim.AdamW(model.parameters())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rest = engine.load(path, {"model": model, "optimizer": optimizer}, strict=False)
    report = "\n".join(str(w.message) for w in caught)
    assert "loaded what fits" in report and "shape of 0.weight" in report and "3.weight" in report
    assert torch.equal(model[2].bias.detach(), saved_head)
    assert rest["step"] == 3

    # Keys that exist only in the checkpoint are reported as unexpected.
    with pytest.raises(CheckpointError, match=r"in the checkpoint but not the model: 2.bias, 2.weight"):
        engine.load(path, {"model": torch.nn.Sequential(torch.nn.Linear(6, 10))})


# -------------------------------------------------------------------------------------------------
# nothing in a checkpoint runs code
# -------------------------------------------------------------------------------------------------


class Payload:
    """Unpickling this creates the marker file: what a crafted checkpoint would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (open, (str(self.marker), "w"))


def without_checksums(path: Path) -> None:
    """Make the sharded checkpoint at ``path`` one as written before checkpoints recorded checksums (as a
    crafted one would be: the refusals below must not depend on the checksums)."""
    meta = json.loads((path / "stratagem.json").read_text())
    meta.pop("checksums"), meta.pop("manifest_crc32c")
    (path / "stratagem.json").write_text(json.dumps(meta))


def _all_readers(engine: sg.Engine, path: Path) -> list[str]:
    """Load, inspect and consolidate ``path``; every one must refuse. Returns the error messages."""
    messages = []
    model, optimizer = W.fresh()
    for reader in (
        lambda: engine.load(path, {"model": model, "optimizer": optimizer}),
        lambda: _offline.inspect(path),
        lambda: _offline.consolidate(path, path.parent / "out.pt"),
    ):
        try:
            reader()
        except CheckpointError as error:
            messages.append(str(error))
    return messages


def test_full_file_with_code_is_refused(engine: sg.Engine, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path, _ = _save(engine, tmp_path, "full")
    payload = torch.load(path, weights_only=True)
    payload["state"]["step"] = Payload(marker)
    torch.save(payload, path)
    model, optimizer = W.fresh()
    with pytest.raises(CheckpointError, match="cannot be read"):
        engine.load(path, {"model": model, "optimizer": optimizer})
    with pytest.raises(CheckpointError):
        _offline.inspect(path)
    assert not marker.exists()


def test_sharded_state_file_with_code_is_refused(engine: sg.Engine, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path, _ = _save(engine, tmp_path, "sharded")
    torch.save({"step": Payload(marker)}, path / "state.pt")
    messages = _all_readers(engine, path)
    assert len(messages) == 3 and all("state.pt" in m for m in messages), messages
    assert not marker.exists()


def test_sharded_index_with_code_is_refused(engine: sg.Engine, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path, _ = _save(engine, tmp_path, "sharded")
    (path / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    without_checksums(path)
    messages = _all_readers(engine, path)
    assert len(messages) == 3 and all("unsafe: refusing io.open" in m for m in messages), messages
    assert not marker.exists()


def test_sharded_byte_entry_with_code_is_refused(engine: sg.Engine, tmp_path: Path) -> None:
    """A DCP directory whose non-tensor entry (an optimizer hyperparameter) is a pickled payload."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    marker = tmp_path / "pwned"
    good, state = _save(engine, tmp_path, "sharded")
    model, optimizer = state["model"], state["optimizer"]
    osd = get_optimizer_state_dict(model, optimizer)
    osd["param_groups"][0]["lr"] = Payload(marker)
    path = tmp_path / "crafted"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(
            {"model": {"model": get_model_state_dict(model)}, "optimizers": {"optimizer": osd}},
            checkpoint_id=str(path),
            no_dist=True,
        )
    shutil.copy(good / "stratagem.json", path / "stratagem.json")
    without_checksums(path)
    messages = _all_readers(engine, path)
    assert len(messages) == 2, messages  # load and consolidate read the entry; inspect reads only the index
    assert all("not plain data (refused, nothing was run)" in m for m in messages), messages
    assert not marker.exists()


# -------------------------------------------------------------------------------------------------
# the CLI: inspect and consolidate, through the installed entry point
# -------------------------------------------------------------------------------------------------


def _stratagem(*args: str) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("stratagem")
    return subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=120)


def test_cli_inspect_and_consolidate(engine: sg.Engine, tmp_path: Path) -> None:
    sharded, state = _save(engine, tmp_path, "sharded")
    full = tmp_path / "reference.pt"
    engine.save(full, state, format="full")

    shown = _stratagem("checkpoint", "inspect", str(sharded))
    assert shown.returncode == 0, shown.stderr
    for text in (
        "format:        sharded",
        "strategy:      single_device",
        "world size:    1",
        "step:          3",
    ):
        assert text in shown.stdout
    assert "model.model.0.weight" in shown.stdout and "float32" in shown.stdout and "(10, 6)" in shown.stdout
    report = json.loads(_stratagem("checkpoint", "inspect", "--json", str(full)).stdout)
    assert report["format"] == "full" and report["step"] == 3
    shapes = {t["name"]: tuple(t["shape"]) for t in report["tensors"]}
    assert shapes["model.model.0.weight"] == (10, 6)
    assert report["tensor_bytes"] == sum(t["bytes"] for t in report["tensors"])

    out = tmp_path / "consolidated.pt"
    done = _stratagem("checkpoint", "consolidate", str(sharded), str(out))
    assert done.returncode == 0, done.stderr
    assert_same_payload(torch.load(out, weights_only=True), torch.load(full, weights_only=True))
    # And it loads as any full checkpoint does.
    model, optimizer = W.fresh()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 2)
    assert engine.load(out, {"model": model, "optimizer": optimizer, "scheduler": scheduler})["step"] == 3
    assert W.same_state((model, optimizer), (state["model"], state["optimizer"]))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-sharded", "consolidated.pt", "reference.pt"]

    bad = _stratagem("checkpoint", "inspect", str(tmp_path / "missing"))
    assert bad.returncode == 2 and "does not exist" in bad.stderr


def assert_same_payload(got: dict[str, Any], want: dict[str, Any]) -> None:
    """The consolidated file holds what a full save of the same state holds (metadata aside)."""
    assert got["stratagem"]["format"] == "full"
    assert got["stratagem"]["consolidated_from"]["format"] == "sharded"
    assert set(got) == set(want)

    def same(a: Any, b: Any, where: str) -> None:
        if isinstance(b, torch.Tensor):
            assert isinstance(a, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
        elif isinstance(b, dict):
            assert isinstance(a, dict) and set(a) == set(b), (where, sorted(a), sorted(b))
            for k in b:
                same(a[k], b[k], f"{where}.{k}")
        elif isinstance(b, (list, tuple)):
            assert len(a) == len(b), where
            for i, (x, y) in enumerate(zip(a, b)):
                same(x, y, f"{where}.{i}")
        else:
            assert a == b, (where, a, b)

    for key in ("model", "optimizers", "state"):
        same(got[key], want[key], key)


def test_consolidate_refuses_a_file(engine: sg.Engine, tmp_path: Path) -> None:
    path, _ = _save(engine, tmp_path, "full")
    with pytest.raises(CheckpointError, match="consolidate takes a directory"):
        _offline.consolidate(path, tmp_path / "x.pt")
    assert not os.path.exists(tmp_path / "x.pt")
