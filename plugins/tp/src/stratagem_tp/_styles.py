"""Plan entries given by name, turned into torch ``ParallelStyle`` objects for the module they apply to.

The names of this plugin (``colwise``, ``rowwise``, ``sequence_parallel``, ``replicate``) and those Hugging
Face transformers models use in ``base_model_tp_plan`` / ``model.tp_plan`` are accepted. Each name gives a
fresh style per module: torch's ``RowwiseParallel`` changes its own input layout when it meets an embedding.
"""

from __future__ import annotations

import difflib
from typing import Any

import torch
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
)

from stratagem.errors import ConfigurationError

#: Styles that split a weight: they apply to ``nn.Linear`` and ``nn.Embedding`` only (torch's rule).
SPLITTING = {"colwise", "rowwise", "colwise_gather_output", "rowwise_split_input"}

#: The parallel styles a tensor-parallel plan may name: name -> what it does (also quoted by error messages).
STYLE_NAMES = {
    "colwise": "split the output features (weight rows); output stays split on the last dim",
    "rowwise": "split the input features (weight columns); output all-reduced (embedding: split the vocabulary)",
    "colwise_gather_output": "colwise, then all-gather the output (e.g. an untied LM head before the loss)",
    "rowwise_split_input": "rowwise taking a replicated input, which it splits itself",
    "sequence_parallel": "shard activations on the sequence dim around a norm/dropout; parameters replicated",
    "replicate": "leave the module whole on every rank (the default for modules no entry matches)",
}

#: Hugging Face transformers' names (``transformers.distributed.tensor_parallel``) for the same styles.
ALIASES = {
    "colwise_rep": "colwise_gather_output",
    "rowwise_rep": "rowwise_split_input",
    "embedding_rowwise": "rowwise",
    "embedding_colwise": "colwise_gather_output",
    "replicated_with_grad_allreduce": "replicate",
}


def canonical(name: str, where: str) -> str:
    """The plugin's name for ``name`` (an alias resolved); a clear error for an unknown one."""
    key = name.lower() if isinstance(name, str) else name
    if key in STYLE_NAMES:
        return key
    if key in ALIASES:
        return ALIASES[key]
    known = sorted(STYLE_NAMES) + sorted(ALIASES)
    close = difflib.get_close_matches(str(name), known, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ConfigurationError(
        f"tensor-parallel plan entry {where!r}: unknown style {name!r}.{hint} Use one of "
        f"{', '.join(sorted(STYLE_NAMES))} (Hugging Face names {', '.join(sorted(ALIASES))} are accepted too), "
        "or a torch.distributed.tensor.parallel ParallelStyle."
    )


def style_for(name: str, module: torch.nn.Module) -> ParallelStyle | None:
    """A new ``ParallelStyle`` for ``module`` (``None`` for ``replicate``)."""
    embedding = isinstance(module, torch.nn.Embedding)
    match name:
        case "colwise":
            return ColwiseParallel()
        case "rowwise":
            # Token ids are whole on every rank; torch's default input layout (split last dim) is for Linear.
            return RowwiseParallel(input_layouts=Replicate()) if embedding else RowwiseParallel()
        case "colwise_gather_output":
            return ColwiseParallel(output_layouts=Replicate())
        case "rowwise_split_input":
            return RowwiseParallel(input_layouts=Replicate())
        case "sequence_parallel":
            return SequenceParallel()
        case "replicate":
            return None
        case other:
            raise ValueError(f"style {other!r} has no ParallelStyle; use one of {sorted(STYLE_NAMES)}.")


def check_applicable(name: str, module_name: str, module: torch.nn.Module, style: Any) -> None:
    """Refuse a splitting style on a module torch cannot split, before anything is changed."""
    splits = name in SPLITTING or isinstance(style, (ColwiseParallel, RowwiseParallel))
    if splits and not isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
        raise ConfigurationError(
            f"tensor-parallel plan: style {name!r} cannot apply to module {module_name!r} "
            f"({type(module).__name__}): colwise/rowwise split nn.Linear and nn.Embedding weights only. Point the "
            "entry at the Linear layers inside it (e.g. '<name>.fc1'), or give a parallelize(model, mesh) callable."
        )
