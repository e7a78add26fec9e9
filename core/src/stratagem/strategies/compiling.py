"""``torch.compile`` in the place the framework chooses: what ``compile=`` asks for, and the ``compiler`` a
strategy's ``wrap_model`` receives.

The order is the framework's for every strategy: tensor parallelism, then activation checkpointing, then
compile, then data-parallel wrapping (DDP, FSDP2 units, DeepSpeed). A strategy whose ``wrap_model`` only
replicates or shards for data parallelism says nothing and the Engine compiles the model before calling it; a
strategy that changes what a block computes first takes the ``compiler`` argument and calls it at that point.

Compiling happens in place (:mod:`stratagem.strategies._regions`): each repeated block's ``forward`` is
compiled, or the whole module's, so parameter names and checkpoint keys stay those of the plain model and the
hooks of wrappers applied afterwards run around the compiled code, never inside it.
"""

from __future__ import annotations

import difflib
import warnings
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import attrs

from stratagem.errors import ConfigurationError

if TYPE_CHECKING:
    import torch

__all__ = [
    "CompileOptions",
    "Compiler",
    "compile_options",
    "compile_regions",
    "dynamo_counts",
    "region_names",
    "unwrap_compiled",
]

OPTION_NAMES = ("backend", "mode", "fullgraph", "dynamic", "regional")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off", "none"}
#: Backends torch tags "debug" that are worth naming: Dynamo alone, and Dynamo with AOTAutograd (what tests use).
_OFFERED_DEBUG = ("eager", "aot_eager")


def _closest(value: str, names: Iterable[str]) -> str:
    close = difflib.get_close_matches(value, list(names), n=1, cutoff=0.5)
    return f" Did you mean {close[0]!r}?" if close else ""


