"""Compiling stage views in one process (``compile=``'s per-stage part of ``wrap_model``): which regions each
stage compiles, and that the compiled stages, run in turn, are the whole model's forward."""

from __future__ import annotations

import copy

import pp_workers as w
import pytest
import torch

from stratagem.strategies.compiling import CompileOptions, Compiler, dynamo_counts
from stratagem_pp import _parallelize, _split, _stage

PLAN = [["embed"], [f"blocks.{i}" for i in range(4)], [f"blocks.{i}" for i in range(4, 8)], ["norm", "head"]]


@pytest.mark.timeout(120)
def test_each_stage_compiles_its_blocks_and_a_stage_without_blocks_compiles_whole() -> None:
    torch._dynamo.reset()
    model = w.make_model()
    split = _split.resolve(PLAN, model, 4)
    compiler = Compiler(CompileOptions(backend="aot_eager"))
    regions = _parallelize.compile_regions(model, compiler)
    assert regions == [f"blocks.{i}" for i in range(8)]
    tokens = torch.randint(w.VOCAB, (3, 5))
    with torch.no_grad():
        expected = model(tokens)
    start = dynamo_counts()["frames"]
    x: tuple = (tokens,)
    compiled = {}
    for index in range(4):
        # Under a V schedule rank 0 holds stages 0 and 3: neither has a block.
        _, (view,) = _stage.build(copy.deepcopy(model), split, [index])
        compiled[index] = _parallelize.compile_stage(view, regions, compiler)
        with torch.no_grad():
            x = (view(*x),)
    assert compiled == {0: [""], 1: regions[:4], 2: regions[4:], 3: [""]}
    assert dynamo_counts()["frames"] - start >= 3  # the two whole stages and the shared block code
    assert torch.allclose(x[0], expected, rtol=1e-12, atol=1e-12)
    # Named regions compile those only: a stage without them compiles nothing.
    named = Compiler(CompileOptions(backend="aot_eager", regional={"Block"}))
    _, (first,) = _stage.build(copy.deepcopy(model), split, [0])
    assert _parallelize.compile_stage(first, _parallelize.compile_regions(model, named), named) == []
    assert named.called
