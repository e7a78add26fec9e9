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

from stratagem._labels import SHORTHAND_OPTION
from stratagem.compare._columns import Column, Job, default_warmup, parse_columns
from stratagem.compare._measuring import (
    MB,
    current_rss_bytes,
    gradient_bytes,
    local_bytes,
    optimizer_bytes,
    parameter_bytes,
    peak_rss_bytes,
)
from stratagem.compare._models import load_model_factory
from stratagem.compare._report import format_table, plot, require_matplotlib, table_rows, to_json
from stratagem.compare._run import ColumnResult, check_columns, run, with_suppress

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
