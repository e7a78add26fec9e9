"""What the tests of stratagem-ft share: a launch of ``ft_train.py`` in a subprocess under a timeout, what they
read from it, the data each replica takes at each step (for the references written out by hand), and the same
job under stratagem's ``ddp`` (the reference the acceptance names)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

TRAIN = str(Path(__file__).resolve().parent / "ft_train.py")


def start(out: Path, *args: str) -> subprocess.Popen[str]:
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "RUST_LOG": "warn", "PYTHONWARNINGS": "ignore"}
    return subprocess.Popen(
        [sys.executable, TRAIN, *args, "--out", str(out)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        # A session of its own: a launch past its timeout is ended with every process it started.
        start_new_session=True,
    )


def finish(run: subprocess.Popen[str], timeout: float) -> str:
    try:
        output, _ = run.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(run.pid, signal.SIGKILL)
        output, _ = run.communicate()
        pytest.fail(f"the launch did not end within {timeout} s:\n{output[-4000:]}")
    assert run.returncode == 0, output[-4000:]
    return output


def rows(out: Path, group: int) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / f"group-{group}.jsonl").read_text().splitlines()]


def initial_params() -> dict[str, torch.Tensor]:
    import ft_train

    torch.manual_seed(0)
    return {k: v.detach().clone() for k, v in ft_train.Regression().state_dict().items()}


def full_loss(params: dict[str, torch.Tensor]) -> float:
    import ft_train

    model = ft_train.Regression()
    model.load_state_dict(params)
    x, y = ft_train.dataset().tensors
    with torch.no_grad():
        return torch.nn.functional.mse_loss(model(x), y).item()


def replica_batch(
    replica: int, step: int, replicas: int = 2, batch: int = 4
) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch that the process of global rank ``replica`` (of ``replicas``, one per group) trains on at
    ``step`` (from 0): the Trainer's data order, one permutation of the data set per epoch from seed 0, dealt
    round-robin to the ranks, ``batch`` samples each."""
    import ft_train

    x, y = ft_train.dataset().tensors
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    index = order[replica::replicas][step * batch : (step + 1) * batch]
    return x[index], y[index]


def data_parallel_reference(steps: int, replicas: int = 2, batch: int = 4) -> dict[str, torch.Tensor]:
    """Data-parallel training by hand, in this process: one model, each step's gradient the mean of the
    ``replicas`` ranks' batch gradients (what ``ddp`` over as many processes computes), ``steps`` steps of the
    worker's SGD."""
    import ft_train

    torch.manual_seed(0)
    model = ft_train.Regression()
    optimizer = torch.optim.SGD(model.parameters(), lr=model.lr, momentum=0.9)
    for step in range(steps):
        optimizer.zero_grad()
        for rank in range(replicas):
            x, y = replica_batch(rank, step, replicas, batch)
            (torch.nn.functional.mse_loss(model(x), y) / replicas).backward()
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def ddp_run(engine: Any, steps: int) -> dict[str, torch.Tensor]:
    """In each worker of an ``Engine(strategy="ddp")`` launch: ``ft_train.py``'s job for ``steps`` steps through
    the Engine (torch's DistributedDataParallel and its bucketed all-reduce), each rank on the batches that the
    process of the same global rank takes under the Trainer. Returns the final parameters."""
    import ft_train

    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    module = ft_train.Regression()
    model, optimizer = engine.setup(module, module.configure_optimizers())
    for step in range(steps):
        x, y = replica_batch(engine.rank, step, engine.world_size)
        with engine.forward_context():
            loss = torch.nn.functional.mse_loss(model(x), y)
        engine.backward(loss, model)
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach().clone() for k, v in module.state_dict().items()}
