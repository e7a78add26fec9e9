"""stratagem.planning: the simulated world, the counts it makes, and the plan's answers, each against a count made
independently (by hand from tensor shapes, by torch's memory tracker over a real step, by the ring formulas)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from stratagem.contract import _suite_model as m
from stratagem.errors import ConfigurationError, UnknownStrategyError
from stratagem.planning import Workload, World, parse_bytes, plan
from stratagem.planning._plan import far_ranks
from stratagem.planning._trace import sent_per_rank
from stratagem.planning._world import _LazyChunks

pytestmark = pytest.mark.timeout(300)

TINY_LLAMA = {
    "model_type": "llama",
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}


def contract_plan(strategy: str, devices: int, ranks: str = "all"):
    world = World(devices=devices, batch_size=m.PER_RANK_BATCH, sequence_length=m.SEQUENCE)
    return plan(m.plan_workload(), world, strategies=[strategy], ranks=ranks).strategies[0]


def shapes() -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        return {n: tuple(p.shape) for n, p in m.ContractModel().named_parameters()}


# -------------------------------------------------------------------------------------------------
# pieces
# -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rows", [0, 1, 3, 7, 8, 9, 16, 17])
@pytest.mark.parametrize("chunks", [1, 2, 3, 8])
def test_lazy_chunks_are_fsdp2s_chunks(rows: int, chunks: int) -> None:
    from torch.distributed.fsdp._fully_shard._fsdp_common import _chunk_with_empty

    tensor = torch.arange(max(rows, 1) * 5, dtype=torch.float32)[: rows * 5].view(rows, 5)
    expected = _chunk_with_empty(tensor, chunks, dim=0)
    lazy = _LazyChunks(tensor, chunks, dim=0)
    assert len(lazy) == len(expected) == chunks
    for index, want in enumerate(expected):
        got = lazy[index]
        assert (got.shape, got.stride(), got.storage_offset()) == (
            want.shape,
            want.stride(),
            want.storage_offset(),
        )
        assert torch.equal(got, want)


def test_sizes_need_their_unit() -> None:
    assert parse_bytes("80GB") == 80 * 10**9
    assert parse_bytes("80GiB") == 80 * 2**30
    assert parse_bytes("1.5 TiB") == int(1.5 * 2**40)
    with pytest.raises(ConfigurationError, match=r"'80' has no unit: write 80GB .* or 80GiB"):
        parse_bytes("80")
    with pytest.raises(ConfigurationError, match=r"unknown unit 'XB'"):
        parse_bytes("80XB")


def test_far_ranks_are_the_ends_of_each_mesh_dimension() -> None:
    assert far_ranks(None, 8) == [7]
    assert far_ranks((8,), 8) == [7]
    # (pp, dp, tp) = (16, 16, 8): rank = pp * 128 + dp * 8 + tp.
    assert far_ranks((16, 16, 8), 2048) == [7, 120, 1920, 2047]


def test_bytes_sent_follow_the_ring_algorithms() -> None:
    assert sent_per_rank("all_reduce", 4, 1000) == 1500  # 2 (n-1)/n S
    assert sent_per_rank("all_gather", 4, 1000) == 750
    assert sent_per_rank("reduce_scatter", 4, 1000) == 750
    assert sent_per_rank("send", 4, 1000) == 1000
    assert sent_per_rank("all_reduce", 1, 1000) == 0


# -------------------------------------------------------------------------------------------------
# the plan against independent counts
# -------------------------------------------------------------------------------------------------


def test_fsdp_ranks_hold_their_rows_counted_by_hand() -> None:
    """FSDP2 gives rank r rows [r c, (r + 1) c) of each parameter's dim 0, c = ceil(dim 0 / world): at 3 ranks
    the shards are uneven, and the last rank holds less."""
    result = contract_plan("fsdp", 3)
    by_rank = {r.rank: r for r in result.ranks}
    for rank in range(3):
        rows = 0
        expected = 0
        for shape in shapes().values():
            step = math.ceil(shape[0] / 3)
            rows = max(0, min(step, shape[0] - rank * step))
            expected += rows * math.prod(shape[1:]) * 4
        held = by_rank[rank]
        assert held.parameters == expected, rank
        assert held.gradients == expected, rank  # a gradient like each shard
        # AdamW: two moments like each shard, and a float32 step count per parameter tensor.
        assert held.optimizer == 2 * expected + 4 * len(shapes()), rank
    assert result.largest.rank == 0 and by_rank[2].parameters < by_rank[0].parameters


def test_ddp_sends_its_gradients_in_a_ring_all_reduce() -> None:
    result = contract_plan("ddp", 4, ranks="largest")
    gradients = sum(math.prod(s) for s in shapes().values()) * 4
    assert result.largest.gradients == gradients
    assert result.largest.collectives == {"all_reduce": {"count": 1, "bytes": gradients * 2 * 3 // 4}}
    assert result.largest.communication == gradients * 2 * 3 // 4


def test_tensor_parallel_all_reduces_are_traced() -> None:
    """The contract model's plan splits each block's MLP column- then row-wise: one all-reduce of the block's
    output in forward, one of its input's gradient in backward, each of batch x sequence x width floats."""
    result = contract_plan("tp", 2, ranks="largest")
    payload = m.PER_RANK_BATCH * m.SEQUENCE * m.WIDTH * 4
    assert result.largest.collectives["all_reduce"]["count"] == 2 * m.BLOCKS
    assert result.largest.communication == 2 * m.BLOCKS * sent_per_rank("all_reduce", 2, payload)


