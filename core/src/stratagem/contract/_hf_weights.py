"""The contract's Hugging Face section (phase two, in the launch that loads checkpoints): a model filled from
safetensors as it is set up (``Engine.setup(init_weights=...)``), then exported from its sharded state
(``save_weights``). The safetensors are the ``single_device`` checkpoint's weights, exported offline;
a strategy passes when it loads exactly those weights and its export is the same bytes. A strategy needs
nothing for it beyond its sharded state dict (or its own ``weight_shards`` hook)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from stratagem.contract import _suite_model as m
from stratagem.contract._training import observed_params, saved_full

#: Small enough that the contract model's weights span several files.
MAX_SHARD_SIZE = 4096
SEED = 7


def hf_weights(engine: Any, spec: dict[str, Any]) -> dict[str, Any]:
    from stratagem.checkpoint.hf import export_checkpoint, save_weights

    work = Path(spec["workdir"])
    source, output = work / "hf-in", work / "hf-out"
    if engine.rank == 0:
        export_checkpoint(
            spec["single_device_checkpoint"], source, max_shard_size=MAX_SHARD_SIZE, overwrite=True
        )
    engine.barrier("stratagem-contract-hf-in")
    # Built as the strategy builds any model (another seed: the load must overwrite it), not on the meta device:
    # materialising a meta model is not part of the contract (tests/test_hf_weights.py covers it in this
    # repository's strategies).
    with engine.init_module():
        model = m.build_model(SEED)
    optimizer = torch.optim.AdamW(model.parameters(), lr=m.LEARNING_RATE)
    model, optimizer = engine.setup(model, optimizer, init_weights=str(source))
    out: dict[str, Any] = {"params": observed_params(model), "full": None}
    if out["params"] is None and "full" in spec["formats"]:
        out["full"] = saved_full(engine, {"model": model, "optimizer": optimizer}, str(work / "hf-loaded.pt"))
    save_weights(engine, model, output, max_shard_size=MAX_SHARD_SIZE, overwrite=True)
    if engine.rank == 0:
        names = sorted(p.name for p in source.iterdir())
        out["files"] = names
        out["differs"] = [
            n
            for n in names
            if not (output / n).is_file() or (output / n).read_bytes() != (source / n).read_bytes()
        ]
        out["extra"] = sorted({p.name for p in output.iterdir()} - set(names))
    return out
