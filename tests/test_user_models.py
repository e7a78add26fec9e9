"""The README's example and a Hugging Face causal LM, each called from ``training_step`` the way users write
it, train under every sharded strategy on 2 processes and match the one-process run on the global batch.

Both models hold parameters at the root, outside any wrapped block (the README model's ``net`` is one
``Sequential``; GPT-2's embeddings and head), and their steps call submodules directly: under a strategy that
shards in place (FSDP2), the root's parameters are gathered only when the Trainer calls into the model through
its ``__call__``. One launch per family (torch's, DeepSpeed's) trains both models under each of its
strategies in turn.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import user_models_script as script

#: fp32, 5 AdamW steps: two processes differ from one only in summation order (measured: under 1e-6).
TOLERANCE = 1e-5
HAVE_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None

pytestmark = pytest.mark.skipif(not HAVE_TRANSFORMERS, reason="needs transformers (requirements-test.txt)")


def _train(strategies: list[str], devices: int, out: Path) -> dict[str, dict[str, dict[str, torch.Tensor]]]:
    """``{strategy: {"net"|"gpt": state dict}}``: one process on the global batch, or one launch of 2 workers
    that trains every strategy given, one after the other. Each process runs what the script runs under
    ``stratagem run`` (``train``: the rank environment, no process group yet), forked rather than a new
    interpreter importing torch and transformers; the one-process run too, keeping this process's state clean."""
    from stratagem.launchers._worker_start import launch_function

    launch_function(
        script.train,
        (strategies, devices, str(out)),
        nproc_per_node=devices,
        accelerator="cpu",
        env={"DS_ACCELERATOR": "cpu"},
    )
    # A full checkpoint: its "model" entry maps each module of the saved state ("model") to its state dict.
    return {
        strategy: {
            kind: torch.load(out / strategy / f"{kind}.ckpt", weights_only=True)["model"]["model"]
            for kind in ("net", "gpt")
        }
        for strategy in strategies
    }


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, torch.Tensor]]:
    return _train(["single_device"], 1, tmp_path_factory.mktemp("single"))["single_device"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory):
    """One launch per family, made when a test first asks for one of its strategies. DeepSpeed has a family
    of its own: it patches torch in the processes it runs in."""
    done: dict[str, dict] = {}

    def get(strategy: str) -> dict[str, dict[str, torch.Tensor]]:
        family = "deepspeed" if strategy.startswith("deepspeed") else "torch"
        if family not in done:
            names = [
                p.values[0] for p in STRATEGIES if p.values[0].startswith("deepspeed") == (family != "torch")
            ]
            done[family] = _train(names, 2, tmp_path_factory.mktemp(family))
        return done[family][strategy]

    return get


def _relative(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert sorted(got) == sorted(want)
    num = sum(float((got[k].double() - want[k].double()).norm() ** 2) for k in want)
    den = sum(float(want[k].double().norm() ** 2) for k in want)
    return (num / den) ** 0.5


STRATEGIES = [
    pytest.param("fsdp"),
    pytest.param("hsdp"),
    pytest.param("fsdp_cpu_offload"),
    *(
        pytest.param(
            name,
            marks=[pytest.mark.deepspeed, pytest.mark.skipif(not HAVE_DEEPSPEED, reason="needs deepspeed")],
        )
        for name in (
            "deepspeed_stage_1",
            "deepspeed_stage_2",
            "deepspeed_stage_2_offload",
            "deepspeed_stage_3",
            "deepspeed_stage_3_offload",
        )
    ),
]


@pytest.mark.multiprocess
@pytest.mark.timeout(420)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_user_models_match_one_process(strategy: str, reference: dict, trained) -> None:
    trained = trained(strategy)
    initial = _train_initial_distance(reference)
    for kind in ("net", "gpt"):
        distance = _relative(trained[kind], reference[kind])
        assert distance < TOLERANCE, f"{strategy} {kind}: relative distance {distance:.3g} from one process"
        # The tolerance is far below what training moved the parameters: a run that never trained fails.
        assert initial[kind] > 100 * TOLERANCE


def _train_initial_distance(reference: dict) -> dict[str, float]:
    out = {}
    for kind, build in (("net", script.LM), ("gpt", script.TinyGPT)):
        torch.manual_seed(0)
        module = build()
        module.configure_model()
        out[kind] = _relative({k: v for k, v in module.state_dict().items()}, reference[kind])
    return out
