"""What a DeepSpeed rank holds: counted from DeepSpeed's own tensors in a run (``memory_held``), and estimated
from the model's shapes by ZeRO's partitioning rules for the plan (``estimate_memory``), since DeepSpeed's engine
cannot be built on the plan's simulated world.

The rules, as DeepSpeed 0.19 applies them (``runtime/zero/stage_1_and_2.py``, ``stage3.py``,
``partition_parameters.py``, ``parameter_offload.py``), for one optimizer parameter group of every trainable
parameter on ``dp`` data-parallel ranks:

- ZeRO 1 and 2 flatten the group into one buffer padded to a multiple of ``2 * dp`` elements, which every rank
  holds whole (the module's parameters are views of it); each rank owns ``1 / dp`` of it: the gradients reduced
  into that partition, an fp32 copy of it (the master weights, kept even at 32-true) and the optimizer's state
  over that copy. With the optimizer offloaded, a copy of the partition in the parameters' dtype too (the
  staging buffer the CPU step writes into).
- ZeRO 3 partitions each parameter on its own: ``ceil(numel / dp)`` elements per rank (padding included).
  Parameters of at most ``stage3_param_persistence_threshold`` elements (DeepSpeed's default 100000) are also
  kept whole on every rank between steps. Gradients are a partition-sized buffer, the fp32 master weights and the
  optimizer's state cover the partition; each sub-group of at most ``sub_group_size`` elements has its own step.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from stratagem.errors import ConfigurationError

#: DeepSpeed 0.19's default for ``stage3_param_persistence_threshold`` (``runtime/zero/config.py``).
PERSISTENCE_THRESHOLD = 100_000
#: DeepSpeed 0.19's default for ``stage3_model_persistence_threshold``.
MODEL_PERSISTENCE_THRESHOLD = 2**63 - 1


def _bytes(tensors: Any) -> int:
    """Bytes of distinct tensors (the same tensor reached twice counts once)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and tensor.numel():
            seen[id(tensor)] = tensor.numel() * tensor.element_size()
    return sum(seen.values())


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in a list, a dict of lists or a tensor, as DeepSpeed keeps its buffers."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def parameter_bytes(module: torch.nn.Module, zero: Any) -> int:
    """The parameters this rank holds: under ZeRO 1 and 2 the storages the module's parameters are views of
    (DeepSpeed's flat buffers, padding included); under ZeRO 3 each parameter's partition and the parameters
    gathered whole at the time; with the optimizer offloaded, the staging copy of the rank's partition."""
    total = 0
    storages: set[int] = set()
    for param in dict.fromkeys(module.parameters()):
        partition = getattr(param, "ds_tensor", None)
        if partition is not None:  # ZeRO 3: the partition, and the whole parameter where it is gathered
            total += partition.numel() * partition.element_size() + param.numel() * param.element_size()
            continue
        storage = param.untyped_storage()
        if storage.data_ptr() not in storages:
            storages.add(storage.data_ptr())
            total += storage.nbytes()
    return total + _bytes(_tensors(getattr(zero, "param_buffer_of_bit16_for_cpu_offload_groups", None)))


def gradient_bytes(module: torch.nn.Module, zero: Any) -> int:
    """The gradients this rank holds after backward: the partitions DeepSpeed reduced them into (``averaged_
    gradients``; with the optimizer offloaded, the fp32 partition's ``.grad``) and any ``.grad`` left on the
    module's parameters."""
    held = _tensors(getattr(zero, "averaged_gradients", None))
    for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):
        held += [t.grad for t in _tensors(getattr(zero, name, None)) if t.grad is not None]
    held += [p.grad for p in module.parameters() if p.grad is not None]
    return _bytes(held)


def optimizer_bytes(zero: Any) -> int:
    """The optimizer's state over this rank's partition and the fp32 master weights it steps."""
    inner = getattr(zero, "optimizer", zero)
    state = [t for per_param in inner.state.values() for t in _tensors(dict(per_param))]
    for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):
        state += _tensors(getattr(zero, name, None))
    return _bytes(state)


# -------------------------------------------------------------------------------------------------
# the estimate from shapes
# -------------------------------------------------------------------------------------------------


