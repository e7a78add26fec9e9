"""``stratagem compare``: train the same model on the same data under several strategies, one launch each, and
report per-rank memory and iterations per second side by side (the shape of the seeds' DDP vs FSDP tables).

Each column is a real multi-process run started by stratagem's launcher; every worker builds an
:class:`~stratagem.Engine` for the column's strategy and measures itself:

- the bytes of its parameters, gradients and optimizer state, counting only what the rank holds (the local
  shard of a ``DTensor``);
- on CPU its peak RSS (``ru_maxrss``) and the same peak minus the RSS it had before the model was built
  (the interpreter, torch and the process group are in the baseline, so the difference is what training took);
- on CUDA ``torch.cuda.max_memory_allocated`` of its device (and the RSS figures too);
- the time of each step; iterations per second are counted on rank 0 after a few warm-up steps.

Each data-parallel rank draws its own batches of ``--batch-size`` samples (seeded by its place among the
data-parallel ranks, which the strategy gives as for a sampler); ranks that split layers between them share
theirs, and the table says how many samples a step covers.
"""

from __future__ import annotations

from stratagem.registry._lazy import lazy_getattr

__all__ = [
    "MB",
    "SHORTHAND_OPTION",
    "Column",
    "ColumnResult",
    "Job",
    "check_columns",
    "current_rss_bytes",
    "default_warmup",
    "format_table",
    "gradient_bytes",
    "load_model_factory",
    "local_bytes",
    "optimizer_bytes",
    "parameter_bytes",
    "parse_columns",
    "peak_rss_bytes",
    "plot",
    "require_matplotlib",
    "run",
    "table_rows",
    "to_json",
    "with_suppress",
]

# Imported on first use: the command's module lives in this package, and `stratagem strategies` imports it.
_LAZY = {
    "Column": "stratagem.cli.compare._columns",
    "ColumnResult": "stratagem.cli.compare._launches",
    "Job": "stratagem.cli.compare._columns",
    "MB": "stratagem.cli.compare._measuring",
    "SHORTHAND_OPTION": "stratagem.registry._labels",
    "check_columns": "stratagem.cli.compare._launches",
    "current_rss_bytes": "stratagem.cli.compare._measuring",
    "default_warmup": "stratagem.cli.compare._columns",
    "format_table": "stratagem.cli.compare._report",
    "gradient_bytes": "stratagem.cli.compare._measuring",
    "load_model_factory": "stratagem.cli.compare._model_choice",
    "local_bytes": "stratagem.cli.compare._measuring",
    "optimizer_bytes": "stratagem.cli.compare._measuring",
    "parameter_bytes": "stratagem.cli.compare._measuring",
    "parse_columns": "stratagem.cli.compare._columns",
    "peak_rss_bytes": "stratagem.cli.compare._measuring",
    "plot": "stratagem.cli.compare._report",
    "require_matplotlib": "stratagem.cli.compare._report",
    "run": "stratagem.cli.compare._launches",
    "table_rows": "stratagem.cli.compare._report",
    "to_json": "stratagem.cli.compare._report",
    "with_suppress": "stratagem.cli.compare._launches",
}

__getattr__ = lazy_getattr(__name__, _LAZY, globals())
