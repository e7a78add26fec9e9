"""Hugging Face weights in one process: the safetensors format against the ``safetensors`` package, reading
exactly the bytes of a part, adapters (renames, fused q/k/v, a fused checkpoint tensor split), tied weights,
``strict=False``, and every kind of bad input refused before training with nothing written. The strategies'
shards are tested in tests/test_hf_weights.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import stratagem as sg
from stratagem.checkpoint._hf_shards import WeightShard, transfers
from stratagem.checkpoint._hf_source import Source
from stratagem.checkpoint._hf_write import Files, plan_export
from stratagem.checkpoint._safetensors import parse_size, runs
from stratagem.checkpoint.hf import Fused, HFWeights, Slice, save_weights
from stratagem.errors import CheckpointError

st = pytest.importorskip("safetensors.torch", reason="needs safetensors (requirements-test.txt)")
pytestmark = pytest.mark.timeout(120)


class Net(sg.Module):
    """A small model: an embedding, a norm without reset_parameters (as transformers' RMSNorm), a constant in a
    non-persistent buffer (as rotary frequencies; its module computes it in reset_parameters), two linears."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 8)
        self.norm = Norm(8)
        self.scale = Scale()
        self.proj = torch.nn.Linear(8, 12)
        self.out = torch.nn.Linear(12, 10, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.proj(self.norm(self.embed(x)) * self.scale.value)))

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self(x).logsumexp(-1).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Norm(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


class Scale(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("value", torch.empty(()), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.value.fill_(2.0)


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {k: v.clone() for k, v in Net().state_dict().items()}


def _save(folder: Path, tensors: dict[str, torch.Tensor], files: int = 2) -> Path:
    """``tensors`` as ``save_pretrained`` lays them out: ``files`` shards and their index."""
    folder.mkdir(parents=True, exist_ok=True)
    names = list(tensors)
    weight_map = {}
    for i in range(files):
        part = {n: tensors[n].contiguous() for n in names[i::files]}
        file = f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        st.save_file(part, str(folder / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    (folder / "config.json").write_text(json.dumps({"dtype": "float32", "model_type": "net"}))
    return folder


def _setup(source, make=Net, **options):
    """``make()`` built on the meta device, set up with ``init_weights``."""
    engine = sg.Engine(strategy="single_device", accelerator="cpu")
    with engine.init_module(empty_init=True):
        model = make()
    return engine, engine.setup(model, init_weights=HFWeights(source, **options) if options else source)


# -------------------------------------------------------------------------------------------------
# the format
# -------------------------------------------------------------------------------------------------


def test_a_rectangle_reads_its_bytes_only_and_equals_the_slice(tmp_path: Path) -> None:
    whole = torch.randn(6, 10, 4)
    st.save_file({"t": whole, "bf": whole.bfloat16()}, str(tmp_path / "a.safetensors"))
    source = Source(tmp_path / "a.safetensors")
    for offsets, sizes in [
        ((0, 0, 0), (6, 10, 4)),
        ((2, 0, 0), (3, 10, 4)),
        ((1, 3, 0), (4, 5, 4)),
        ((0, 9, 1), (6, 1, 2)),
    ]:
        before = source.bytes_read
        starts, length = runs((6, 10, 4), offsets, sizes)
        out = torch.empty(sizes)
        source.read_runs(source.entries["t"], starts, length, out)
        index = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
        assert torch.equal(out, whole[index])
        assert source.bytes_read - before == out.numel() * 4  # nothing beyond the rectangle
    # A range of the flattened tensor (a ZeRO-3 partition), in another dtype: one run.
    shard = WeightShard("bf", (6, 10, 4), torch.empty(37, dtype=torch.bfloat16), flat_start=100)
    from stratagem.checkpoint._hf_names import Link

    (transfer,) = transfers(shard, Link("bf", 0, 0, 6, "bf", 0), (6, 10, 4))
    source.read_runs(source.entries["bf"], transfer.starts, transfer.length, transfer.local)
    assert torch.equal(shard.tensor, whole.bfloat16().reshape(-1)[100:137])


def test_an_export_is_read_by_safetensors_and_from_pretrained_layouts(tmp_path: Path) -> None:
    engine, model = _setup(_save(tmp_path / "in", _weights()))
    report = save_weights(engine, model, tmp_path / "out", max_shard_size=300)
    files = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert len(report["files"]) >= 2 and files == sorted(
        [*report["files"], "config.json", "model.safetensors.index.json"]
    )
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    loaded = {}
    for file in report["files"]:
        assert (
            os.path.getsize(tmp_path / "out" / file) <= 300 + 400
        )  # data at most 300 bytes, plus the header
        part = st.load_file(str(tmp_path / "out" / file))
        assert all(index["weight_map"][k] == file for k in part)
        loaded.update(part)
    want = _weights()
    assert sorted(loaded) == sorted(want) and all(torch.equal(loaded[k], want[k]) for k in want)
    assert index["metadata"]["total_size"] == sum(v.numel() * 4 for v in want.values())


def test_export_files_have_their_blocks_reserved_before_any_part_is_written(tmp_path: Path) -> None:
    # Ranks write their parts at scattered offsets: files reserved whole (not sparse) let the publishing fsync
    # flush them as fast as one sequential write. Where the file system cannot reserve, the file is extended.
    plan = plan_export([(f"w{i}", (256, 1024), torch.float32) for i in range(3)], lambda n: n, {}, 1 << 30)
    Files(tmp_path, plan.output).create()
    (name,) = plan.output.files
    header, size = plan.output.files[name]
    stat = os.stat(tmp_path / name)
    assert stat.st_size == size > 3 * 1 << 20
    assert (tmp_path / name).read_bytes()[: len(header)] == header
    kind = subprocess.run(["stat", "-f", "-c", "%T", str(tmp_path)], capture_output=True, text=True).stdout
    if kind.strip() not in ("ext2/ext3", "xfs", "btrfs", "tmpfs"):
        pytest.skip(f"the file system here ({kind.strip()}) may not reserve blocks; the rest was checked")
    assert stat.st_blocks * 512 >= size  # reserved, not a sparse file


def test_sizes_follow_the_hugging_face_convention() -> None:
    assert parse_size("5GB") == 5 * 10**9 and parse_size("500MiB") == 500 * 2**20 and parse_size(1234) == 1234
    with pytest.raises(ValueError, match="max_shard_size"):
        parse_size("five")


# -------------------------------------------------------------------------------------------------
# names
# -------------------------------------------------------------------------------------------------


class FusedAttention(sg.Module):
    """q, k, v in one tensor (grouped-query: k and v narrower), and separate gate and up projections."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(8, 8 + 4 + 4, bias=False)
        self.gate = torch.nn.Linear(8, 6, bias=False)
        self.up = torch.nn.Linear(8, 6, bias=False)

    @staticmethod
    def hf_adapter(name: str):
        if name == "qkv.weight":
            return Fused(["attn.q.weight", "attn.k.weight", "attn.v.weight"], dim=0, sizes=[8, 4, 4])
        if name in ("gate.weight", "up.weight"):
            return Slice("mlp.gate_up.weight", dim=0, start=0 if name == "gate.weight" else 6)
        return name


def test_an_adapter_fuses_and_splits_on_load_and_export(tmp_path: Path) -> None:
    hf = {
        "attn.q.weight": torch.randn(8, 8),
        "attn.k.weight": torch.randn(4, 8),
        "attn.v.weight": torch.randn(4, 8),
        "mlp.gate_up.weight": torch.randn(12, 8),
    }
    engine, model = _setup(_save(tmp_path / "in", hf), FusedAttention)
    assert torch.equal(
        model.qkv.weight, torch.cat([hf["attn.q.weight"], hf["attn.k.weight"], hf["attn.v.weight"]])
    )
    assert torch.equal(model.gate.weight, hf["mlp.gate_up.weight"][:6])
    assert torch.equal(model.up.weight, hf["mlp.gate_up.weight"][6:])
    save_weights(engine, model, tmp_path / "out")
    (file,) = (tmp_path / "out").glob("*.safetensors")
    back = st.load_file(str(file))
    assert sorted(back) == sorted(hf) and all(torch.equal(back[k], hf[k]) for k in hf)

    class Adapter:  # the class form, given with the weights rather than declared by the model
        def to_hf(self, name: str):
            return FusedAttention.hf_adapter(name)

    class Bare(FusedAttention):
        hf_adapter = None

    _, bare = _setup(tmp_path / "in", Bare, adapter=Adapter())
    assert torch.equal(bare.qkv.weight, model.qkv.weight) and torch.equal(bare.up.weight, model.up.weight)


def test_a_transformers_model_needs_no_adapter_and_tied_weights_are_stored_once(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt")  # lm_head tied: not stored

    class Holder(sg.Module):  # the transformers model under an attribute: its prefix is dropped
        def __init__(self) -> None:
            super().__init__()
            self.gpt = transformers.GPT2LMHeadModel(config)

    engine, model = _setup(tmp_path / "gpt", Holder)
    reference = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "gpt").eval()
    model.eval()
    x = torch.randint(0, 32, (2, 8))
    assert torch.equal(model.gpt(x).logits, reference(x).logits)
    save_weights(engine, model, tmp_path / "out")
    assert (
        "lm_head.weight"
        not in json.loads((tmp_path / "out/model.safetensors.index.json").read_text())["weight_map"]
    )
    again = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out").eval()
    assert torch.equal(again(x).logits, reference(x).logits)


# -------------------------------------------------------------------------------------------------
# bad input: refused before training, nothing written
# -------------------------------------------------------------------------------------------------


def _fit_fails(tmp_path: Path, source, match: str, **options) -> str:
    root = tmp_path / "run"
    trainer = sg.Trainer(
        strategy="single_device",
        accelerator="cpu",
        max_steps=2,
        default_root_dir=root,
        enable_progress_bar=False,
        init_weights=HFWeights(source, **options) if options else source,
    )
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randint(0, 10, (8, 3))), batch_size=4
    )
    with pytest.raises(CheckpointError, match=match) as caught:
        trainer.fit(Net(), loader)
    assert not root.exists(), "nothing is written for a run refused before training"
    return str(caught.value)


def test_a_missing_tensor_is_named_with_the_closest_in_the_checkpoint(tmp_path: Path) -> None:
    weights = _weights()
    weights["proj.weigth"] = weights.pop("proj.weight")
    message = _fit_fails(tmp_path, _save(tmp_path / "in", weights), "1 missing from the checkpoint")
    assert "proj.weight (closest there: proj.weigth)" in message
    assert "1 in the checkpoint but not the model: proj.weigth (closest expected: proj.weight)" in message


def test_an_extra_tensor_a_shape_and_a_dtype_are_refused(tmp_path: Path) -> None:
    weights = _weights()
    weights["extra.bias"] = torch.zeros(3)
    message = _fit_fails(tmp_path, _save(tmp_path / "extra", weights), "in the checkpoint but not the model")
    assert "extra.bias" in message
    weights = _weights()
    weights["proj.weight"] = torch.zeros(12, 9)
    message = _fit_fails(tmp_path, _save(tmp_path / "shape", weights), "do not fit")
    assert "shape of proj.weight: checkpoint proj.weight is (12, 9), model (12, 8)" in message
    weights = _weights()
    weights["out.weight"] = torch.zeros(10, 12, dtype=torch.int64)
    message = _fit_fails(tmp_path, _save(tmp_path / "dtype", weights), "do not fit")
    assert "dtype of out.weight: checkpoint int64, model float32" in message


def test_at_most_ten_names_are_listed_then_a_count(tmp_path: Path) -> None:
    weights = {f"layer.{i}.weight": torch.zeros(2) for i in range(25)} | _weights()
    message = _fit_fails(tmp_path, _save(tmp_path / "in", weights), "25 in the checkpoint but not the model")
    assert "and 15 more" in message and message.count("layer.") == 10


def test_pickled_weights_are_refused_with_how_to_convert(tmp_path: Path) -> None:
    folder = tmp_path / "bin"
    folder.mkdir()
    torch.save(_weights(), folder / "pytorch_model.bin")
    message = _fit_fails(tmp_path, folder, "pickled")
    assert "pytorch_model.bin" in message and "save_pretrained" in message and "safetensors" in message


def test_a_folder_without_weights_and_a_missing_path_are_refused_before_any_launch(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    _fit_fails(tmp_path, tmp_path / "empty", "holds no .safetensors files")
    with pytest.raises(CheckpointError, match="does not exist"):
        sg.Trainer(strategy="ddp", accelerator="cpu", devices=2, init_weights=tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match=r"http:// URL, which init_weights does not read\. Download"):
        sg.Trainer(strategy="ddp", accelerator="cpu", devices=2, init_weights="http://127.0.0.1:9/llama")


def test_strict_false_lists_what_does_not_fit_and_initialises_it(tmp_path: Path) -> None:
    weights = _weights()
    del weights["proj.bias"]
    with pytest.warns(UserWarning, match="(?s)loading what fits.*missing from the checkpoint: proj.bias"):
        _, model = _setup(_save(tmp_path / "in", weights), strict=False)
    assert torch.equal(model.proj.weight, weights["proj.weight"])
    assert 0 < model.proj.bias.abs().max() < 1  # reset_parameters' uniform init, not uninitialised memory
    assert model.scale.value.item() == 2.0  # a non-persistent buffer: its module's reset_parameters


class Constant(torch.nn.Module):
    """A non-persistent buffer computed in the constructor only: on the meta device it has no value."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("value", torch.tensor(2.0), persistent=False)


def test_a_non_persistent_buffer_without_reset_parameters_is_refused(tmp_path: Path) -> None:
    class WithConstant(Net):
        def __init__(self) -> None:
            super().__init__()
            self.scale = Constant()

    with pytest.raises(
        CheckpointError, match=r"modules \['scale'\] have tensors that the checkpoint does not"
    ):
        _setup(_save(tmp_path / "in", _weights()), WithConstant)


# -------------------------------------------------------------------------------------------------
# the command
# -------------------------------------------------------------------------------------------------


def test_the_command_exports_a_checkpoint_with_the_config_and_says_what_it_skipped(tmp_path: Path) -> None:
    source = _save(tmp_path / "in", _weights())
    (source / "tokenizer.json").write_text("{}")
    (source / "pytorch_model.bin").write_bytes(b"never copied")
    engine, model = _setup(source)
    engine.save(
        tmp_path / "ckpt", {"model": model, "hf": dict(model.__dict__["_stratagem_hf"])}, format="full"
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "stratagem",
            "checkpoint",
            "export",
            str(tmp_path / "ckpt"),
            str(tmp_path / "out"),
            "--max-shard-size",
            "200B",
        ],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert done.returncode == 0, done.stderr
    assert "The optimizer state is not exported" in done.stdout
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert {"config.json", "tokenizer.json", "model.safetensors.index.json"} <= set(names)
    assert "pytorch_model.bin" not in names and sum(n.endswith(".safetensors") for n in names) >= 2
    again = subprocess.run(
        [
            sys.executable,
            "-m",
            "stratagem",
            "checkpoint",
            "export",
            str(tmp_path / "ckpt"),
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert again.returncode != 0 and "exists and is not empty" in again.stderr


def test_a_resume_takes_precedence_over_init_weights_and_keeps_the_record(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = _save(tmp_path / "in", _weights())
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randint(0, 10, (8, 3))), batch_size=4
    )

    def fit(steps: int, ckpt_path=None) -> sg.Trainer:
        trainer = sg.Trainer(
            strategy="single_device",
            accelerator="cpu",
            max_steps=steps,
            default_root_dir=tmp_path / "run",
            checkpoint_every_n_steps=2,
            enable_progress_bar=False,
            init_weights=source,
            loggers=[],
        )
        with trainer.init_module(empty_init=True):
            model = Net()
        trainer.fit(model, loader, ckpt_path=ckpt_path)
        return trainer

    fit(2)
    assert "init_weights: 5 tensors" in capsys.readouterr().out
    trainer = fit(4, ckpt_path="last")
    out = capsys.readouterr().out
    assert "init_weights is not read: resuming from" in out and "init_weights: 5 tensors" not in out
    saved = torch.load(tmp_path / "run/checkpoints/step-000004.ckpt", weights_only=True)["state"]["hf"]
    assert saved["source"] == str(source) and trainer.global_step == 4


def test_load_weights_fills_a_model_set_up_already(tmp_path: Path) -> None:
    from stratagem.checkpoint.hf import load_weights

    engine = sg.Engine(strategy="single_device", accelerator="cpu")
    model = engine.setup(Net())  # built and initialised as usual, then filled
    report = load_weights(engine, model, _save(tmp_path / "in", _weights(seed=3)))
    assert report["tensors"] == 5 and report["bytes_read"] == sum(v.numel() * 4 for v in _weights().values())
    assert all(torch.equal(model.state_dict()[k], v) for k, v in _weights(seed=3).items())
