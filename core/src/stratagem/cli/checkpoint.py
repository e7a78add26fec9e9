"""``stratagem checkpoint inspect PATH``, ``stratagem checkpoint consolidate DIR FILE`` and ``stratagem checkpoint
export CKPT OUT`` (:mod:`stratagem.cli.checkpoint_export`)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from stratagem import cli


def _build(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "checkpoint", help="inspect a checkpoint, turn a sharded one into a full one, or export it"
    )
    actions = parser.add_subparsers(dest="checkpoint_command", required=True)
    p = actions.add_parser("inspect", help="print a checkpoint's format, strategy, step and tensors")
    p.add_argument("path", help="a full checkpoint file or a sharded checkpoint directory")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--limit", type=int, default=50, help="tensors to list (default 50; 0 for all)")
    p = actions.add_parser(
        "consolidate", help="write a sharded checkpoint as one full checkpoint file (offline, one process)"
    )
    p.add_argument("source", help="the sharded checkpoint directory")
    p.add_argument("output", help="the full checkpoint file to write")
    p.add_argument(
        "--scratch-dir",
        default=None,
        help="where file-mapped tensors live during the write (default: beside the output)",
    )
    from stratagem.cli import checkpoint_export

    checkpoint_export.add_parser(actions)


cli._PARSER_EXTENSIONS.append(_build)


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _print_report(report: dict[str, Any], limit: int) -> None:
    print(f"path:          {report['path']}")
    print(f"format:        {report['format']} (version {report['format_version']})")
    print(f"strategy:      {report['strategy']}")
    print(f"world size:    {report['world_size']}")
    print(f"step:          {report['step'] if report['step'] is not None else '-'}")
    print(f"written with:  torch {report['torch_version']}, stratagem {report['stratagem_version']}")
    tensors = report["tensors"]
    print(f"tensors:       {len(tensors)}, {_size(report['tensor_bytes'])}")
    print(f"on disk:       {_size(report['bytes_on_disk'])}")
    shown = tensors if limit <= 0 else tensors[:limit]
    width = max([len(t["name"]) for t in shown] + [4])
    for t in shown:
        shape = "(" + ", ".join(str(s) for s in t["shape"]) + ")"
        print(f"  {t['name']:<{width}}  {t['dtype']:<9} {shape:<20} {_size(t['bytes'])}")
    if len(shown) < len(tensors):
        print(f"  ... {len(tensors) - len(shown)} more (--limit 0 lists all)")


def _plugin_consolidation(source: str) -> Any:
    """The consolidation function of the strategy that wrote ``source`` in its own layout, or ``None``.

    A strategy that saves ``sharded`` checkpoints in a layout other than torch.distributed.checkpoint's names
    the layout in ``stratagem.json`` (``"layout"``) and gives its class a ``consolidate(source, output)``.
    """
    from pathlib import Path

    from stratagem.errors import CheckpointError
    from stratagem.registry._manager import get_registry

    if "://" in source and not source.startswith("file://"):
        return None  # strategies' own layouts live on local disks
    meta_file = Path(source.removeprefix("file://")) / "stratagem.json"
    if not meta_file.is_file():
        return None
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, ValueError):
        return None
    layout = meta.get("layout") if isinstance(meta, dict) else None
    if not layout:
        return None
    strategy = meta.get("strategy")
    try:
        cls = get_registry().get(strategy).resolve_factory()
    except Exception as error:
        raise CheckpointError(
            source,
            f"is a {layout!r}-layout checkpoint of strategy {strategy!r}, which cannot be loaded here "
            f"to consolidate it: {error}",
        ) from error
    function = getattr(cls, "consolidate", None)
    if not callable(function):
        raise CheckpointError(
            source, f"uses layout {layout!r}, and strategy {strategy!r} offers no consolidate()."
        )
    return function


@cli.command("checkpoint")
def _checkpoint(args: argparse.Namespace) -> int:
    from stratagem.checkpoint import _offline

    if args.checkpoint_command == "inspect":
        report = _offline.inspect(args.path)
        if args.json:
            print(json.dumps(report, indent=2))
        else:
            _print_report(report, args.limit)
        return 0
    if args.checkpoint_command == "export":
        from stratagem.cli import checkpoint_export

        return checkpoint_export.run(args)
    plugin_consolidate = _plugin_consolidation(args.source)
    if plugin_consolidate is not None:
        output = plugin_consolidate(args.source, args.output)
    else:
        output = _offline.consolidate(args.source, args.output, scratch_dir=args.scratch_dir)
    if isinstance(output, str):
        from stratagem.checkpoint import _store

        size = _store.size(output)
    else:
        size = output.stat().st_size
    print(f"wrote {output} (full checkpoint, {_size(size)})")
    return 0
