"""The models ``stratagem plan`` knows: ``demo`` (the demo's transformer, at any size), a Hugging Face
``config.json``, or ``package.module:Class`` / ``path/file.py:Class`` (a ``stratagem.Module`` or torch module
built without arguments)."""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

from stratagem.errors import ConfigurationError
from stratagem.planning import Workload, parse_count, token_batch, token_step
from stratagem.trainer._planned_module import module_step

FORMS = "demo, a Hugging Face config (PATH/config.json), or package.module:Class (or path/file.py:Class)"


def workload(spec: str, size: str | None = None) -> Workload:
    """The workload ``--model spec`` (and ``--size``, for the demo) names; every error says what to give."""
    if spec == "demo":
        return demo(size)
    if size is not None:
        raise ConfigurationError(f"--size {size} applies to --model demo only; {spec} has its own size.")
    if spec.endswith(".json") or Path(spec).is_dir():
        return hugging_face(Path(spec))
    if ":" in spec:
        return model_class(spec)
    raise ConfigurationError(f"--model {spec!r}: give {FORMS}.")


# -------------------------------------------------------------------------------------------------
# the demo's model
# -------------------------------------------------------------------------------------------------


def demo_shape(parameters: int) -> tuple[int, int, int]:
    """``(dim, layers, heads)`` of a demo model near ``parameters``: a block holds about ``12 dim^2``, and
    ``dim / layers`` is about 128 (GPT-3's shapes), with 64-wide heads."""
    dim = max(64, round((128 * parameters / 12) ** (1 / 3) / 64) * 64)
    layers = max(1, round(parameters / (12 * dim * dim)))
    return dim, layers, dim // 64


def demo(size: str | None) -> Workload:
    from stratagem.cli.demo.model import CharLM, load_text

    vocab = len(set(load_text()))
    shape = None if size is None else demo_shape(parse_count(size, "--size"))

    def build() -> Any:
        if shape is None:
            model = CharLM(vocab, block=_DEMO_BLOCK)
        else:
            dim, layers, heads = shape
            model = CharLM(vocab, block=_DEMO_BLOCK, dim=dim, layers=layers, heads=heads)
        model.configure_model()
        return model

    def step(model: Any, wrapped: Any, batch: tuple[Any, Any]) -> Any:
        ids, targets = batch
        return model.compute_loss(wrapped(ids), targets)

    name = "demo" if size is None else f"demo ({size})"
    return Workload(name=name, build=build, batch=_demo_batch(vocab), step=step)


#: Positions the demo's model embeds; sequences up to this long (the plan's --seq) fit.
_DEMO_BLOCK = 4096


def _demo_batch(vocab: int) -> Any:
    tokens = token_batch(vocab)

    def make(model: Any, batch_size: int, sequence_length: int) -> Any:
        if sequence_length > _DEMO_BLOCK:
            raise ConfigurationError(
                f"--seq {sequence_length}: the demo's model embeds {_DEMO_BLOCK} positions; use --seq <= {_DEMO_BLOCK}."
            )
        return tokens(model, batch_size, sequence_length)

    return make


# -------------------------------------------------------------------------------------------------
# a Hugging Face config
# -------------------------------------------------------------------------------------------------


def _missing_path(path: Path) -> ConfigurationError:
    parent = path.parent if str(path.parent) else Path(".")
    near = []
    if parent.is_dir():
        siblings = [p.name for p in parent.iterdir()]
        near = difflib.get_close_matches(path.name, siblings, n=3, cutoff=0.4)
    hint = f" Near it: {', '.join(str(parent / n) for n in near)}." if near else ""
    where = f" ({parent} does not exist)" if not parent.is_dir() else ""
    return ConfigurationError(f"--model {path}: no such file{where}.{hint} Give {FORMS}.")


def hugging_face(path: Path) -> Workload:
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise _missing_path(path)
    try:
        values = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ConfigurationError(f"--model {path}: not a readable JSON file ({error}).") from error
    if not isinstance(values, dict) or "model_type" not in values:
        raise ConfigurationError(
            f'--model {path}: a Hugging Face config has a \'model_type\' entry ("llama", "gpt2", ...); this one '
            "has none."
        )
    try:
        import transformers
    except ImportError as error:
        raise ConfigurationError(
            f"--model {path}: planning a Hugging Face config needs transformers ({error})."
        ) from error
    try:
        config = transformers.AutoConfig.for_model(**values)
    except ValueError as error:
        raise ConfigurationError(f"--model {path}: transformers cannot read it: {error}") from error
    config.use_cache = False

    def build() -> Any:
        import torch

        # In the dtype the precision gives (the strategy's model_init_context sets it), not the config's.
        return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.get_default_dtype())

    return Workload(
        name=path.name if path.name != "config.json" else str(path.parent.name or path),
        build=build,
        batch=token_batch(int(config.vocab_size)),
        step=token_step,
    )


# -------------------------------------------------------------------------------------------------
# a model class
# -------------------------------------------------------------------------------------------------


def _load_module(where: str, spec: str) -> Any:
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise _missing_path(path)
        name = f"_stratagem_plan_model_{abs(hash(str(path.resolve())))}"
        if name not in sys.modules:
            file_spec = importlib.util.spec_from_file_location(name, path)
            assert file_spec is not None and file_spec.loader is not None
            module = importlib.util.module_from_spec(file_spec)
            sys.modules[name] = module
            file_spec.loader.exec_module(module)
        return sys.modules[name]
    try:
        return importlib.import_module(where)
    except ModuleNotFoundError as error:
        raise ConfigurationError(
            f"--model {spec}: no module named {error.name!r} can be imported (is the package installed, or the "
            f"current directory on the path?). Give {FORMS}."
        ) from error


def model_class(spec: str) -> Workload:
    import torch

    where, _, attr = spec.rpartition(":")
    module = _load_module(where, spec)
    cls = getattr(module, attr, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
        classes = sorted(
            n for n, v in vars(module).items() if isinstance(v, type) and issubclass(v, torch.nn.Module)
        )
        close = difflib.get_close_matches(attr, classes, n=1)
        raise ConfigurationError(
            f"--model {spec}: {where} has no torch module class {attr!r}."
            + (f" Did you mean {close[0]!r}?" if close else "")
            + f" Module classes there: {', '.join(classes) or '(none)'}."
        )

    def build() -> Any:
        try:
            model = cls()
        except TypeError as error:
            raise ConfigurationError(
                f"--model {spec}: {attr}() must build without arguments ({error}); give a subclass or a "
                "function-free wrapper that sets them."
            ) from error
        configure = getattr(model, "configure_model", None)
        if callable(configure):
            configure()
        return model

    batch = _class_batch if callable(getattr(cls, "example_batch", None)) else None
    return Workload(name=attr, build=build, batch=batch, step=module_step if batch else None)


def _class_batch(model: Any, batch_size: int, sequence_length: int) -> Any:
    import torch

    return model.example_batch(batch_size, torch.Generator().manual_seed(0))
