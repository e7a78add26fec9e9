"""Where a model splits into pipeline stages, as module names per stage; checked before anything is built.

The plan is looked for in this order:

1. the strategy's ``pp_plan=`` option;
2. the model's ``pp_plan`` attribute in the same forms;
3. a Hugging Face plan: a dict-valued ``pp_plan`` attribute (transformers models merge their head's entry into
   ``config.base_model_pp_plan``), or ``config.base_model_pp_plan`` itself. It names the model's top-level
   pieces in order (``embed_tokens``, ``layers``, ``norm``, ``lm_head``); the one that is a ``ModuleList``
   holds the blocks, which are split evenly;
4. an even split of the model's repeated blocks (the ``ModuleList``, ``ModuleDict`` or ``Sequential`` whose
   same-class children hold the most parameters) by parameter count.

A plan is either the names of the modules where each stage begins (``["blocks.4"]`` for two stages: the first
stage begins at the model's first piece, so that entry may be left out) or one list of module names per stage;
or a callable that takes the number of stages and returns one of those (a model's ``pp_plan`` method), for a
model that says how it splits at any pipeline degree.
A *piece* is a child of the block container, or a module outside it that does not contain it and has
parameters or no state at all (an activation, a dropout); pieces run in the order the model registers them.
Modules with buffers but no parameters (a rotary embedding) are helpers that every stage keeps. The modules before the first block go to the first stage,
those after the last block to the last.
"""

from __future__ import annotations

import difflib
import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch

from stratagem.errors import ConfigurationError

_CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.Sequential)


@attrs.frozen
class Split:
    """Each stage's modules (their whole subtrees), where the plan came from, and the repeated blocks."""

    source: str  # "option", "model.pp_plan", "hf", "even"
    stages: tuple[tuple[str, ...], ...]
    blocks: tuple[str, ...] = ()

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def describe(self) -> list[str]:
        return [f"stage {i}: {', '.join(names)}" for i, names in enumerate(self.stages)]


# -------------------------------------------------------------------------------------------------
# the model's structure
# -------------------------------------------------------------------------------------------------


def _own_params(module: torch.nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False))


