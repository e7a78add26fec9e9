"""The errors stratagem raises. Each message says what was wrong and what to do about it."""

from __future__ import annotations

from collections.abc import Iterable


def _closest(name: str, names: list[str]) -> str | None:
    # difflib is imported here, when a name is wrong, not with every `import stratagem`.
    import difflib

    close = difflib.get_close_matches(name, names, n=1, cutoff=0.5)
    return close[0] if close else None


class StratagemError(Exception):
    """Base class of every stratagem error."""

    def __reduce__(self) -> tuple:
        # An error crosses processes pickled (DCP gathers every rank's; a worker's goes to its launcher). Python
        # rebuilds an exception by calling its class with ``args`` (the message), which the constructors here do
        # not take: it is rebuilt from its message and attributes instead.
        return (_rebuilt, (type(self), self.args, dict(self.__dict__)))


def _rebuilt(cls: type[StratagemError], args: tuple, attributes: dict) -> StratagemError:
    error = cls.__new__(cls)
    error.args = args
    error.__dict__.update(attributes)
    return error


def _unknown(
    kind: str, plural: str, name: str, installed: list[str], closest: str | None, install: str
) -> str:
    """The message for a name no installed plugin registers: what to install (as an installed plugin declared
    it), else the closest name; what is installed; and, with neither, where other names come from."""
    message = f"Unknown {kind} {name!r}."
    if install:
        message += f" {install}"
    elif closest:
        message += f" Did you mean {closest!r}?"
    message += f" Installed {plural}: {', '.join(installed) or '(none)'}."
    if not (install or closest):
        listing = "callbacks" if kind == "logger" else plural
        message += (
            f" Other {plural} come with plugin packages: `stratagem {listing}` lists what is installed, and "
            "stratagem's documentation lists the plugin packages."
        )
    return message


class UnknownStrategyError(StratagemError, KeyError):
    """A strategy name that no installed plugin registers.

    :param hint: more to say (the plugins that failed to load).
    :param install: what to install, as an installed plugin declared it (``register_install_hints``).
    """

    def __init__(self, name: str, installed: Iterable[str], hint: str = "", install: str = "") -> None:
        self.name = name
        self.installed = sorted(installed)
        self.closest = _closest(name, self.installed)
        message = _unknown("strategy", "strategies", name, self.installed, self.closest, install)
        if hint:
            message += f" {hint}"
        super().__init__(message)

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


class UnknownLauncherError(StratagemError, KeyError):
    """A launcher name that no installed plugin registers (``install``: as :class:`UnknownStrategyError`)."""

    def __init__(self, name: str, installed: Iterable[str], install: str = "") -> None:
        self.name = name
        self.installed = sorted(installed)
        self.closest = _closest(name, self.installed)
        super().__init__(_unknown("launcher", "launchers", name, self.installed, self.closest, install))

    def __str__(self) -> str:
        return str(self.args[0])


class UnknownNameError(StratagemError, KeyError):
    """A callback or logger name that no installed plugin registers (``kind`` says which)."""

    def __init__(self, kind: str, name: str, installed: Iterable[str], install: str = "") -> None:
        self.kind = kind
        self.name = name
        self.installed = sorted(installed)
        self.closest = _closest(name, self.installed)
        super().__init__(_unknown(kind, f"{kind}s", name, self.installed, self.closest, install))

    def __str__(self) -> str:
        return str(self.args[0])


class PluginLoadError(StratagemError):
    """A plugin's entry point could not be imported or its ``register_strategies`` failed."""

    def __init__(self, entry_point: str, distribution: str, version: str, error: BaseException) -> None:
        self.entry_point = entry_point
        self.distribution = distribution
        self.version = version
        self.error = error
        super().__init__(
            f'Error importing plugin "{entry_point}" from {distribution} {version}: '
            f"{type(error).__name__}: {error}. Its strategies are unavailable; the other plugins still load. "
            f"Reinstall or upgrade {distribution}, or keep it from loading with "
            f"STRATAGEM_DISABLE_PLUGINS={entry_point.split(' = ')[0]}."
        )


class StrategyConflictError(StratagemError):
    """Two plugins registered the same strategy name."""

    def __init__(self, name: str, first: str, second: str) -> None:
        self.name = name
        self.distributions = (first, second)
        super().__init__(
            f"Strategy {name!r} is registered by both {first} and {second}. Uninstall one of them, or keep one "
            f"from loading with STRATAGEM_DISABLE_PLUGINS (its entry-point name; `stratagem doctor` shows it)."
        )


