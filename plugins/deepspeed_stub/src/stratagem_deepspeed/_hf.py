"""What each rank holds of a DeepSpeed model, for Hugging Face weights (the ``weight_shards`` hook).

Under ZeRO-3 a parameter's own data is empty: the rank keeps ``ds_tensor``, elements
``rank * partition : (rank + 1) * partition`` of the parameter flattened (the last rank's padded). That range
is one run of bytes in a safetensors file, so a load reads just it and an export writes just it: no gather.
Buffers, and every parameter under stages 1 and 2, are whole on every rank (as under DDP).

A load writes the module's parameters only; DeepSpeed's fp32 master copies are made from them when its engine
is built (``setup_optimizers``), so loading after that is refused rather than left half done.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from stratagem.checkpoint.hf import WeightShard
from stratagem.errors import ConfigurationError
from stratagem_deepspeed._wrappers import _wrapper


def _partition(name: str, param: Any) -> WeightShard:
    part = param.ds_tensor
    # DeepSpeed marks a partition on NVMe with OffloadDeviceEnum.nvme (a str enum) and, under CPU offload of the
    # optimizer, others with the string 'not-nvme': equality, not a suffix.
    if getattr(part, "final_location", None) == "nvme":
        raise ConfigurationError(
            f"{name}: its ZeRO-3 partition lives on NVMe, which Hugging Face weights are not read into or "
            "written from; load or export without offload_params_device='nvme'."
        )
    group = getattr(param, "ds_process_group", None)
    rank = dist.get_rank(group=group) if dist.is_initialized() else 0
    numel = int(param.ds_numel)
    start = min(int(part.ds_numel) * rank, numel)
    held = max(0, min(int(part.ds_numel), numel - start))
    return WeightShard(name, tuple(param.ds_shape), part.data.narrow(0, 0, held), flat_start=start)


def weight_shards(model: torch.nn.Module, purpose: str) -> list[WeightShard]:
    wrapper = _wrapper(model)
    if purpose == "load" and wrapper.__dict__["engine"] is not None:
        raise ConfigurationError(
            "Hugging Face weights load into a DeepSpeed model before its optimizers are set up "
            "(Engine.setup(model, optimizer, init_weights=...), Trainer(init_weights=...)): DeepSpeed's engine "
            "keeps master copies that writing the parameters afterwards would not reach."
        )
    shards = []
    for name, value in wrapper.module.state_dict(keep_vars=True).items():
        if not isinstance(value, torch.Tensor):
            continue
        if getattr(value, "ds_tensor", None) is not None:
            shards.append(_partition(name, value))
        else:
            data = value.data
            shards.append(WeightShard(name, tuple(data.shape), data, offsets=(0,) * data.dim()))
    return shards
