"""Hugging Face weights under the strategies of one family, in one launch (strategies one after another):

- ``--load``: a tiny Llama built on the meta device, filled from the safetensors folder ``--hf``
  (``Engine.setup(init_weights=...)``), then exported straight back (``save_weights``, to ``OUT/export-NAME``);
  the logits of a fixed batch and the bytes each rank read, wrote and held go to ``OUT/load-NAME-rankR.pt``.
  ``NAME@KEY`` loads from ``--source KEY=WHERE`` instead (a URL, or a folder of more tensors than the model's,
  read with ``strict=False`` when KEY is given to ``--loose``).
- ``--finetune``: 5 steps of ``Trainer(init_weights=..., callbacks=[HFExport])``, then a sharded and a full
  checkpoint (and with ``--s3 URL``, the same sharded checkpoint on S3) and the trained model's logits, in
  ``OUT/ft-NAME/``.

    stratagem run --devices 2 hf_script.py --hf DIR --out OUT --load ddp,fsdp@s3 --source s3=s3://b/llama
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

# Imported before any model is built: under DeepSpeed's zero.Init (which patches tensor construction) the lazy
# import of transformers' modeling code fails.
from transformers import LlamaForCausalLM

import stratagem as sg
from stratagem.callbacks import HFExport
from stratagem.checkpoint.hf import HFWeights, save_weights

STEPS = 5
BATCH = 4


def llama_config(hidden: int = 32, layers: int = 4, vocab: int = 64) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=False,
        use_cache=False,
        attn_implementation="eager",
    )


def tokens(seed: int = 1, n: int = 4) -> torch.Tensor:
    return torch.randint(0, 64, (n, 9), generator=torch.Generator().manual_seed(seed))


def llama_module(config: Any) -> Any:
    """Hugging Face's Llama as a stratagem Module (its names are the checkpoint's): logits out, a loss in."""

    class LlamaLM(LlamaForCausalLM, sg.Module):
        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            return super().forward(input_ids=input_ids).logits

        def compute_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=3e-3)

        def configure_model(self) -> None:  # built in __init__; nothing more
            return None

    return LlamaLM(config)


def _strategy(name: str) -> Any:
    """The strategy of ``name``; ``fsdp_tp`` as a 2 x 2 mesh (its default tensor-parallel size is the world's,
    which the tiny Llama's two key-value heads do not divide at 4 processes)."""
    if name == "fsdp_tp":
        from stratagem_tp import FSDPTPStrategy

        return FSDPTPStrategy(tensor_parallel_size=2)
    if name == "hsdp":  # 2 replicas of 2 shards (on one node its default mesh is 1 x N, plain fsdp)
        from stratagem_fsdp import FSDPStrategy

        return FSDPStrategy(sharding_strategy="HYBRID_SHARD", replicate_size=2, shard_size=2)
    return name


def _logits(engine: Any, model: Any, batch: torch.Tensor) -> torch.Tensor | None:
    with torch.no_grad():
        out = engine.eval_batch(model, (batch,)).outputs
    return None if out is None else out.detach().float().cpu()


def load(strategy: str, devices: int, hf: str, out: Path, weights: Any) -> None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(hf)
    engine = sg.Engine(strategy=_strategy(strategy), accelerator="cpu", devices=devices)
    with engine.init_module(empty_init=True):
        module = llama_module(config)
    model = engine.setup(module, init_weights=weights)
    report = module.__dict__["_stratagem_hf_report"]
    logits = _logits(engine, model, tokens()[:, :-1])
    # Straight back out from the shards: each part written once, by one rank that holds it.
    export = save_weights(engine, model, out / f"export-{strategy}", max_shard_size="40KB")
    torch.save(
        {
            "logits": logits,
            "report": report,
            "written": export["bytes_written"],
            "held": export["peak_bytes"],
            "source": module.__dict__["_stratagem_hf"]["source"],  # where the load found the files
        },
        out / f"load-{strategy}-rank{engine.rank}.pt",
    )
    engine.barrier()
    engine.teardown()


def finetune(strategy: str, devices: int, hf: str, out: Path, s3: str | None) -> None:
    from transformers import AutoConfig

    where = out / f"ft-{strategy}"
    data = tokens(seed=7, n=STEPS * BATCH * 2)
    loader = DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=BATCH)
    trainer = sg.Trainer(
        strategy=_strategy(strategy),
        accelerator="cpu",
        devices=devices,
        max_steps=STEPS,
        default_root_dir=where / "run",
        enable_progress_bar=False,
        seed=0,
        init_weights=hf,
        callbacks=[HFExport(where / "hf")],
        loggers=[],
    )
    with trainer.init_module(empty_init=True):  # on the meta device: each rank allocates its part only
        module = llama_module(AutoConfig.from_pretrained(hf))
    trainer.fit(module, loader)
    trainer.save_checkpoint(where / "sharded", format="sharded")
    trainer.save_checkpoint(where / "full.ckpt", format="full")
    if s3:
        trainer.save_checkpoint(f"{s3}/{strategy}/sharded", format="sharded")
    logits = _logits(trainer.engine, trainer.model, tokens()[:, :-1])
    if logits is not None:
        torch.save(logits, where / f"logits-rank{trainer.engine.rank}.pt")
    trainer.engine.barrier()
    trainer.engine.teardown()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hf", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--devices", type=int, default=int(os.environ.get("WORLD_SIZE", "1")))
    p.add_argument("--load", default="")
    p.add_argument("--finetune", default="")
    p.add_argument("--s3", default=None)
    p.add_argument("--source", action="append", default=[], help="KEY=WHERE, for --load NAME@KEY")
    p.add_argument("--loose", action="append", default=[], help="a KEY of --source read with strict=False")
    args = p.parse_args()
    out = Path(args.out)
    sources = dict(item.split("=", 1) for item in args.source)
    for spec in filter(None, args.load.split(",")):
        strategy, _, key = spec.partition("@")
        weights: Any = sources[key] if key else args.hf
        if key in args.loose:
            weights = HFWeights(weights, strict=False)
        load(strategy, args.devices, args.hf, out, weights)
    for strategy in filter(None, args.finetune.split(",")):
        finetune(strategy, args.devices, args.hf, out, args.s3)


if __name__ == "__main__":
    main()
