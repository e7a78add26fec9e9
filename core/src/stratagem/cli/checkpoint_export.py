"""``stratagem checkpoint export CKPT OUT --format hf``: a checkpoint of any strategy as a Hugging Face folder."""

from __future__ import annotations

import argparse


def add_parser(actions: argparse._SubParsersAction) -> None:
    p = actions.add_parser(
        "export",
        help="write a checkpoint's model as Hugging Face safetensors shards with their index (offline, streamed)",
        description="Write the model of a stratagem checkpoint (full or sharded, any strategy, local or on an "
        "object store) as model-0000X-of-0000N.safetensors shards and model.safetensors.index.json, with the "
        "config and tokenizer files of the Hugging Face folder the run started from. One tensor group at a "
        "time is in memory. The optimizer state is not exported.",
    )
    p.add_argument("checkpoint", help="the checkpoint: a full checkpoint file, or a sharded directory or URL")
    p.add_argument("output", help="the directory (or object-store prefix) to write")
    p.add_argument("--format", choices=["hf"], default="hf", help="the output format (hf: Hugging Face)")
    p.add_argument(
        "--max-shard-size",
        default="5GB",
        help="the most data per .safetensors file: 5GB (10**9 bytes, the Hugging Face default), 500MiB, or bytes",
    )
    p.add_argument("--module", default="model", help="which module of the checkpoint (default: model)")
    p.add_argument(
        "--adapter",
        default=None,
        help="module:name of the name adapter (default: the one the run recorded when it loaded HF weights)",
    )
    p.add_argument(
        "--prefix", default=None, help="drop this prefix from the names (default: the one the run recorded)"
    )
    p.add_argument(
        "--config-from",
        default=None,
        help="copy config and tokenizer files from this Hugging Face folder (default: the one the run started from)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing, non-empty output")


def run(args: argparse.Namespace) -> int:
    from stratagem.checkpoint._hf_progress import size_text
    from stratagem.checkpoint.hf import export_checkpoint

    report = export_checkpoint(
        args.checkpoint,
        args.output,
        max_shard_size=args.max_shard_size,
        module=args.module,
        adapter=args.adapter,
        prefix=args.prefix,
        config_from=args.config_from,
        overwrite=args.overwrite,
    )
    print(
        f"wrote {report['output']}: {report['tensors']} tensors, {size_text(report['bytes'])} in "
        f"{len(report['files'])} files + model.safetensors.index.json"
        + (
            f"; copied {', '.join(report['copied'])}"
            if report["copied"]
            else "; no config copied (--config-from)"
        )
        + f"; at most {size_text(report['peak_bytes'])} of tensors read into memory at once"
        + (" (the checkpoint's mapped from its file)" if report["mapped"] else "")
        + ". The optimizer state is not exported."
    )
    return 0
