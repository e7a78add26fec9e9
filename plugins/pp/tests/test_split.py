"""The split into stages and the stage views, in one process: plan sources and forms, their errors, and that
running every stage's view in turn is the whole model's forward."""

from __future__ import annotations

import copy

import pp_workers as w
import pytest
import torch

from stratagem.errors import ConfigurationError
from stratagem_pp import Skipped, _split, _stage


def run_stages(model: torch.nn.Module, split: _split.Split, *inputs: torch.Tensor) -> torch.Tensor:
    """Every stage's view of a fresh copy of ``model``, called in turn on the previous one's output."""
    x: tuple = inputs
    for index in range(split.num_stages):
        _, (view,) = _stage.build(copy.deepcopy(model), split, [index])
        out = view(*x)
        x = out if isinstance(out, tuple) else (out,)
    return x[0]


# -------------------------------------------------------------------------------------------------
# even split of the repeated blocks
# -------------------------------------------------------------------------------------------------


def test_blocks_split_evenly_with_the_rest_at_the_ends() -> None:
    split = _split.resolve(None, w.make_model(), 4)
    assert split.source == "even"
    assert split.stages == (
        ("embed", "blocks.0", "blocks.1"),
        ("blocks.2", "blocks.3"),
        ("blocks.4", "blocks.5"),
        ("blocks.6", "blocks.7", "norm", "head"),
    )
    assert split.blocks == tuple(f"blocks.{i}" for i in range(8))


def test_even_split_balances_parameter_counts_not_block_counts() -> None:
    assert _split.even_starts([1, 1, 1, 1, 4], 2) == [0, 4]
    assert _split.even_starts([1, 1, 1, 1, 1], 2) == [0, 3]
    assert _split.even_starts([5, 1, 1, 1, 1, 1], 2) == [0, 1]
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(3)], torch.nn.Linear(4, 4))
    model[3] = torch.nn.Linear(4, 64)
    model.append(torch.nn.Linear(64, 4))
    # Parameters 20, 20, 20, 320, 260: four layers against one balances best (360 / 260), not 3 / 2.
    assert _split.resolve(None, model, 2).stages == (("0", "1", "2", "3"), ("4",))


def test_more_stages_than_blocks_is_refused() -> None:
    with pytest.raises(ConfigurationError, match=r"9 pipeline stages .* 8 blocks in 'blocks'.*at most 8"):
        _split.resolve(None, w.make_model(), 9)


def test_a_model_without_blocks_or_plan_is_refused_with_what_to_give() -> None:
    model = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 8))
    with pytest.raises(ConfigurationError) as error:
        _split.resolve(None, model, 2)
    assert "no repeated blocks" in str(error.value) and "pp_plan" in str(error.value)
    # With a plan it splits.
    assert _split.resolve([["0"], ["1"]], model, 2).stages == (("0",), ("1",))


# -------------------------------------------------------------------------------------------------
# plan forms and sources
# -------------------------------------------------------------------------------------------------


def test_stage_beginnings_with_or_without_the_first_piece() -> None:
    model = w.make_model()
    expected = (
        ("embed", "blocks.0", "blocks.1", "blocks.2"),
        ("blocks.3", "blocks.4", "blocks.5", "blocks.6", "blocks.7", "norm", "head"),
    )
    assert _split.resolve(["blocks.3"], model, 2).stages == expected
    assert _split.resolve(["embed", "blocks.3"], model, 2).stages == expected


def test_one_list_per_stage() -> None:
    plan = [["embed", "blocks.0"], [f"blocks.{i}" for i in range(1, 8)] + ["norm", "head"]]
    split = _split.resolve(plan, w.make_model(), 2)
    assert split.source == "option" and split.stages[0] == ("embed", "blocks.0")


