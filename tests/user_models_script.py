"""Two models as users write them, trained by the Trainer under the strategy on the command line; each
ends with a full checkpoint that the tests compare with the one-process run.

- ``net``: the README's example, whose ``training_step`` calls ``self.net(x)`` (never ``self(x)``).
- ``gpt``: a Hugging Face ``GPT2LMHeadModel`` from a tiny config (no download), held as ``self.gpt`` and
  called from ``training_step``; its embeddings and head sit at the root, outside any block.

    python user_models_script.py --strategy single_device --devices 1 --out DIR
    stratagem run --devices 2 user_models_script.py --strategy fsdp,hsdp --devices 2 --out DIR

or, from Python, :func:`train` in each worker of a launch (what tests/test_user_models.py does).

Several strategies (comma-separated) train one after the other in the same processes, each in ``DIR/NAME``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

import stratagem as sg

STEPS = 5
PER_RANK_BATCH = 4


class LM(sg.Module):
    """The README's "For users" model."""

    def configure_model(self):
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.GELU(), torch.nn.Linear(256, 32))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class TinyGPT(sg.Module):
    def __init__(self) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            n_layer=2,
            n_embd=32,
            n_head=2,
            vocab_size=64,
            n_positions=16,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        self.gpt = GPT2LMHeadModel(config)

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        return self.gpt(input_ids=tokens, labels=tokens).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.01)


def data(kind: str) -> TensorDataset:
    g = torch.Generator().manual_seed(11)
    n = 8 * STEPS * PER_RANK_BATCH
    if kind == "net":
        x = torch.randn(n, 32, generator=g)
        return TensorDataset(x, torch.sin(x))
    return TensorDataset(torch.randint(0, 64, (n, 16), generator=g))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", required=True, help="a strategy name, or several separated by commas")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    train(args.strategy.split(","), args.devices, args.out)


def train(strategies: list[str], devices: int, out_dir: str) -> None:
    """What the script does in each process: both models under each strategy in turn (the tests call it in
    workers that a launch forked, as ``stratagem run`` would start them, without a new interpreter each)."""
    torch.use_deterministic_algorithms(True)
    batch = PER_RANK_BATCH * (2 if devices == 1 else 1)  # the one-process run takes the global batch
    for strategy in strategies:
        out = Path(out_dir) / strategy
        for kind, build in (("net", LM), ("gpt", TinyGPT)):
            torch.manual_seed(0)
            trainer = sg.Trainer(
                strategy=strategy,
                accelerator="cpu",
                devices=devices,
                max_steps=STEPS,
                default_root_dir=out / kind,
                enable_progress_bar=False,
                seed=0,
            )
            trainer.fit(build(), DataLoader(data(kind), batch_size=batch))
            trainer.save_checkpoint(out / f"{kind}.ckpt", format="full")


if __name__ == "__main__":
    main()