def _has_params(module: torch.nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _runs_in_order(module: torch.nn.Module) -> bool:
    """Whether a module is a step of the model's chain, owned by one stage. A module with buffers but no
    parameters (a rotary embedding's frequencies) is rather a helper every stage calls: it is shared."""
    return _has_params(module) or not any(True for _ in module.buffers())


def inside(name: str, outer: str) -> bool:
    return outer == "" or name == outer or name.startswith(outer + ".")


def find_blocks(model: torch.nn.Module) -> tuple[str | None, tuple[str, ...]]:
    """``(container, block names)``: the container whose repeated same-class children hold the most parameters."""
    best: tuple[int, str | None, tuple[str, ...]] = (0, None, ())
    for name, module in model.named_modules():
        if not isinstance(module, _CONTAINERS):
            continue
        by_class: dict[type, list[str]] = {}
        for child_name, child in module.named_children():
            if _has_params(child):
                by_class.setdefault(type(child), []).append(child_name)
        for names in by_class.values():
            if len(names) < 2:
                continue
            size = sum(sum(p.numel() for p in module.get_submodule(n).parameters()) for n in names)
            if size > best[0]:
                prefix = f"{name}." if name else ""
                best = (size, name, tuple(prefix + n for n in names))
    return best[1], best[2]


#: A ``stratagem.Module``'s loss (``loss_fn``) may be a module: it is no step of the forward chain, and the last
#: stage calls it, so every stage keeps it.
LOSS_MODULE = "loss_fn"


def pieces(model: torch.nn.Module, container: str | None) -> list[str]:
    """The model's pieces in registration order (see the module docstring)."""
    found: list[str] = []

    def walk(module: torch.nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            full = prefix + name
            if full == LOSS_MODULE:
                continue
            if container is not None and full == container:
                found.extend(f"{full}.{n}" for n, _ in child.named_children())
            elif container is not None and inside(container, full):
                walk(child, full + ".")
            elif _runs_in_order(child):
                found.append(full)

    walk(model, "")
    return found


# -------------------------------------------------------------------------------------------------
# finding and resolving the plan
# -------------------------------------------------------------------------------------------------


def form_problem(plan: Any) -> str | None:
    """What is wrong with the form of a (non-callable) plan, or ``None``. Names are checked against the model
    in :func:`resolve`."""
    forms = (
        "give a list of the module names where each stage begins (['blocks.4']), one list of module names per "
        "stage ([['embed', 'blocks.0', ...], [..., 'head']]), or a callable taking the number of stages and "
        "returning one of those."
    )
    if isinstance(plan, (str, Mapping)) or not isinstance(plan, (list, tuple)) or not plan:
        return forms
    flat = all(isinstance(v, str) for v in plan)
    nested = all(isinstance(v, (list, tuple)) and v and all(isinstance(n, str) for n in v) for v in plan)
    return None if flat or nested else forms


def _called(plan: Any, num_stages: int, source: str) -> Any:
    """A callable plan's answer for ``num_stages`` stages, checked like a plan given as such."""
    if not callable(plan) or isinstance(plan, Mapping):
        return plan
    answer = plan(num_stages)
    problem = form_problem(answer)
    if problem:
        raise ConfigurationError(
            f"pp_plan from {source} returned {answer!r} for {num_stages} stages: {problem}"
        )
    return answer


def find(option: Any, model: torch.nn.Module, num_stages: int = 2) -> tuple[str, Any]:
    """``(source, plan)`` in the documented order of precedence; ``("even", None)`` without any plan. A callable
    plan is called with ``num_stages``."""
    if option is not None:
        return "option", _called(option, num_stages, "option")
    attribute = _called(getattr(model, "pp_plan", None), num_stages, "model.pp_plan")
    if isinstance(attribute, Mapping) and attribute:
        return "hf", dict(attribute)
    if isinstance(attribute, (list, tuple)) and attribute:
        return "model.pp_plan", attribute
    config_plan = getattr(getattr(model, "config", None), "base_model_pp_plan", None)
    if isinstance(config_plan, Mapping) and config_plan:
        prefix = getattr(model, "base_model_prefix", "")
        if prefix and isinstance(getattr(model, prefix, None), torch.nn.Module):
            return "hf", {f"{prefix}.{k}": v for k, v in config_plan.items()}
        return "hf", dict(config_plan)
    return "even", None


def resolve(option: Any, model: torch.nn.Module, num_stages: int) -> Split:
    """The split of ``model`` into ``num_stages`` stages; every error says what to give instead."""
    source, plan = find(option, model, num_stages)
    names = dict(model.named_modules())
    container, blocks = find_blocks(model)
    if source == "hf":
        stages, blocks = _from_hf(plan, model, names, num_stages)
    elif plan is None:
        if container is None:
            raise ConfigurationError(_unsplittable(model))
        stages = _by_blocks(pieces(model, container), list(blocks), model, num_stages)
    elif all(isinstance(p, str) for p in plan):
        stages = _from_beginnings(list(plan), pieces(model, container), names, source, num_stages)
    else:
        stages = [list(stage) for stage in plan]
        _check_names([n for stage in stages for n in stage], names, source)
        _check_count(len(stages), num_stages, source)
    split = Split(source=source, stages=tuple(tuple(s) for s in stages), blocks=tuple(blocks))
    check(split, model)
    return split


def _from_hf(
    plan: Mapping[str, Any], model: torch.nn.Module, names: dict[str, Any], num_stages: int
) -> tuple[list[list[str]], list[str]]:
    _check_names(list(plan), names, "Hugging Face's pp_plan")
    order = {name: i for i, name in enumerate(names)}
    keys = sorted(plan, key=order.__getitem__)
    # Modules with parameters that the plan does not mention run where they are registered.
    for name, module in model.named_modules():
        covered = any(inside(name, k) or inside(k, name) for k in keys)
        if name and not covered and _runs_in_order(module):
            keys.append(name)
    keys.sort(key=order.__getitem__)
    keys = [k for k in keys if not any(k != o and inside(k, o) for o in keys)]
    lists = [k for k in keys if isinstance(names[k], _CONTAINERS)]
    if len(lists) != 1:
        raise ConfigurationError(
            f"Hugging Face's pp_plan {list(plan)} names {len(lists)} module lists ({lists}); one list of "
            "layers is needed to split. Give pp_plan= with the module names where each stage begins."
        )
    expanded: list[str] = []
    for key in keys:
        if key == lists[0]:
            expanded.extend(f"{key}.{n}" for n, _ in names[key].named_children())
        else:
            expanded.append(key)
    blocks = [f"{lists[0]}.{n}" for n, _ in names[lists[0]].named_children()]
    return _by_blocks(expanded, blocks, model, num_stages), blocks


def _by_blocks(
    ordered: list[str], blocks: list[str], model: torch.nn.Module, num_stages: int
) -> list[list[str]]:
    """The blocks cut into ``num_stages`` contiguous runs of balanced parameter counts; the other pieces go
    with the block before them (with the first stage when they come first)."""
    if num_stages > len(blocks):
        container = blocks[0].rsplit(".", 1)[0] if blocks else "?"
        raise ConfigurationError(
            f"{num_stages} pipeline stages (pipeline_parallel_size x stages_per_rank) but the model has "
            f"{len(blocks)} blocks in {container!r}: each stage needs at least one. Use at most {len(blocks)} "
            "stages, or give pp_plan= with one list of module names per stage."
        )
    counts = [sum(p.numel() for p in model.get_submodule(b).parameters()) for b in blocks]
    starts = even_starts(counts, num_stages)
    stage_of = {b: sum(1 for s in starts if s <= i) - 1 for i, b in enumerate(blocks)}
    stages: list[list[str]] = [[] for _ in range(num_stages)]
    current = 0
    for piece in ordered:
        current = stage_of.get(piece, current)
        stages[current].append(piece)
    return stages


def even_starts(counts: list[int], parts: int) -> list[int]:
    """Start indices of ``parts`` contiguous runs of ``counts`` whose largest sum is as small as can be."""
    n = len(counts)
    prefix = [0]
    for c in counts:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: the smallest largest-sum cutting the first i counts into k runs.
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, n + 1):
            best[k][i] = min(max(best[k - 1][j], prefix[i] - prefix[j]) for j in range(k - 1, i))
    bound = best[parts][n]
    starts, total, left = [0], 0, parts - 1
    for i, c in enumerate(counts):
        # Close the run when this count would exceed the bound, or when the rest only just suffice.
        if i > 0 and left and (total + c > bound or n - i == left):
            starts.append(i)
            total, left = 0, left - 1
        total += c
    return starts


def _from_beginnings(
    plan: list[str], ordered: list[str], names: dict[str, Any], source: str, num_stages: int
) -> list[list[str]]:
    _check_names(plan, names, source)
    if ordered and plan[0] != ordered[0]:
        plan = [ordered[0], *plan]
    not_pieces = [n for n in plan if n not in ordered]
    if not_pieces:
        raise ConfigurationError(
            f"pp_plan from {source}: stages begin at whole pieces of the model, and {not_pieces} are not pieces. "
            f"The pieces, in order: {', '.join(ordered)}. Or give one list of module names per stage."
        )
    positions = [ordered.index(n) for n in plan]
    if positions != sorted(set(positions)):
        raise ConfigurationError(
            f"pp_plan from {source}: {plan} are not in the model's order ({', '.join(ordered)}); name each "
            "stage's first module once, in order."
        )
    _check_count(len(plan), num_stages, source)
    bounds = [*positions, len(ordered)]
    return [ordered[a:b] for a, b in itertools.pairwise(bounds)]


# -------------------------------------------------------------------------------------------------
# checks
# -------------------------------------------------------------------------------------------------


def check(split: Split, model: torch.nn.Module) -> None:
    """Every parameter in exactly one stage, no stage empty, no weight shared between stages."""
    owner: dict[str, int] = {}
    for index, names in enumerate(split.stages):
        if not names:
            raise ConfigurationError(f"pp_plan from {split.source}: stage {index} has no module.")
        for name in names:
            clash = [o for o in owner if inside(name, o) or inside(o, name)]
            if clash and owner[clash[0]] != index:
                raise ConfigurationError(
                    f"pp_plan from {split.source}: {name!r} (stage {index}) overlaps {clash[0]!r} (stage "
                    f"{owner[clash[0]]}); each module belongs to one stage."
                )
            owner[name] = index
    uncovered, holders = [], {}
    for name, module in model.named_modules():
        if not _own_params(module):
            continue
        stages = {i for o, i in owner.items() if inside(name, o)}
        if not stages:
            uncovered.append(name or "<the model itself>")
        for pname, param in module.named_parameters(recurse=False):
            holders.setdefault(id(param), []).append((f"{name}.{pname}" if name else pname, stages))
    if uncovered:
        raise ConfigurationError(
            f"pp_plan from {split.source}: the modules {_outermost(uncovered, model)} hold parameters but belong to no stage. Name "
            "them in a stage (a parameter of the model itself must move into a submodule to be split)."
        )
    for users in holders.values():
        stages = set().union(*(s for _, s in users))
        if len(stages) > 1:
            raise ConfigurationError(
                f"the parameter shared by {[n for n, _ in users]} would sit in stages {sorted(stages)} (tied "
                "weights). Untie it (tie_word_embeddings=False for Hugging Face models) or put those modules in "
                "one stage."
            )


def _outermost(names: list[str], model: torch.nn.Module) -> list[str]:
    """``names`` grouped under their outermost module whose parameters are all among them (for messages)."""
    missing = set(names)
    holding = [n for n, m in model.named_modules() if n and _own_params(m)]
    out: list[str] = []
    for name in names:
        parts, best = name.split("."), name
        for i in range(1, len(parts)):
            prefix = ".".join(parts[:i])
            if all(n in missing for n in holding if inside(n, prefix)):
                best = prefix
                break
        if best not in out:
            out.append(best)
    return out


def _check_names(plan: Sequence[str], names: dict[str, Any], source: str) -> None:
    known = [n for n in names if n]
    for name in plan:
        if name not in names or not name:
            close = difflib.get_close_matches(name, known, n=3)
            hint = f" Closest: {', '.join(close)}." if close else ""
            shown = known if len(known) <= 40 else [*known[:40], f"... ({len(known) - 40} more)"]
            raise ConfigurationError(
                f"pp_plan from {source}: the model has no module {name!r}.{hint} Its modules are: "
                f"{', '.join(shown)}."
            )


def _check_count(planned: int, num_stages: int, source: str) -> None:
    if planned != num_stages:
        raise ConfigurationError(
            f"pp_plan from {source} makes {planned} stages, but the pipeline has {num_stages} "
            "(pipeline_parallel_size x stages_per_rank). Give a plan with that many stages, or change the sizes."
        )


def _unsplittable(model: torch.nn.Module) -> str:
    children = [n for n, c in model.named_children() if _has_params(c)]
    return (
        f"{type(model).__name__} cannot be split into pipeline stages: it has no repeated blocks (a ModuleList, "
        "ModuleDict or Sequential of same-class layers) and no plan. Give PPStrategy(pp_plan=...) or a pp_plan "
        "attribute on the model: the module names where each stage begins, or one list of module names per "
        f"stage. Its top-level modules with parameters are: {', '.join(children) or '(none)'}."
    )
