"""``stratagem demo``: trains, checkpoints half-way, resumes in a fresh Trainer, and reports loss and memory."""

from __future__ import annotations

import csv
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from stratagem import get_registry
from stratagem.cli.demo.lm import CharWindows, load_text

sys.path.insert(0, str(Path(__file__).parent))
import demo_workers


def _demo(*args: str, timeout: float) -> subprocess.CompletedProcess:
    # The installed command, as a newcomer runs it (the workers re-run this very command line).
    command = [str(Path(sys.executable).parent / "stratagem"), "demo"]
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=timeout)


def test_the_corpus_ships_with_the_package() -> None:
    text = load_text()
    assert len(text) > 30_000
    data = CharWindows(text, block=64, stride=37)
    x, y = data[3]
    assert x.shape == y.shape == (64,) and (x[1:] == y[:-1]).all()


def _check_report(done: subprocess.CompletedProcess, root: Path, steps: int, ranks: int) -> None:
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    # A default run prints nothing the user cannot act on: no warning of torch's, a plugin's or stratagem's.
    warned = [line for line in (out + done.stderr).splitlines() if "warn" in line.lower()]
    assert not warned, warned
    half = steps // 2
    assert f"Resumed from {root / 'checkpoints' / f'step-{half:06d}.ckpt'} at step {half}" in out
    loss_line = next(line for line in out.splitlines() if line.startswith("loss: first"))
    first, last = float(loss_line.split()[2]), float(loss_line.split()[5])
    assert first > last  # it learns
    rows = [line.split() for line in out.splitlines() if line.strip() and line.split()[0].isdigit()]
    assert [int(r[0]) for r in rows] == list(range(ranks))
    # rank, peak memory, parameters, gradients, optimizer state, their total (each "N MB"), share of a replica
    for row in rows:
        assert len(row) == 12 and row[2:11:2] == ["MB"] * 5 and row[11].endswith("x"), row
        assert all(float(row[i]) > 0 for i in (1, 3, 5, 7, 9))
        assert float(row[9]) == pytest.approx(sum(float(row[i]) for i in (3, 5, 7)), abs=0.015)
    assert sorted(p.name for p in (root / "checkpoints").glob("step-*")) == [
        f"step-{half:06d}.ckpt",
        f"step-{steps:06d}.ckpt",
    ]
    logged = list(csv.DictReader((root / "metrics.csv").open()))
    assert int(logged[-1]["step"]) == steps


@pytest.mark.timeout(120)
def test_demo_single_process(tmp_path: Path) -> None:
    done = _demo("--steps", "40", "--root-dir", str(tmp_path), timeout=110)
    _check_report(done, tmp_path, steps=40, ranks=1)
    assert "strategy single_device, 1 process(es) on cpu" in done.stdout


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
@pytest.mark.skipif(importlib.util.find_spec("stratagem_ddp") is None, reason="needs stratagem-ddp installed")
def test_demo_two_processes_ddp(tmp_path: Path) -> None:
    done = _demo(
        "--devices", "2", "--strategy", "ddp", "--steps", "40", "--root-dir", str(tmp_path), timeout=140
    )
    _check_report(done, tmp_path, steps=40, ranks=2)
    assert done.stdout.count("Resumed from") == 1  # rank 0 alone prints


# -------------------------------------------------------------------------------------------------
# every strategy the demo offers, in one launch: what each rank holds, and that it learns
# -------------------------------------------------------------------------------------------------

#: The repository's plugin packages; a strategy of theirs must say below what it promises.
PACKAGES = ("stratagem-ddp", "stratagem-fsdp", "stratagem-deepspeed", "stratagem-tp", "stratagem-pp")
DEVICES = 2
STEPS = 6


def _offered() -> list[str]:
    """The repository's installed strategies that the demo's request (CPU, 32-true, 2 processes) can use."""
    return sorted(
        info.name
        for info in get_registry()
        if info.plugin.distribution in PACKAGES
        and info.capabilities.refusal(accelerator="cpu", precision="32-true", world_size=DEVICES) is None
        and not info.capabilities.missing_requirements()
    )