def _held_after_one_real_step() -> dict[str, int]:
    """What one process holds after a real step of the contract's model under AdamW, counted from its tensors
    here (not by ``Strategy.memory_held``): what every rank of ``ddp`` holds."""

    def size(tensors) -> int:
        return sum(t.numel() * t.element_size() for t in tensors)

    torch.manual_seed(0)
    model = m.ContractModel()
    optimizer = torch.optim.AdamW(model.parameters(), lr=m.LEARNING_RATE)
    tokens = torch.randint(m.VOCAB, (m.PER_RANK_BATCH, m.SEQUENCE))
    m.loss_fn(model(tokens), tokens).backward()
    gradients = size(p.grad for p in model.parameters())
    optimizer.step()
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return {
        "parameters": size(model.parameters()),
        "buffers": size(model.buffers()),
        "gradients": gradients,
        "optimizer": size(state),
    }


def test_the_contract_check_fails_a_plan_the_run_contradicts() -> None:
    """The contract's check (test_plan) on ddp's plan: equal to a real step's bytes, it passes; a plan whose
    optimizer bytes are 4 too many, or a run whose rank the plan only set up holding more than the plan's
    largest holds in all, fails it."""
    import attrs

    from stratagem.contract.test_plan import problems_against

    result = contract_plan("ddp", 2, ranks="largest")
    real = _held_after_one_real_step()
    assert [r.rank for r in result.ranks] == [0, 1] and result.largest.rank == 0
    assert problems_against(result, {0: real, 1: real}) == []
    wrong = attrs.evolve(result.largest, optimizer=result.largest.optimizer + 4)
    wrong_plan = attrs.evolve(result, largest=wrong, ranks=(wrong, *result.ranks[1:]))
    assert problems_against(wrong_plan, {0: real, 1: real}) == [
        f"rank 0 optimizer: the plan (simulated) says {real['optimizer'] + 4} bytes, the run holds "
        f"{real['optimizer']}"
    ]
    # A rank the plan only set up, holding 4 bytes more than the reported rank's total (activations included).
    more = {**real, "optimizer": real["optimizer"] + (result.largest.activations or 0) + 4}
    (problem,) = problems_against(result, {0: real, 1: more})
    assert problem.startswith(f"rank 1 of the run holds {sum(more.values())} bytes, more than the"), problem


