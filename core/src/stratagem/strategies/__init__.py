"""Strategy base classes, and the strategy author's kit. Plugins subclass :class:`Strategy` (one process) or
:class:`TorchDistributedStrategy` (process group, collectives and checkpoints over ``torch.distributed``).

The kit, for what the base classes leave to a strategy:

- compile: :class:`Compiler` (what ``wrap_model`` receives), :class:`CompileOptions`, :func:`compile_regions`
  and :func:`region_names` for a strategy that compiles pieces of its own;
- manual wrapping: :func:`wrapping_with` (what ``model_sharded_context`` returns) and :func:`has_meta_tensors`;
- precision: :func:`param_dtype` and :func:`default_dtype` for ``*-true`` precisions;
- a strategy that runs the step itself: :class:`StepOutput` and :func:`as_inputs`.

Importing this package imports none of them, nor torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from stratagem.registry._lazy import lazy_getattr

__all__ = [
    "CompileOptions",
    "Compiler",
    "SingleDeviceStrategy",
    "StepOutput",
    "Strategy",
    "TorchDistributedStrategy",
    "as_inputs",
    "compile_regions",
    "default_dtype",
    "has_meta_tensors",
    "param_dtype",
    "region_names",
    "wrapping_with",
]

if TYPE_CHECKING:
    from stratagem.strategies.base import Strategy
    from stratagem.strategies.compiling import CompileOptions, Compiler, compile_regions, region_names
    from stratagem.strategies.precision import default_dtype, param_dtype
    from stratagem.strategies.single_device import SingleDeviceStrategy
    from stratagem.strategies.step import StepOutput, as_inputs
    from stratagem.strategies.torch_distributed import TorchDistributedStrategy
    from stratagem.strategies.wrapping import has_meta_tensors, wrapping_with

_LAZY = {
    "Strategy": "stratagem.strategies.base",
    "TorchDistributedStrategy": "stratagem.strategies.torch_distributed",
    "SingleDeviceStrategy": "stratagem.strategies.single_device",
    "StepOutput": "stratagem.strategies.step",
    "as_inputs": "stratagem.strategies.step",
    "CompileOptions": "stratagem.strategies.compiling",
    "Compiler": "stratagem.strategies.compiling",
    "compile_regions": "stratagem.strategies.compiling",
    "region_names": "stratagem.strategies.compiling",
    "param_dtype": "stratagem.strategies.precision",
    "default_dtype": "stratagem.strategies.precision",
    "has_meta_tensors": "stratagem.strategies.wrapping",
    "wrapping_with": "stratagem.strategies.wrapping",
}


__getattr__ = lazy_getattr(__name__, _LAZY, globals())
