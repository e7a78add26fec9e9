"""``stratagem compare``: column parsing, input errors, and real launches measuring themselves."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from stratagem.cli.compare import Column, ColumnResult, format_table, load_model_factory, parse_columns
from stratagem.errors import ConfigurationError


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "stratagem", "compare", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_parse_columns_names_options_and_shorthand() -> None:
    columns = parse_columns("ddp, fsdp,fsdp[SHARD_GRAD_OP],fsdp[cpu_offload=true,limit=3],ddp[x=none,y=0.5]")
    assert columns == [
        Column("ddp", "ddp"),
        Column("fsdp", "fsdp"),
        Column("fsdp[SHARD_GRAD_OP]", "fsdp", {"sharding_strategy": "SHARD_GRAD_OP"}),
        Column("fsdp[cpu_offload=true,limit=3]", "fsdp", {"cpu_offload": True, "limit": 3}),
        Column("ddp[x=none,y=0.5]", "ddp", {"x": None, "y": 0.5}),
    ]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "name at least one"),
        ("ddp,ddp", "listed twice"),
        ("DDP", "cannot read"),
        ("fsdp[a=1,B]", "needs a value"),
        ("fsdp[SHARD", "cannot read"),
    ],
)
def test_parse_columns_refuses_bad_input(text: str, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        parse_columns(text)


def test_bad_requests_fail_before_launching(stratagem_cli) -> None:
    unknown = stratagem_cli(
        "compare", "--strategies", "single_device,nosuch", "--devices", "1", "--model", "small"
    )
    assert unknown.returncode == 2
    assert "nosuch" in unknown.stderr and "single_device" in unknown.stderr  # names the installed ones
    too_many = stratagem_cli("compare", "--strategies", "single_device", "--devices", "2", "--model", "small")
    assert too_many.returncode == 2 and "world size" in too_many.stderr.lower()
    model = stratagem_cli("compare", "--strategies", "single_device", "--devices", "1", "--model", "huge")
    assert model.returncode == 2 and "small" in model.stderr and "PATH:Class" in model.stderr


def test_plot_without_matplotlib_names_the_extra(tmp_path: Path) -> None:
    # matplotlib is blocked in this interpreter only, as if it were not installed.
    code = (
        "import sys; sys.modules['matplotlib'] = None; from stratagem.cli import main; "
        f"sys.exit(main(['compare', '--strategies', 'single_device', '--devices', '1', '--plot', {str(tmp_path / 'x.png')!r}]))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "pip install 'stratagem[plot]'" in done.stderr
    assert not (tmp_path / "x.png").exists()


def test_model_from_a_file(tmp_path: Path) -> None:
    source = tmp_path / "my_model.py"
    source.write_text(
        "import torch\n"
        "class Good(torch.nn.Module):\n"
        "    def example_batch(self, batch_size, generator):\n"
        "        return torch.randn(batch_size, 2, generator=generator)\n"
        "class NoBatches(torch.nn.Module):\n"
        "    pass\n"
    )
    assert load_model_factory(f"{source}:Good").__name__ == "Good"
    with pytest.raises(ConfigurationError, match="example_batch"):
        load_model_factory(f"{source}:NoBatches")
    with pytest.raises(ConfigurationError, match="no attribute 'Missing'"):
        load_model_factory(f"{source}:Missing")
    with pytest.raises(ConfigurationError, match="is not a file"):
        load_model_factory(f"{tmp_path / 'nope.py'}:Good")


def _expected_small_model_bytes() -> tuple[int, int]:
    from stratagem.cli.compare import _bench_models

    model = _bench_models.small()
    model.configure_model()
    params = list(model.parameters())
    return sum(p.numel() * 4 for p in params), len(params)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_single_device_json_and_plot(tmp_path: Path) -> None:
    has_matplotlib = importlib.util.find_spec("matplotlib") is not None
    out = tmp_path / "compare.png"
    args = ["--strategies", "single_device", "--devices", "1", "--steps", "3", "--model", "small", "--json"]
    done = run_cli(*args, *(["--plot", str(out)] if has_matplotlib else []))
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert (data["model"], data["devices"], data["steps"], data["accelerator"]) == ("small", 1, 3, "cpu")
    (column,) = data["columns"]
    assert column["label"] == column["strategy"] == "single_device"
    assert column["iterations_per_second"] > 0 and column["warmup_steps"] == 1
    (rank,) = column["ranks"]
    param_bytes, n_params = _expected_small_model_bytes()
    assert rank["parameter_bytes"] == param_bytes
    assert rank["gradient_bytes"] == param_bytes
    # AdamW: two moments per parameter plus a float32 step counter per parameter tensor.
    assert rank["optimizer_bytes"] == 2 * param_bytes + 4 * n_params
    assert rank["state_bytes"] == 4 * param_bytes + 4 * n_params
    assert 0 < rank["baseline_rss_bytes"] <= rank["peak_rss_bytes"]
    assert rank["peak_rss_above_baseline_bytes"] == rank["peak_rss_bytes"] - rank["baseline_rss_bytes"]
    assert len(rank["step_times_s"]) == 3 and rank["cuda_max_allocated_bytes"] is None
    # The launcher's allocator setting reached the worker.
    from stratagem.launchers._worker_start import CPU_ALLOCATOR_ENV

    assert all(rank["allocator_env"].get(k) == v for k, v in CPU_ALLOCATOR_ENV.items())
    if has_matplotlib:
        import matplotlib.image

        assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        height, width, _ = matplotlib.image.imread(out).shape
        assert width > 600 and height > 400


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_ddp_and_fsdp_shard_state_across_two_ranks() -> None:
    pytest.importorskip("stratagem_ddp")
    pytest.importorskip("stratagem_fsdp")
    done = run_cli("--strategies", "ddp,fsdp", "--devices", "2", "--steps", "2", "--model", "small", "--json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    ddp, fsdp = data["columns"]
    param_bytes, _ = _expected_small_model_bytes()
    assert [r["rank"] for r in ddp["ranks"]] == [0, 1] == [r["rank"] for r in fsdp["ranks"]]
    assert all(r["parameter_bytes"] == r["gradient_bytes"] == param_bytes for r in ddp["ranks"])
    # Each rank holds its shard only: the shards add up to one replica.
    assert sum(r["parameter_bytes"] for r in fsdp["ranks"]) == param_bytes
    assert sum(r["gradient_bytes"] for r in fsdp["ranks"]) == param_bytes
    assert all(r["state_bytes"] < 0.6 * ddp["ranks"][0]["state_bytes"] for r in fsdp["ranks"])
    # The table: one column per strategy, the seeds' rows, the ratio to the first column.
    results = [
        ColumnResult(
            column=Column(c["label"], c["strategy"]), ranks=c["ranks"], warmup=c["warmup_steps"], wall_s=0
        )
        for c in data["columns"]
    ]
    lines = format_table(results, model="small", devices=2, steps=2).splitlines()
    assert lines[0].split() == ["ddp", "fsdp"]
    labels = [line.split("  ")[0].strip() for line in lines]
    for label in (
        "Params + grads + optimizer (MB)",
        "Peak RSS (MB)",
        "Peak RSS above baseline (MB)",
        "Iterations per second",
    ):
        assert label in labels
    state_ratio = lines[labels.index("Params + grads + optimizer (MB)") + 1]
    expected = fsdp["ranks"][0]["state_bytes"] / ddp["ranks"][0]["state_bytes"]
    assert state_ratio.split() == ["vs", "ddp", "1.00x", f"{expected:.2f}x"]


def _one_process_losses(steps: int, batch_size: int = 16) -> list[float]:
    """The small model in this process, plain torch, on the batches compare gives data-parallel rank 0."""
    import torch

    from stratagem.cli.compare import _bench_models

    torch.manual_seed(0)
    model = _bench_models.small()
    model.configure_model()
    optimizer = model.configure_optimizers()
    generator = torch.Generator().manual_seed(0)
    losses = []
    for step in range(steps):
        loss = model.training_step(model.example_batch(batch_size, generator), step)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def _whole_under_tensor_parallelism() -> int:
    """Bytes of the small model's parameters that its plan leaves whole: norms, row-split biases, the head."""
    from stratagem.cli.compare import _bench_models

    model = _bench_models.small()
    model.configure_model()
    split = {f"blocks.{i}.{m}" for i in range(model.depth) for m in ("up.weight", "up.bias", "down.weight")}
    return sum(p.numel() * 4 for n, p in model.named_parameters() if n not in split)


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_tensor_parallel_columns_split_the_model_and_share_a_batch() -> None:
    pytest.importorskip("stratagem_tp")
    # fsdp_tp at 2 processes: a 1 x 2 mesh (refused before: "does not support world size 2").
    done = run_cli(
        "--strategies", "tp,fsdp_tp", "--devices", "2", "--steps", "3", "--model", "small", "--json"
    )
    assert done.returncode == 0, done.stderr
    columns = json.loads(done.stdout)["columns"]
    assert [c["label"] for c in columns] == ["tp", "fsdp_tp"]
    param_bytes, _ = _expected_small_model_bytes()
    whole = _whole_under_tensor_parallelism()
    assert whole < 0.03 * param_bytes
    reference = _one_process_losses(3)
    untrained = _one_process_losses(1) * 3
    assert max(abs(a - b) for a, b in zip(reference, untrained)) > 1e-3
    for column in columns:
        for rank in column["ranks"]:
            # Each rank holds half of each split layer (the plan from the model's tp_plan) and the rest whole.
            assert rank["parameter_bytes"] == (param_bytes - whole) // 2 + whole
            assert rank["gradient_bytes"] == rank["parameter_bytes"]
            assert rank["samples_per_step"] == 16  # one data-parallel rank: both compute on its batch
            # ...the batches one process trains on, with the same result.
            assert rank["losses"] == pytest.approx(reference, rel=1e-5)