def _real_activations(workload: Workload, batch_size: int, sequence_length: int) -> int:
    """Torch's own memory tracker over a real forward and backward in this process."""
    from torch.distributed._tools.mem_tracker import MemTracker

    torch.manual_seed(0)
    model = workload.build()
    batch = workload.batch(model, batch_size, sequence_length)
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        workload.step(model, model, batch).backward()
    peak = tracker.get_tracker_snapshot("peak")
    return sum(
        v for per in peak.values() for k, v in per.items() if getattr(k, "value", k) in ("Activation", "Temp")
    )


@pytest.mark.parametrize("model", ["demo", "llama"])
def test_activations_are_within_a_quarter_of_torchs_tracker_on_a_real_step(
    model: str, tmp_path: Path
) -> None:
    from stratagem.cli.plan import _plan_models

    if model == "llama":
        pytest.importorskip("transformers")
        (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
        workload = _plan_models.workload(str(tmp_path / "config.json"))
    else:
        workload = _plan_models.workload("demo")
    real = _real_activations(workload, 4, 32)
    planned = plan(workload, World(devices=1, batch_size=4, sequence_length=32), strategies=["single_device"])
    estimate = planned.strategies[0].largest.activations
    assert abs(estimate - real) <= 0.25 * real, (estimate, real)


# -------------------------------------------------------------------------------------------------
# bad input
# -------------------------------------------------------------------------------------------------


def test_each_simulated_rank_steps_on_its_own_mesh() -> None:
    """DTensor caches shardings and redistribution plans by mesh layout, which every simulated rank's 2 x 2 mesh
    shares: ranks 2 and 3, simulated after rank 0, ran on rank 0's mesh, whose tensor-parallel group is not
    theirs, and failed ("Could not resolve the process group registered under the name 3")."""
    result = contract_plan("fsdp_tp[tensor_parallel_size=2]", 4)
    assert result.status == "simulated", result.reason
    assert [r.rank for r in result.ranks] == [0, 1, 2, 3]
    assert len({(r.parameters, r.gradients, r.optimizer) for r in result.ranks}) == 1


def test_a_world_the_mesh_cannot_divide_names_what_would() -> None:
    result = contract_plan("pp_fsdp_tp", 6, ranks="largest")
    assert result.status == "not estimated" and result.largest is None
    assert "does not divide the world size 6" in result.reason
    assert "Use pipeline_parallel_size in [1, 3]" in result.reason


def test_a_model_without_blocks_cannot_be_pipelined() -> None:
    class Flat(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.only = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.only(x)

    workload = Workload(name="flat", build=Flat)
    hook = sys.excepthook
    result = plan(workload, World(devices=2), strategies=["pp"]).strategies[0]
    assert result.status == "not estimated"
    assert "pp_plan" in result.reason, result.reason
    # torch's process groups prefix the process's tracebacks with their rank: not the simulated ranks'.
    assert sys.excepthook is hook


def test_an_unknown_strategy_names_the_closest() -> None:
    with pytest.raises(UnknownStrategyError, match="Did you mean 'fsdp'"):
        plan(m.plan_workload(), World(devices=2), strategies=["fsdpp"])


# -------------------------------------------------------------------------------------------------
# scale: the 1T acceptance lives in benchmarks/plan.py; here the same widths with few layers, at 2048 ranks
# -------------------------------------------------------------------------------------------------

WIDE = {
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 26624,
    "intermediate_size": 69632,
    "num_attention_heads": 208,
    "num_key_value_heads": 8,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}


def _wide_rank0(layers: range, embed: bool, head: bool, tp: int, dp: int) -> int:
    """Rank 0's parameter bytes, by hand: tensor parallel splits Llama's q/k/v/gate/up and the head on their
    output features, o/down on their input features, and the embedding on its vocabulary (Llama's plan), the
    first rank taking the ceil; FSDP2 then gives rank 0 ceil(rows / dp) of each."""
    h, i, v = WIDE["hidden_size"], WIDE["intermediate_size"], WIDE["vocab_size"]
    kv = WIDE["num_key_value_heads"] * h // WIDE["num_attention_heads"]
    colwise, rowwise, whole = [(h, h), (kv, h), (kv, h), (i, h), (i, h)], [(h, h), (h, i)], [(h, 1), (h, 1)]
    tensors = [(r, c, "col") for _ in layers for r, c in colwise]
    tensors += [(r, c, "row") for _ in layers for r, c in rowwise]
    tensors += [(r, c, "") for _ in layers for r, c in whole]
    tensors += [(v, h, "col")] if embed else []  # "embedding_rowwise": the vocabulary split
    tensors += [(h, 1, ""), (v, h, "col")] if head else []
    total = 0
    for rows, cols, style in tensors:
        rows = math.ceil(rows / tp) if style == "col" else rows
        cols = math.ceil(cols / tp) if style == "row" else cols
        total += math.ceil(rows / dp) * cols * 4
    return total


@pytest.mark.parametrize(
    ("strategy", "layers", "rank", "expected"),
    [
        ("fsdp", 2, 0, lambda: _wide_rank0(range(2), True, True, 1, 2048)),
        ("fsdp_tp[tensor_parallel_size=8]", 2, 0, lambda: _wide_rank0(range(2), True, True, 8, 256)),
        # 16 layers in 16 stages of 128 ranks: the first stage holds a layer and the embedding, the last a layer,
        # the final norm and the head (as large as the embedding): the last stage's first rank holds the most.
        (
            "pp_fsdp_tp[pipeline_parallel_size=16,tensor_parallel_size=8]",
            16,
            1920,
            lambda: _wide_rank0(range(1), False, True, 8, 16),
        ),
    ],
)
def test_2048_ranks_hold_what_the_sharding_rules_give(
    strategy, layers, rank, expected, tmp_path: Path
) -> None:
    pytest.importorskip("transformers")
    from stratagem.cli.plan import _plan_models

    (tmp_path / "config.json").write_text(json.dumps({**WIDE, "num_hidden_layers": layers}))
    workload = _plan_models.workload(str(tmp_path / "config.json"))
    result = plan(
        workload, World(devices=8, nodes=256, sequence_length=64), strategies=[strategy]
    ).strategies[0]
    assert result.status == "simulated", result.reason
    assert result.largest.rank == rank
    assert abs(result.largest.parameters - expected()) <= 0.001 * expected()


# -------------------------------------------------------------------------------------------------
# the command line
# -------------------------------------------------------------------------------------------------


def test_the_json_holds_the_keys_scripts_read(capsys: pytest.CaptureFixture[str]) -> None:
    from stratagem.cli import main

    args = ["plan", "--model", "demo", "--devices", "2", "--memory", "1GiB", "--seq", "16"]
    assert main([*args, "--strategies", "ddp,fsdp", "--json", "--quiet"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [s["name"] for s in out["strategies"]] == ["ddp", "fsdp"]
    for s in out["strategies"]:
        assert s["fits"] is True and s["rank"] == 0
        parts = [s[k] for k in ("parameters", "gradients", "optimizer", "activations")]
        assert all(isinstance(v, int) and v > 0 for v in parts), s
        assert s["total"] == sum(parts) + s["buffers"]
    ddp, fsdp = out["strategies"]
    assert fsdp["parameters"] < ddp["parameters"]  # sharded over the 2 ranks


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("nowhere/config.json", "--model nowhere/config.json: no such file (nowhere does not exist)"),
        ("no_such_package.models:LM", "no module named 'no_such_package' can be imported"),
        ("stratagem.contract._suite_model:ContractModle", "Did you mean 'ContractModel'?"),
        ("demo.json", "--model demo.json: no such file"),
    ],
)
def test_an_unknown_model_says_what_to_give(
    model: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from stratagem.cli import main

    assert main(["plan", "--model", model, "--devices", "2", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert message in err, err


def test_memory_without_a_unit_is_refused_by_the_command(capsys: pytest.CaptureFixture[str]) -> None:
    from stratagem.cli import main

    assert main(["plan", "--model", "demo", "--devices", "2", "--memory", "80", "--quiet"]) == 2
    assert "'80' has no unit: write 80GB" in capsys.readouterr().err
