"""stratagem.planning on several cores: ranks simulated in forked children give what this process gives simulating
them one after another, and a child's failure, its warnings and its death come back to the plan."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import attrs
import pytest

from stratagem.errors import ConfigurationError
from stratagem.planning import World, plan
from stratagem.planning._parallel import RankFailed, run_jobs

pytestmark = pytest.mark.timeout(300)

TINY_LLAMA = {
    "model_type": "llama",
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}


def _timeless(result):
    return attrs.evolve(
        result,
        seconds=0.0,
        largest=attrs.evolve(result.largest, seconds=0.0),
        ranks=tuple(attrs.evolve(r, seconds=0.0) for r in result.ranks),
    )


def test_two_workers_plan_what_one_plans(tmp_path: Path) -> None:
    """A pipeline of 2 stages over 8 ranks: the last stage holds the norm and the head besides its block, so a far
    rank holds more than rank 0 and is stepped as well; each rank's counts and the largest are the same either way."""
    pytest.importorskip("transformers")
    from stratagem.cli.plan import _plan_models

    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    workload = _plan_models.workload(str(tmp_path / "config.json"))
    world = World(devices=4, nodes=2, sequence_length=16)
    one, two = (
        plan(workload, world, strategies=["pp_fsdp[pipeline_parallel_size=2]"], workers=w).strategies[0]
        for w in (1, 2)
    )
    assert one.status == two.status == "simulated", (one.reason, two.reason)
    assert _timeless(two) == _timeless(one)
    assert [r.rank for r in two.ranks] == [0, 3, 4, 7] and two.largest.rank == 4
    assert two.largest.parameters > two.ranks[0].parameters and two.largest.gradients > 0


def _simulate(rank: int, step: bool) -> tuple[int, bool, int]:
    if rank == 3:
        warnings.warn("rank 3 says so", UserWarning, stacklevel=1)
    if rank == 5:
        raise ConfigurationError("rank 5 cannot be simulated: a reason of the strategy's")
    if rank == 6:
        raise ValueError("an error of torch's")
    if rank == 7:
        os._exit(9)  # killed, as by the kernel's out-of-memory killer
    return rank, step, os.getpid()


def test_children_answer_in_order_with_their_warnings() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        answers = run_jobs([(0, True), (1, False), (2, False), (3, True)], _simulate, repr, workers=3)
    assert [a[:2] for a in answers] == [(0, True), (1, False), (2, False), (3, True)]
    assert answers[0][2] == os.getpid() and len({a[2] for a in answers}) == 3  # rank 0 here, 2 children
    assert [str(w.message) for w in caught] == ["rank 3 says so"]


@pytest.mark.parametrize(
    ("rank", "says"),
    [
        (5, "rank 5 cannot be simulated: a reason of the strategy's"),
        (6, "an error of torch's"),
        (7, "the simulation of rank 7 ended without an answer (its process died"),
    ],
)
def test_a_childs_failure_fails_the_plan_with_its_reason(rank: int, says: str) -> None:
    with pytest.raises(RankFailed) as raised:
        run_jobs([(0, True), (1, False), (rank, False)], _simulate, repr, workers=2)
    assert says in str(raised.value)


def test_workers_must_be_positive() -> None:
    with pytest.raises(Exception, match="workers=0: give 1 or more"):
        plan(None, World(devices=2), workers=0)  # type: ignore[arg-type]