def test_the_option_wins_over_the_model_attribute() -> None:
    model = w.make_model()
    model.pp_plan = ["blocks.6"]
    assert _split.resolve(None, model, 2).source == "model.pp_plan"
    assert _split.resolve(None, model, 2).stages[1][0] == "blocks.6"
    split = _split.resolve(["blocks.2"], model, 2)
    assert split.source == "option" and split.stages[1][0] == "blocks.2"


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        (["blocks.40"], r"no module 'blocks.40'.*Closest: blocks.4"),
        (["blokcs.4"], r"no module 'blokcs.4'.*Closest: blocks.4"),
        (["blocks.4.mlp"], r"\['blocks.4.mlp'\] are not pieces.*embed, blocks.0"),
        (["blocks.5", "blocks.2"], r"not in the model's order"),
        (["blocks.2", "blocks.5"], r"makes 3 stages, but the pipeline has 2"),
        ([["embed", "blocks.0"], ["blocks.0", "head"]], r"'blocks.0' \(stage 1\) overlaps 'blocks.0'"),
        ([["embed"], ["head"]], r"\['blocks', 'norm'\] hold parameters but belong to no stage"),
    ],
)
def test_bad_plans_say_what_is_wrong(plan: list, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        _split.resolve(plan, w.make_model(), 2)


def test_weights_tied_across_stages_are_refused() -> None:
    model = w.make_model()
    model.head.weight = model.embed.weight
    with pytest.raises(ConfigurationError, match=r"tied weights.*tie_word_embeddings=False"):
        _split.resolve(None, model, 2)


def test_hugging_face_llama_splits_by_its_base_model_pp_plan() -> None:
    model = w.make_llama()
    assert set(model.pp_plan) == {"model.embed_tokens", "model.layers", "model.norm", "lm_head"}
    split = _split.resolve(None, model, 4)
    assert split.source == "hf"
    assert split.stages == (
        ("model.embed_tokens", "model.layers.0"),
        ("model.layers.1",),
        ("model.layers.2",),
        ("model.layers.3", "model.norm", "lm_head"),
    )
    tokens = torch.randint(64, (2, 7))
    with torch.no_grad():
        assert torch.equal(run_stages(model, split, tokens), model(tokens).logits)


def test_a_config_plan_alone_is_prefixed_with_the_base_model() -> None:
    model = w.make_llama()
    source, plan = _split.find(None, torch.nn.Module())
    assert (source, plan) == ("even", None)
    holder = torch.nn.Module()
    holder.config, holder.base_model_prefix, holder.model = model.config, "model", model.model
    source, plan = _split.find(None, holder)
    assert source == "hf" and set(plan) == {"model.embed_tokens", "model.layers", "model.norm"}


# -------------------------------------------------------------------------------------------------
# stage views and the holder
# -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stages", [2, 4, 8])
def test_running_the_stages_in_turn_is_the_whole_forward(stages: int) -> None:
    model = w.make_model()
    tokens = torch.randint(w.VOCAB, (3, 5))
    with torch.no_grad():
        assert torch.equal(run_stages(model, _split.resolve(None, model, stages), tokens), model(tokens))


def test_a_stage_without_blocks_keeps_an_empty_block_container() -> None:
    # The contract model's four-stage plan: the embedding alone, one block each, the norm and head. A stage
    # without blocks must still loop over a container (an empty one), not over a Skipped module.
    model = w.make_model()
    plan = [
        ["embed"],
        [f"blocks.{i}" for i in range(4)],
        [f"blocks.{i}" for i in range(4, 8)],
        ["norm", "head"],
    ]
    split = _split.resolve(plan, model, 4)
    holder, views = _stage.build(copy.deepcopy(model), split, [0, 3])
    for module in (holder, *views):
        assert isinstance(module.blocks, torch.nn.ModuleList) and len(module.blocks) == 0
    tokens = torch.randint(w.VOCAB, (3, 5))
    with torch.no_grad():
        assert torch.equal(run_stages(model, split, tokens), model(tokens))


def test_the_holder_keeps_this_ranks_parameters_under_their_names() -> None:
    model = w.make_model()
    originals = dict(model.named_parameters())
    split = _split.resolve(None, model, 4)
    holder, views = _stage.build(model, split, [0, 2])
    assert holder is model
    names = [n for n, _ in holder.named_parameters()]
    assert {n.split(".")[0] + ("." + n.split(".")[1] if n.startswith("blocks") else "") for n in names} == {
        "embed",
        "blocks.0",
        "blocks.1",
        "blocks.4",
        "blocks.5",
    }
    # Nothing copied: the views and the holder share the user's parameter objects.
    for name, param in holder.named_parameters():
        assert param is originals[name]
    assert views[1].get_submodule("blocks.4") is holder.get_submodule("blocks.4")
    assert views[0].get_submodule("blocks.0") is holder.get_submodule("blocks.0")
    # Other stages' blocks leave the container, keeping the others' names; other modules are Skipped.
    assert list(holder.blocks._modules) == ["0", "1", "4", "5"] and list(views[0].blocks._modules) == [
        "0",
        "1",
    ]
    assert isinstance(holder.head, Skipped) and isinstance(views[1].embed, Skipped)
    assert not holder.head  # falsy, for forwards that test "if self.pos_embed:"
    assert views[0] is not holder and type(views[0]) is type(holder)


def test_stateless_steps_go_with_a_stage_and_buffer_only_helpers_are_shared() -> None:
    class WithHelpers(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(8, 4)
            self.blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(4)])
            self.scale = _Scale()
            self.act = torch.nn.Tanh()
            self.head = torch.nn.Linear(4, 8)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            x = self.embed(tokens)
            for block in self.blocks:
                x = self.scale(block(x))
            return self.head(self.act(x))

    torch.manual_seed(0)
    model = WithHelpers()
    split = _split.resolve(None, model, 2)
    assert split.stages[1] == ("blocks.2", "blocks.3", "act", "head")
    holder, _ = _stage.build(copy.deepcopy(model), split, [0])
    assert isinstance(holder.act, Skipped) and isinstance(holder.scale, _Scale)
    # The helper runs after each block in the loop: only this stage's blocks are in it.
    assert len(holder.blocks) == 2
    tokens = torch.randint(8, (2, 3))
    with torch.no_grad():
        assert torch.equal(run_stages(model, split, tokens), model(tokens))


class _Scale(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("factor", torch.tensor(0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


def test_stage_outputs_become_tensors() -> None:
    assert _stage.tensor_outputs({"logits": torch.ones(1), "cache": None}).shape == (1,)
    assert len(_stage.tensor_outputs((torch.ones(1), 3, torch.zeros(2)))) == 2
    with pytest.raises(ConfigurationError, match="must return a tensor"):
        _stage.tensor_outputs("text")