class CapabilityError(StratagemError, ValueError):
    """A request (accelerator, precision, world size, checkpoint format) the strategy does not declare."""

    def __init__(
        self, strategy: str, capability: str, requested: object, alternatives: Iterable[str]
    ) -> None:
        self.strategy = strategy
        self.capability = capability
        self.requested = requested
        self.alternatives = sorted(alternatives)
        alt = ", ".join(self.alternatives) if self.alternatives else "none installed"
        super().__init__(
            f"Strategy {strategy!r} does not support {capability} {requested!r}. Strategies that do: {alt}."
        )


class PrecisionKernelError(CapabilityError):
    """Under a low precision, the model called an op that torch has no kernel for in that dtype on the device."""

    def __init__(
        self, strategy: str, precision: str, device_type: str, op: str, detail: str, torch_version: str
    ) -> None:
        self.strategy = strategy
        self.capability = f"precision on {device_type}"
        self.requested = precision
        self.alternatives: list[str] = []
        self.op = op
        what = f"{op!r}" if op else "an op of this model"
        ValueError.__init__(
            self,
            f"precision={precision!r} on {device_type}: torch {torch_version} has no float16 kernel for "
            f"{what} on {device_type} ({detail.splitlines()[0] if detail else 'no detail'}). Parameters and "
            f"computation are float16 throughout under {precision!r}; use precision='bf16-true' (bfloat16 "
            "kernels cover more of the CPU) or '32-true', compute that op in float32 yourself "
            "(x.float()), or run on CUDA.",
        )


class MissingDependencyError(StratagemError, ImportError):
    """A strategy (or a launcher, callback, logger: ``kind``) needs a package that is not installed."""

    def __init__(
        self,
        strategy: str,
        requirements: Iterable[str],
        *,
        kind: str = "Strategy",
        install: Iterable[str] | None = None,
    ) -> None:
        self.strategy = strategy
        self.requirements = list(requirements)
        quoted = " ".join(f"'{r}'" for r in (self.requirements if install is None else install))
        super().__init__(
            f"{kind} {strategy!r} needs {', '.join(self.requirements)}, which is not installed. "
            f"Install it with: pip install {quoted}"
        )


class HookImplementationError(StratagemError, TypeError):
    """A plugin or strategy implements a hook in a way pluggy would accept but stratagem cannot honour."""


class CheckpointError(StratagemError):
    """A checkpoint could not be written or read. The previous checkpoint, if any, is untouched."""

    def __init__(self, path: object, problem: str) -> None:
        self.path = str(path)
        self.problem = problem
        super().__init__(f"Checkpoint {self.path}: {problem}")


class ConfigurationError(StratagemError, ValueError):
    """An option of the Engine, Trainer or a strategy has a value that cannot work."""


class CompileError(ConfigurationError):
    """``torch.compile`` cannot compile the model as asked (``fullgraph=True`` over a graph break)."""


class WorkerFailedError(StratagemError, RuntimeError):
    """A worker process raised or died; the whole run was stopped."""

    def __init__(self, rank: int | None, exitcode: int | None, detail: str) -> None:
        self.rank = rank
        self.exitcode = exitcode
        self.detail = detail
        who = f"rank {rank}" if rank is not None else "a worker"
        super().__init__(f"Training failed: {who} exited with code {exitcode}.\n{detail}".rstrip())


#: The exit code of a preempted run: ``EX_TEMPFAIL`` of sysexits.h, "a temporary failure: try again later".
PREEMPTED_EXIT_CODE = 75


class Preempted(SystemExit):
    """The run stopped for a preemption signal after saving a checkpoint of the step every rank reached.

    A ``SystemExit`` with code :data:`PREEMPTED_EXIT_CODE` (75): the script ends there (an ``except Exception``
    around ``fit`` does not catch it), and the process exits with 75. Run it again with ``ckpt_path="last"``,
    or let the scheduler requeue it, to continue bit for bit.

    :param message: what happened, as the run reports it.
    :param signal: the signal's name (``"SIGTERM"``).
    :param step: the step whose checkpoint was saved (``None`` if none was).
    :param checkpoint: that checkpoint's path.
    """

    def __init__(
        self, message: str, *, signal: str, step: int | None = None, checkpoint: str | None = None
    ) -> None:
        super().__init__(PREEMPTED_EXIT_CODE)
        self.message = message
        self.signal = signal
        self.step = step
        self.checkpoint = checkpoint

    def __str__(self) -> str:
        return self.message


def __getattr__(name: str) -> object:
    if name == "KNOWN_LAUNCHER_PACKAGES":
        import warnings

        warnings.warn(
            "stratagem.errors.KNOWN_LAUNCHER_PACKAGES is deprecated and empty: the core names no plugin package. "
            "What to install for a launcher comes from the installed plugins (the register_install_hints hook); "
            "get_registry().hints.sentence('launcher', name) says it.",
            DeprecationWarning,
            stacklevel=2,
        )
        return {}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