def estimate(config: dict[str, Any], model: torch.nn.Module, world: Any) -> Any:
    """The plan's :class:`~stratagem.planning.MemoryEstimate` of rank 0 (every rank holds as much but for the
    padding, which only the last rank's partition can have, and ZeRO pads every partition to the same size)."""
    from stratagem.planning import MemoryEstimate

    if world.precision != "32-true":
        raise ConfigurationError(
            f"DeepSpeed's memory is estimated at 32-true only: at {world.precision} it keeps other copies "
            "(a low-precision module, its own bf16 optimizer) that this estimate does not model."
        )
    zero = config.get("zero_optimization", {})
    stage = int(zero.get("stage", 0))
    if stage not in (1, 2, 3):
        raise ConfigurationError(f"DeepSpeed's memory is estimated for ZeRO stages 1-3, not {stage}.")
    params = list(dict.fromkeys(model.parameters()))
    trainable = [p for p in params if p.requires_grad]
    frozen = sum(p.numel() * 4 for p in params if not p.requires_grad)  # ZeRO 1 and 2 leave them whole
    per_element = _OPTIMIZER_STATE[world.optimizer]
    dp = world.size
    offloaded = "offload_optimizer" in zero
    if stage in (1, 2):
        count = sum(p.numel() for p in trainable)
        flat = math.ceil(count / (2 * dp)) * (2 * dp)
        partition = flat // dp
        parameters = flat * 4 + frozen + (partition * 4 if offloaded else 0)
        gradients = partition * 4
        optimizer = partition * 4 + partition * per_element + _STEP_BYTES[world.optimizer]
        rule = f"ZeRO {stage}: a flat buffer of {flat} elements, a partition of {partition} per rank"
    else:
        # zero.Init partitions every parameter as the model is built; the optimizer covers the trainable ones.
        partitions = [math.ceil(p.numel() / dp) for p in trainable]
        partition = sum(partitions)
        held = sum(math.ceil(p.numel() / dp) for p in params)
        threshold = int(zero.get("stage3_param_persistence_threshold", PERSISTENCE_THRESHOLD))
        persistent = _persistent(params, threshold, zero)
        parameters = held * 4 + persistent * 4
        gradients = partition * 4
        groups = _sub_groups(partitions, int(zero.get("sub_group_size", 1_000_000_000)))
        optimizer = partition * 4 + partition * per_element + groups * _STEP_BYTES[world.optimizer]
        rule = f"ZeRO 3: {partition} elements of partitions per rank, {persistent} kept whole"
    where = " (optimizer state in host memory)" if offloaded else ""
    return MemoryEstimate(
        parameters=parameters,
        gradients=gradients,
        optimizer=optimizer,
        buffers=sum(b.numel() * b.element_size() for b in model.buffers()),
        method=f"DeepSpeed's partitioning rules{where}: {rule}",
        rank=0,
    )


#: Bytes of optimizer state per fp32 element of the partition: AdamW and Adam's two moments, SGD's momentum.
_OPTIMIZER_STATE = {"adamw": 8, "adam": 8, "sgd": 4}
#: torch's Adam and AdamW keep a step count per parameter they step (one flat partition per group): a float32.
_STEP_BYTES = {"adamw": 4, "adam": 4, "sgd": 0}


def _persistent(params: list[torch.nn.Parameter], threshold: int, zero: dict[str, Any]) -> int:
    """Elements of the parameters ZeRO 3 keeps whole: as ``mark_persistent_parameters`` picks them."""
    limit = int(zero.get("stage3_model_persistence_threshold", MODEL_PERSISTENCE_THRESHOLD))
    total = 0
    for param in params:
        if param.numel() + total > limit:
            continue
        if param.numel() <= threshold:
            total += param.numel()
    return total


def _sub_groups(partitions: list[int], size: int) -> int:
    """How many sub-groups ZeRO 3 steps (``_create_fp16_sub_groups``): parameters taken in order until their
    partitions reach ``size`` elements."""
    if size >= sum(partitions):
        return 1
    groups, running = 0, 0
    for index, numel in enumerate(partitions):
        running += numel
        if running >= size or index == len(partitions) - 1:
            groups, running = groups + 1, 0
    return groups
