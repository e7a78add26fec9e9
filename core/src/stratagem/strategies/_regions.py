"""Which modules are compiled, and how each is compiled in place.

A region's ``forward`` is replaced, on the instance, by its class's ``forward`` compiled once per class and
options: repeated blocks share one compiled function (Dynamo keeps compiled code per code object and the
blocks' parameters are inputs to it, so thirty-two blocks compile as one). The module's own hooks, and those
that FSDP2, DeepSpeed or tensor parallelism register on it later, run around the compiled code, as for
``torch.compile(module)``; unlike it, no wrapper module is inserted, so no name gains ``_orig_mod.``.
"""

from __future__ import annotations

import types
import warnings
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from stratagem.errors import CompileError, ConfigurationError

if TYPE_CHECKING:
    from stratagem.strategies.compiling import CompileOptions

CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


# -------------------------------------------------------------------------------------------------
# which modules
# -------------------------------------------------------------------------------------------------


def inner_module(module: nn.Module) -> nn.Module:
    """The module an activation-checkpoint wrapper holds (the module itself otherwise)."""
    while isinstance(getattr(module, "_checkpoint_wrapped_module", None), nn.Module):
        module = module._checkpoint_wrapped_module
    return module


def user_class(module: nn.Module) -> type:
    """The class a user knows a module by: through activation-checkpoint wrappers, and past the classes FSDP2
    makes when it shards a module in place (``FSDPBlock``, a subclass of ``Block``)."""
    for cls in type(inner_module(module)).__mro__:
        if not cls.__module__.startswith("torch.distributed."):
            return cls
    return type(module)


def _can_be_block(module: nn.Module) -> bool:
    inner = inner_module(module)
    has_params = any(True for _ in inner.parameters())
    # torch.nn's leaves (Linear, LayerNorm) repeat in every model; compiling each alone gains nothing.
    torch_leaf = type(inner).__module__.startswith("torch.nn.") and not any(True for _ in inner.children())
    return has_params and not torch_leaf


def repeated_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The children of ``ModuleList``/``Sequential``/``ModuleDict`` containers that share their class with a
    sibling and hold parameters, outermost first (nothing inside a chosen block is chosen). An activation
    checkpoint wrapper counts as the class it wraps, and is what gets compiled, so recomputation is inside."""
    found: list[tuple[str, nn.Module]] = []

    def visit(module: nn.Module, prefix: str) -> None:
        children = list(module.named_children())
        counts = Counter(user_class(c) for _, c in children) if isinstance(module, CONTAINERS) else {}
        for name, child in children:
            if counts.get(user_class(child), 0) >= 2 and _can_be_block(child):
                found.append((prefix + name, child))
            else:
                visit(child, prefix + name + ".")

    visit(model, "")
    return found


def _class_names(module: nn.Module) -> set[Any]:
    names: set[Any] = set()
    for cls in type(inner_module(module)).__mro__:
        names |= {cls, cls.__name__, cls.__qualname__, f"{cls.__module__}.{cls.__qualname__}"}
    return names


def of_classes(model: nn.Module, selector: frozenset[Any]) -> list[tuple[str, nn.Module]]:
    """The outermost modules whose class (or a base class) is in ``selector``, by class or name."""
    if _class_names(model) & selector:
        return [("", model)]
    found: list[tuple[str, nn.Module]] = []

    def visit(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            if _class_names(child) & selector:
                found.append((prefix + name, child))
            else:
                visit(child, prefix + name + ".")

    visit(model, "")
    return found


def find_regions(model: nn.Module, regional: Any) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of each region to compile, as ``regional`` says (see ``CompileOptions``)."""
    if regional is False:
        return [("", model)]
    if isinstance(regional, frozenset):
        found = of_classes(model, regional)
        if not found:
            present = sorted({user_class(m).__name__ for m in model.modules()})
            wanted = sorted(s if isinstance(s, str) else s.__name__ for s in regional)
            raise ConfigurationError(
                f"compile regional={wanted}: no module of {type(model).__name__} has such a class. Classes in "
                f"the model: {', '.join(present)}."
            )
        return found
    blocks = repeated_blocks(model)
    if blocks:
        return blocks
    if regional is True:
        raise ConfigurationError(
            f"compile regional=True: {type(model).__name__} has no repeated blocks (children of a ModuleList, "
            "Sequential or ModuleDict sharing a class). Name the blocks (regional={'MyBlock'}), or compile the "
            "whole model (regional=False)."
        )
    return [("", model)]


# -------------------------------------------------------------------------------------------------
# compiling one region in place
# -------------------------------------------------------------------------------------------------

_COMPILED: dict[tuple[Any, Any], Callable[..., Any]] = {}
_REPORTED: set[tuple[str, str]] = set()