def _check_backend(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if callable(value):
        return
    if not isinstance(value, str):
        raise ConfigurationError(f"compile backend={value!r}: give a backend name or a backend function.")
    import torch._dynamo

    # Debug and experimental backends are accepted; of them only the two that testing uses are offered.
    if value not in torch._dynamo.list_backends(exclude_tags=()):
        offered = sorted({*torch._dynamo.list_backends(), *_OFFERED_DEBUG})
        raise ConfigurationError(
            f"compile backend={value!r} is not a torch.compile backend.{_closest(value, offered)} "
            f"Backends: {', '.join(offered)}."
        )


def _check_flag(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigurationError(f"compile {attribute.name}={value!r}: give True or False.")


def _check_dynamic(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and not isinstance(value, bool):
        raise ConfigurationError(
            f"compile dynamic={value!r}: give True, False or None (torch decides after seeing shapes change)."
        )


def _regional(value: Any) -> Any:
    if value is None or isinstance(value, bool):
        return value
    items = [value] if isinstance(value, (str, type)) else list(value)
    if not items or any(not isinstance(i, (str, type)) for i in items):
        raise ConfigurationError(
            f"compile regional={value!r}: give True (each repeated block), False (the whole model), None (blocks "
            "if the model repeats one, else the whole model), or block classes or class names."
        )
    return frozenset(items)


@attrs.frozen(kw_only=True)
class CompileOptions:
    """What ``compile=`` asks for (``Trainer(compile=...)``, ``Engine.setup(..., compile=...)``).

    :param backend: a ``torch.compile`` backend name (``torch._dynamo.list_backends()``) or a backend function.
    :param mode: an inductor mode (``torch._inductor.list_mode_options()``); for ``backend="inductor"`` only.
    :param fullgraph: each compiled region must be one graph: a graph break is a :class:`CompileError`
        naming it, at the first step. Otherwise a break is reported once, by region, and the region runs as
        several graphs.
    :param dynamic: ``torch.compile``'s ``dynamic`` (``None``: torch marks shapes dynamic once they change).
    :param regional: ``None`` (the default): each repeated block once when the model has repeated blocks (children
        of a ``ModuleList``/``Sequential``/``ModuleDict`` that share a class), else the whole model; ``True``:
        the repeated blocks (an error if there are none); ``False``: the whole model; a class, a class name or
        a collection of them: the outermost modules of those classes.
    """

    backend: Any = attrs.field(default="inductor", validator=_check_backend)
    mode: str | None = None
    fullgraph: bool = attrs.field(default=False, validator=_check_flag)
    dynamic: bool | None = attrs.field(default=None, validator=_check_dynamic)
    regional: Any = attrs.field(default=None, converter=_regional)

    def __attrs_post_init__(self) -> None:
        if self.mode is None:
            return
        if self.backend != "inductor":
            raise ConfigurationError(
                f"compile mode={self.mode!r} is an inductor mode, and backend={self.backend!r} takes none: drop "
                "mode, or use backend='inductor'."
            )
        import torch._inductor

        modes = list(torch._inductor.list_mode_options())
        if self.mode not in modes:
            raise ConfigurationError(
                f"compile mode={self.mode!r} is not an inductor mode.{_closest(str(self.mode), modes)} "
                f"Modes: {', '.join(modes)}."
            )

    def torch_kwargs(self) -> dict[str, Any]:
        """The arguments of ``torch.compile``."""
        kwargs: dict[str, Any] = {
            "backend": self.backend,
            "fullgraph": self.fullgraph,
            "dynamic": self.dynamic,
        }
        if self.mode is not None:
            kwargs["mode"] = self.mode
        return kwargs

    def describe(self) -> str:
        """The options that differ from the defaults, as ``backend=inductor, fullgraph=True`` (for messages)."""
        backend = (
            self.backend if isinstance(self.backend, str) else getattr(self.backend, "__name__", "custom")
        )
        parts = [f"backend={backend}"] + [
            f"{name}={getattr(self, name)!r}"
            for name in ("mode", "fullgraph", "dynamic", "regional")
            if getattr(self, name) != attrs.fields_dict(CompileOptions)[name].default
        ]
        return ", ".join(parts)


def _parse(text: str) -> Any:
    """``STRATAGEM_COMPILE`` / ``--compile`` text: ``1``, ``0``, a backend name, or ``key=value,...``."""
    text = text.strip()
    if text.lower() in _TRUE:
        return True
    if text.lower() in _FALSE:
        return None
    if "=" not in text:
        return {"backend": text}
    options: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, _, value = item.partition("=")
        lowered = value.strip().lower()
        options[key.strip()] = (
            True
            if lowered == "true"
            else False
            if lowered == "false"
            else None
            if lowered == "none"
            else value.strip()
        )
    return options


def compile_options(value: Any) -> CompileOptions | None:
    """``compile=`` as given (``True``, ``False``/``None``, a dict, text, or :class:`CompileOptions`) checked,
    or ``None`` for no compile. An unknown key, backend or mode is refused naming the ones that exist."""
    if value is None or value is False:
        return None
    if value is True:
        return CompileOptions()
    if isinstance(value, CompileOptions):
        return value
    if isinstance(value, str):
        return compile_options(_parse(value))
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - set(OPTION_NAMES))
        if unknown:
            hint = _closest(str(unknown[0]), OPTION_NAMES)
            raise ConfigurationError(
                f"compile={dict(value)!r}: unknown option(s) {unknown}.{hint} Options: {', '.join(OPTION_NAMES)}."
            )
        return CompileOptions(**value)
    raise ConfigurationError(
        f"compile={value!r}: give True, False, or a dict of {', '.join(OPTION_NAMES)} (or a CompileOptions)."
    )


class Compiler:
    """What ``wrap_model`` receives as ``compiler``: ``compiler(module)`` compiles ``module`` in place, after
    the strategy's tensor parallelism and activation checkpointing and before its data-parallel wrapping. A
    no-op when the run does not compile, so a strategy calls it unconditionally.

    A pipeline strategy calls it once per stage, with ``prefix`` the stage's place in the whole model, so that
    reports name the blocks as the user knows them.
    """

    def __init__(self, options: CompileOptions | None) -> None:
        self.options = options
        #: The compiled regions' names ("" for a whole module), over every call.
        self.regions: list[str] = []
        self.called = False

    @property
    def enabled(self) -> bool:
        """Whether this run compiles (``compile=`` was given)."""
        return self.options is not None

    def __call__(self, module: torch.nn.Module, prefix: str = "") -> list[str]:
        self.called = True
        if self.options is None:
            return []
        names = compile_regions(module, self.options, prefix=prefix)
        self.regions += names
        return names

    def __repr__(self) -> str:
        return f"Compiler({self.options.describe() if self.options else 'off'})"


def compile_regions(module: torch.nn.Module, options: CompileOptions, prefix: str = "") -> list[str]:
    """Compile ``module`` in place as ``options.regional`` says; return the compiled regions' names."""
    from stratagem.strategies import _regions

    names = []
    for name, region in _regions.find_regions(module, options.regional):
        full = ".".join(p for p in (prefix, name) if p)
        _regions.compile_in_place(region, full, options)
        names.append(full)
    return names


def region_names(module: torch.nn.Module, options: CompileOptions) -> list[str]:
    """The names of the regions :func:`compile_regions` would compile in ``module`` (``""``: the whole module),
    compiling nothing: for a strategy that chooses the regions on the whole model and compiles them piece by
    piece (a pipeline's stages, of which one may hold a single block that alone does not repeat)."""
    from stratagem.strategies import _regions

    return [name for name, _ in _regions.find_regions(module, options.regional)]


def unwrap_compiled(model: torch.nn.Module) -> tuple[torch.nn.Module, list[str], CompileOptions | None]:
    """Take ``torch.compile`` off a model: the ``OptimizedModule`` wrappers at the root and inside (each child
    replaced by the module it wraps) and what ``Module.compile()`` set. Returns the plain model, where
    compile was found, and the options the root was compiled with (backend, mode, fullgraph, dynamic) if any."""
    import sys

    if "torch._dynamo" not in sys.modules:
        return model, [], None  # nothing in this process was compiled (and importing Dynamo takes seconds)
    from stratagem.strategies import _regions

    model, where, root = _regions.unwrap(model)
    return model, where, None if root is None else _options_of(root)


def _options_of(compiled: Any) -> CompileOptions | None:
    """The backend, mode, fullgraph and dynamic that ``torch.compile`` was given, where torch shows them:
    ``compiled`` is its ``OptimizedModule``, or the function ``Module.compile()`` set."""
    try:
        from torch._dynamo.eval_frame import _TorchDynamoContext, innermost_backend

        context = getattr(compiled, "dynamo_ctx", None)
        if context is None:  # Module.compile()'s function holds its context in a closure cell
            cells = [cell.cell_contents for cell in getattr(compiled, "__closure__", None) or ()]
            context = next(c for c in cells if isinstance(c, _TorchDynamoContext))
        backend = innermost_backend(context.callback)
        name = getattr(backend, "compiler_name", None)
        dynamic = getattr(context, "_dynamic", None)
        dynamic = dynamic if isinstance(dynamic, bool) else None
        return CompileOptions(
            backend=name if isinstance(name, str) else "inductor",
            mode=_inductor_mode(backend, dynamic) if name == "inductor" else None,
            fullgraph=bool(getattr(context, "fullgraph", False)),
            dynamic=dynamic,
        )
    except Exception:  # torch's internals moved: the defaults will do
        return None


def _inductor_mode(backend: Any, dynamic: bool | None) -> str | None:
    """The mode whose settings inductor's wrapper holds (torch keeps the settings a mode stands for, not its
    name); ``None`` for the default mode."""
    config = getattr(backend, "config", None)
    if not config:
        return None
    import torch._inductor

    modes = torch._inductor.list_mode_options(None, dynamic)
    return next((mode for mode, settings in modes.items() if settings and settings == config), None)


def recompiled_note(where: list[str], options: CompileOptions | None) -> str:
    """The one-line note for a model that came compiled already (``options``: what it is compiled with now;
    ``None``: not compiled, as ``compile=False`` asked)."""
    shown = ", ".join(w or "the model" for w in where[:4]) + (" ..." if len(where) > 4 else "")
    came = f"stratagem: the model came compiled by torch.compile ({shown}); unwrapped"
    if options is None:
        return f"{came} and not compiled (compile=False)."
    return (
        f"{came} and compiled again after tensor parallelism and activation checkpointing, before data-parallel "
        f"wrapping ({options.describe()})."
    )


def note_recompiled(where: list[str], options: CompileOptions) -> None:
    """:func:`recompiled_note` as a warning (the Engine's; the Trainer prints it on rank 0)."""
    warnings.warn(recompiled_note(where, options), UserWarning, stacklevel=4)


def dynamo_counts() -> dict[str, int]:
    """This process's Dynamo counters: frames compiled (recompilations included), graphs, graph breaks."""
    from torch._dynamo.utils import counters

    return {
        "frames": int(counters["frames"]["ok"]),
        "graphs": int(counters["stats"]["unique_graphs"]),
        "graph_breaks": int(sum(counters["graph_break"].values())),
    }