OFFERED = _offered()

#: Per rank, as a share of one whole replica: ``whole`` is all of it; ``split`` about 1/N (at least 1/N, at
#: most 1/N + 0.01: tensor parallelism leaves the LayerNorms and the row-split layers' biases whole, 0.9 K of
#: the model's 111.7 K parameters); ``zero`` a ZeRO partition of the optimizer state (the moments' 1/N, with
#: one step counter per flat partition rather than one per tensor, so a hair under 1/N; plus the float32
#: master partition where DeepSpeed keeps one apart from the model: at most 1.5/N). ``None``: not
#: promised at this size. DeepSpeed's gradients are partitions plus reduce buckets whose size is its own
#: choice, and ZeRO-3 keeps every tensor under stage3_param_persistence_threshold (1e5 elements: all of this
#: model's) whole on every rank.
_DDP = {"parameters": "whole", "gradients": "whole", "optimizer": "whole"}
_SHARDED = {"parameters": "split", "gradients": "split", "optimizer": "split"}
_ZERO_1_2 = {"parameters": "whole", "gradients": None, "optimizer": "zero"}
_ZERO_3 = {"parameters": None, "gradients": None, "optimizer": "zero"}
PROMISES = {
    "ddp": _DDP,
    "ddp_find_unused_parameters_true": _DDP,
    "fsdp": _SHARDED,
    "fsdp_cpu_offload": _SHARDED,
    "hsdp": _SHARDED,
    "tp": _SHARDED,
    "fsdp_tp": _SHARDED,
    "deepspeed": _ZERO_1_2,
    "deepspeed_stage_1": _ZERO_1_2,
    "deepspeed_stage_2": _ZERO_1_2,
    "deepspeed_stage_2_offload": _ZERO_1_2,
    "deepspeed_stage_3": _ZERO_3,
    "deepspeed_stage_3_offload": _ZERO_3,
    # Each rank its stages: shares that add up to one replica (test_pipeline_ranks_hold_only_their_stages).
    "pp": {"parameters": None, "gradients": None, "optimizer": None},
}
#: Strategies whose ranks all see the same samples (one data-parallel replica at 2 processes): they train as
#: one process on the same batches. The others split the data like ddp and train as ddp does.
ONE_REPLICA = {"tp", "fsdp_tp", "pp"}


#: Notes a strategy prints on purpose in the demo's run, each saying what the user can change: hsdp on one
#: node is one replica (pass replicate_size for more), and cpu_offload has nothing to offload to on CPU.
ACTIONABLE = {
    "hsdp": "UserWarning: stratagem-fsdp: HYBRID_SHARD on one node: 1 replica of 2 shards",
    "fsdp_cpu_offload": "UserWarning: stratagem-fsdp: cpu_offload: with accelerator='cpu'",
}


def _in_range(kind: str, share: float) -> bool:
    n = DEVICES
    bounds = {"whole": (1.0, 1.0), "split": (1 / n, 1 / n + 0.01), "zero": (0.99 / n, 1.5 / n + 0.01)}[kind]
    return bounds[0] - 1e-9 <= share <= bounds[1] + 1e-9