def _inline(forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward`` behind a frame of stratagem's: Dynamo does not start tracing in torch's own files (a
    ``torch.nn.Sequential`` or a checkpoint wrapper compiled by ``Module.compile()`` compiles nothing) but
    follows calls into them."""

    def call(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return forward(self, *args, **kwargs)

    # A code object per class: Dynamo counts compiled entries per code object against its recompile limit.
    code = call.__code__.replace(co_name=f"{forward.__qualname__.replace('.', '_')}_compiled")
    return types.FunctionType(code, call.__globals__, code.co_name, None, call.__closure__)


def _compiled_forward(forward: Callable[..., Any], options: CompileOptions) -> Callable[..., Any]:
    key = (forward, options)
    if key not in _COMPILED:
        target = _inline(forward) if getattr(forward, "__module__", "").startswith("torch.") else forward
        _COMPILED[key] = torch.compile(target, **options.torch_kwargs())
    return _COMPILED[key]


class RegionForward:
    """A compiled region's ``forward`` (bound to the module on the instance). Reports a graph break once, by
    the region's class, and turns ``fullgraph=True``'s refusal into an error that names the region."""

    def __init__(self, label: str, compiled: Callable[..., Any], options: CompileOptions) -> None:
        self.label, self.compiled, self.options = label, compiled, options

    def __call__(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            # Inside someone else's compiled code: let Dynamo trace straight through.
            return self.compiled(module, *args, **kwargs)
        from torch._dynamo.utils import counters

        before = dict(counters["graph_break"])
        try:
            result = self.compiled(module, *args, **kwargs)
        except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError) as error:
            if not self.options.fullgraph:
                raise
            raise CompileError(
                f"compile(fullgraph=True): {self.label} cannot be compiled as one graph: {_summary(str(error))}"
                f"{_where(str(error))}. Remove the graph break, or compile with fullgraph=False (the break is "
                "then reported once and the region runs as several graphs)."
            ) from None
        if len(counters["graph_break"]) != len(before) or counters["graph_break"] != before:
            self._report({k for k, n in counters["graph_break"].items() if before.get(k, 0) != n})
        return result

    def _report(self, reasons: set[str]) -> None:
        kind = self.label.rsplit(" ", 1)[-1]
        for reason in sorted(reasons):
            if (kind, reason) in _REPORTED:
                continue
            _REPORTED.add((kind, reason))
            if not _rank_zero():
                continue
            warnings.warn(
                f"stratagem compile: a graph break in {self.label}: {_summary(reason)}. The region runs as "
                "several graphs (reported once; fullgraph=True makes it an error).",
                UserWarning,
                stacklevel=3,
            )


def _summary(reason: str) -> str:
    lines = [line.strip() for line in reason.strip().splitlines() if line.strip()]
    head = lines[0] if lines else reason
    explanation = next((line for line in lines if line.startswith("Explanation:")), "")
    return f"{head.rstrip('.')} ({explanation.removeprefix('Explanation:').strip()})" if explanation else head


def _where(message: str) -> str:
    """Where in the user's code a Dynamo error arose: its ``Caused by:`` line, or the innermost ``File "...",
    line N, in f`` of its user stack."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    caused = [line.removeprefix("Caused by:").strip() for line in lines if line.startswith("Caused by:")]
    if caused:
        return f", caused by: {caused[0]}"
    files = [line for line in lines if line.startswith('File "')]
    return f", at {files[-1]}" if files else ""


def _rank_zero() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def compile_in_place(module: nn.Module, name: str, options: CompileOptions) -> None:
    """Compile ``module``'s forward on the instance (its class's forward, shared by every module of the class)."""
    own = module.__dict__.get("forward")
    if isinstance(getattr(own, "__func__", None), RegionForward):
        del module.__dict__["forward"]  # compiled before (a model set up again): compile with these options
        own = None
    if own is not None and getattr(own, "__self__", None) is not module:
        raise ConfigurationError(
            f"compile: {name or 'the model'} ({type(module).__name__}) has a forward set on the instance that is "
            "not one of its methods; compile it yourself, or exclude it with regional=."
        )
    forward = own.__func__ if own is not None else type(module).forward
    label = f"{name or 'the model'} ({user_class(module).__name__})"
    region = RegionForward(label, _compiled_forward(forward, options), options)
    module.forward = types.MethodType(region, module)  # type: ignore[method-assign]


def is_compiled(module: nn.Module) -> bool:
    return isinstance(getattr(module.__dict__.get("forward"), "__func__", None), RegionForward)


# -------------------------------------------------------------------------------------------------
# a model compiled before it reached us
# -------------------------------------------------------------------------------------------------


def unwrap(model: nn.Module) -> tuple[nn.Module, list[str], Any]:
    """The model without torch.compile's wrappers, where they were, and what compiled the root: its
    ``OptimizedModule``, or the function its ``Module.compile()`` set (``None``: the root was not compiled)."""
    from torch._dynamo.eval_frame import OptimizedModule

    where: list[str] = []
    root = None
    if isinstance(model, OptimizedModule):
        root = model
        while isinstance(model, OptimizedModule):
            model = model._orig_mod
        where.append("")
    for path, parent in list(model.named_modules()):
        for child_name, child in list(parent._modules.items()):
            if isinstance(child, OptimizedModule):
                inner = child
                while isinstance(inner, OptimizedModule):
                    inner = inner._orig_mod
                setattr(parent, child_name, inner)
                where.append(".".join(p for p in (*path.split("."), child_name) if p and p != "_orig_mod"))
    for path, module in model.named_modules():
        if module.__dict__.get("_compiled_call_impl") is not None:
            if not path and root is None:
                root = module._compiled_call_impl  # the root's options are read from it
            module._compiled_call_impl = None  # what Module.compile() set
            where.append(path)
        if is_compiled(module):
            del module.__dict__["forward"]  # stratagem's own, from an earlier set-up: compiled again below
    return model, where, root
