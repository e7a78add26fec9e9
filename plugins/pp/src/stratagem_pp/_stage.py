"""Building the stages of one rank from the user's model, keeping every parameter's name.

Two objects come out of :func:`build`:

- the *holder*: the user's model itself, with every module that this rank's stages do not own replaced in place by
  :class:`Skipped`. Its ``named_parameters()`` are exactly this rank's parameters under their names in the
  whole model, so optimizers, state dicts and checkpoints need no renaming and do not depend on the pipeline
  degree. Nothing is copied: the modules a rank owns stay the user's objects.
- one *view* per local stage: a shallow copy of the model's skeleton (the root and the modules on the way to
  the stage's modules), sharing the stage's modules with the holder, with every other module a ``Skipped``.
  Calling a view runs the model's own ``forward`` over that stage only. The strategy shards and compiles views;
  the holder sees the same parameters.

Blocks of other stages are removed from their container (its other entries keep their names), so a forward that
loops over the container (``for block in self.blocks``) runs this stage's blocks; index the container by
position and it fails. Other modules of other stages become :class:`Skipped`, which returns its first argument:
a forward written as a chain (``x = self.embed(x)``, ..., ``self.head(x)``) runs a stage unchanged, the
embedding of a later stage passing the hidden states through and a removed head returning them to the next
stage. ``Skipped`` is falsy, so a forward may test ``if self.pos_embed:`` for modules that do not chain.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch

from stratagem.errors import ConfigurationError
from stratagem_pp._split import Split


class Skipped(torch.nn.Module):
    """Stands where another stage's module was: no parameters; returns its first argument."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.skipped_name = name

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if args:
            return args[0]
        return next(iter(kwargs.values()), None)

    def __bool__(self) -> bool:
        return False

    def extra_repr(self) -> str:
        return f"{self.skipped_name!r} runs on another stage"


def ancestors(names: Iterable[str]) -> set[str]:
    """Every proper prefix of the dotted ``names`` (the root is ``""``)."""
    found = {""}
    for name in names:
        parts = name.split(".")
        found.update(".".join(parts[:i]) for i in range(1, len(parts)))
    return found


def _has_params(module: torch.nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _shallow(module: torch.nn.Module) -> torch.nn.Module:
    """A new module object sharing parameters, children and attributes, with its own registries (children,
    hooks), so that replacing a child or registering a hook on it leaves ``module`` alone."""
    clone = copy.copy(module)
    for key, value in list(vars(clone).items()):
        if isinstance(value, (dict, set)):
            clone.__dict__[key] = copy.copy(value)
    return clone


@attrs.frozen
class _Cut:
    keep: set[str]  # the stage's modules
    above: set[str]  # the modules on the way to them
    placed: set[str]  # every stage's modules
    containers: set[str]  # the block containers


def _carve(module: torch.nn.Module, cut: _Cut, prefix: str, in_place: bool) -> torch.nn.Module:
    """``module`` with what another stage owns taken out; modules on the way are copied (a view) or changed in
    place (the holder). Blocks of other stages leave their container, so that a loop over it runs this
    stage's blocks only (and whatever the loop does around each); other modules become ``Skipped``. A module
    without parameters that no stage owns (a rotary embedding) is shared by every stage."""
    target = module if in_place else _shallow(module)
    in_container = prefix.removesuffix(".") in cut.containers
    for name, child in list(module._modules.items()):
        if child is None:
            continue
        full = prefix + name
        if full in cut.keep:
            target._modules[name] = child
        elif full in cut.above:
            target._modules[name] = _carve(child, cut, full + ".", in_place)
        elif in_container and full in cut.placed:
            del target._modules[name]
        elif _has_params(child) or full in cut.placed:
            target._modules[name] = Skipped(full)
    return target


def build(
    model: torch.nn.Module, split: Split, local: list[int]
) -> tuple[torch.nn.Module, list[torch.nn.Module]]:
    """``(holder, views)`` for the stages ``local`` of this rank (see the module docstring)."""
    placed = {name for stage in split.stages for name in stage}
    containers = {b.rsplit(".", 1)[0] if "." in b else "" for b in split.blocks}

    def cut(keep: set[str]) -> _Cut:
        # A block container (and the modules on the way to it) stays a container even on a stage holding none
        # of its blocks (a stage of the embedding alone): the forward's loop over it then runs no block.
        above = ancestors(keep) | {c for c in containers if c} | ancestors(containers)
        return _Cut(keep=keep, above=above, placed=placed, containers=containers)

    views = []
    for index in local:
        view = _carve(model, cut(set(split.stages[index])), "", in_place=False)
        _return_tensors(view)
        views.append(view)
    holder = _carve(model, cut({n for index in local for n in split.stages[index]}), "", in_place=True)
    return holder, views


# -------------------------------------------------------------------------------------------------
# what a stage returns
# -------------------------------------------------------------------------------------------------


def tensor_outputs(output: Any) -> Any:
    """A stage sends tensors to the next: a dict-like output (a Hugging Face ``ModelOutput``) or a tuple with
    other values gives its tensors, a single one as itself."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping):
        values = [v for v in output.values() if isinstance(v, torch.Tensor)]
    elif isinstance(output, (tuple, list)):
        values = [v for v in output if isinstance(v, torch.Tensor)]
    else:
        values = []
    if not values:
        raise ConfigurationError(
            f"a pipeline stage returned {type(output).__name__} without tensors; the model's forward must return "
            "a tensor, a tuple of tensors or a dict of them (stages pass tensors to each other)."
        )
    return values[0] if len(values) == 1 else tuple(values)


def _return_tensors(view: torch.nn.Module) -> None:
    # A hook on the view only (the user's model keeps its forward), and one that survives the view's forward
    # being compiled in place (compile=, when a stage is compiled whole).
    view.register_forward_hook(lambda module, args, output: tensor_outputs(output))