@pytest.fixture(scope="module")
def demos(tmp_path_factory: pytest.TempPathFactory) -> dict:
    from stratagem.launchers._worker_start import launch_function

    if not OFFERED:
        pytest.skip("no strategy of the repository's plugin packages is installed")
    root = tmp_path_factory.mktemp("demos")
    per_rank = launch_function(
        demo_workers.demo_under_each, (OFFERED, str(root), STEPS, DEVICES), nproc_per_node=DEVICES
    )
    return per_rank[0]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The demo in this process under single_device: the reference for strategies with one data replica."""
    import torch

    from stratagem.cli.demo.lm import run

    threads = torch.get_num_threads()
    try:
        return run(
            strategy="single_device",
            steps=STEPS,
            root_dir=str(tmp_path_factory.mktemp("one")),
            progress_bar=False,
        )
    finally:
        torch.set_num_threads(threads)  # the demo lowers it


def _ok(demos: dict, name: str) -> dict:
    report = demos[name]
    assert "error" not in report, report.get("error")
    return report


def test_every_repository_strategy_the_demo_offers_has_a_promise() -> None:
    assert OFFERED, "no repository strategy installed"
    assert set(OFFERED) <= set(PROMISES), sorted(set(OFFERED) - set(PROMISES))


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", OFFERED)
def test_per_rank_bytes_are_what_the_strategy_promises(demos: dict, name: str) -> None:
    report = _ok(demos, name)
    assert len(report["ranks"]) == DEVICES and report["steps"] == STEPS
    for rank in report["ranks"]:
        for part, kind in PROMISES[name].items():
            share = rank[part] / report["replica"][part]
            assert kind is None or _in_range(kind, share), (
                f"{name}: {part} {share:.3f} of a replica, promised {kind}"
            )
        assert rank["total"] == sum(rank[p] for p in ("parameters", "gradients", "optimizer"))


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", OFFERED)
def test_the_loss_falls_and_follows_the_reference(demos: dict, one_process: dict, name: str) -> None:
    report = _ok(demos, name)
    losses = report["losses"]
    assert len(losses) == STEPS and losses[-1] < losses[0] - 0.5, losses
    # Against one process on the same batches (tensor parallel at 2: one replica sees what it sees), or
    # against ddp for strategies that split the batch as it does (ddp itself is certified against one
    # process by the contract suite). A run that trained wrong is off by tenths after a step or two.
    if name != "ddp":
        reference = one_process["losses"] if name in ONE_REPLICA else _ok(demos, "ddp")["losses"]
        assert losses == pytest.approx(reference, rel=1e-4)


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_tensor_parallel_meshes(demos: dict) -> None:
    if "tp" not in OFFERED:
        pytest.skip("needs stratagem-tp installed")
    assert _ok(demos, "tp")["mesh"] == {"shape": (2,), "names": ("tp",)}
    # fsdp_tp on one node of 2: FSDP over a dimension of 1 and tensor parallel over 2, as hsdp makes 1 x 2.
    assert _ok(demos, "fsdp_tp")["mesh"] == {"shape": (1, 2), "names": ("dp", "tp")}
    assert _ok(demos, "ddp")["mesh"] is None


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_pipeline_ranks_hold_only_their_stages(demos: dict) -> None:
    if "pp" not in OFFERED:
        pytest.skip("needs stratagem-pp installed")
    report = _ok(demos, "pp")
    assert report["mesh"] == {"shape": (2,), "names": ("pp",)}
    # The model's plan: the embeddings and the first block on rank 0, the rest on rank 1; nothing twice.
    assert report["modules"] == [["tok", "pos", "blocks.0"], ["blocks.1", "ln", "head"]]
    for part in ("parameters", "gradients", "optimizer"):
        shares = [rank[part] / report["replica"][part] for rank in report["ranks"]]
        assert all(0.1 < share < 0.9 for share in shares), (part, shares)
        # AdamW's step counters are one per tensor in either case: the split adds up to one replica.
        assert sum(shares) == pytest.approx(1.0, abs=1e-9), (part, shares)


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", OFFERED)
def test_a_default_demo_run_prints_no_warning(demos: dict, name: str) -> None:
    """Python warnings and log records at WARNING (rank 0's; DDP's reducer's C++ warning is not seen this way,
    and the command-line runs above check their whole output)."""
    printed = _ok(demos, name)["warnings"]
    unexpected = [w for w in printed if not (name in ACTIONABLE and w.startswith(ACTIONABLE[name]))]
    assert not unexpected, unexpected
