"""Reporting: the table, JSON and the bar chart."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from stratagem.cli.compare._launches import ColumnResult
from stratagem.cli.compare._measuring import MB
from stratagem.errors import ConfigurationError


def _mb(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value / MB:,.1f}" if value < 10 * MB else f"{value / MB:,.0f}"


def table_rows(results: Sequence[ColumnResult]) -> list[tuple[str, list[str]]]:
    """The rows of the table (label, one cell per column); memory is the largest rank's."""
    cuda = any(r.ranks[0].get("cuda_max_allocated_bytes") is not None for r in results)
    first = results[0]

    def ratio(key: str) -> list[str]:
        base = first.largest(key)
        return [
            "-" if not base or r.largest(key) is None else f"{r.largest(key) / base:.2f}x" for r in results
        ]

    rows: list[tuple[str, list[str]]] = [
        ("Params + grads + optimizer (MB)", [_mb(r.largest("state_bytes")) for r in results]),
        (f"  vs {first.column.label}", ratio("state_bytes")),
    ]
    if cuda:
        rows += [
            ("Peak CUDA memory (MB)", [_mb(r.largest("cuda_max_allocated_bytes")) for r in results]),
            (f"  vs {first.column.label}", ratio("cuda_max_allocated_bytes")),
        ]
    rows += [
        ("Peak RSS (MB)", [_mb(r.largest("peak_rss_bytes")) for r in results]),
        ("Peak RSS above baseline (MB)", [_mb(r.largest("peak_rss_above_baseline_bytes")) for r in results]),
        (f"  vs {first.column.label}", ratio("peak_rss_above_baseline_bytes")),
        ("Iterations per second", [f"{r.iterations_per_second:.2f}" for r in results]),
        # Ranks that split layers share their samples, so a step of theirs covers fewer of them.
        ("Samples per step (all ranks)", [_samples(r) for r in results]),
    ]
    return rows


def _samples(result: ColumnResult) -> str:
    value = result.ranks[0].get("samples_per_step")
    return "-" if value is None else str(value)


def format_table(results: Sequence[ColumnResult], *, model: str, devices: int, steps: int) -> str:
    rows = table_rows(results)
    header = ["", *[r.column.label for r in results]]
    cells = [header, *[[label, *values] for label, values in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = []
    for i, row in enumerate(cells):
        lines.append(
            "  ".join(
                cell.ljust(widths[j]) if j == 0 else cell.rjust(widths[j]) for j, cell in enumerate(row)
            ).rstrip()
        )
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    accelerator = "CUDA" if results[0].ranks[0].get("cuda_max_allocated_bytes") is not None else "CPU"
    allocator = results[0].ranks[0].get("allocator_env") or {}
    notes = [
        f"model {model}, {devices} process(es) on {accelerator}, {steps} steps "
        f"(iterations per second after {results[0].warmup} warm-up steps, rank 0).",
        "Memory is per rank (the largest rank's); baseline = RSS after the process group, before the model.",
        "Each data-parallel rank draws its own batch; ranks that split layers (tensor parallel) share one.",
    ]
    if accelerator == "CPU":
        setting = ", ".join(f"{k}={v}" for k, v in sorted(allocator.items())) or "glibc default"
        notes.append(f"Allocator: {setting}.")
    return "\n".join([*lines, "", *notes])


def to_json(
    results: Sequence[ColumnResult], *, model: str, devices: int, steps: int, batch_size: int
) -> dict[str, Any]:
    import torch

    return {
        "model": model,
        "devices": devices,
        "steps": steps,
        "batch_size": batch_size,
        "accelerator": "cuda" if results[0].ranks[0].get("cuda_max_allocated_bytes") is not None else "cpu",
        "torch": torch.__version__,
        "columns": [r.to_json() for r in results],
    }


def require_matplotlib() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ConfigurationError(
            "--plot needs matplotlib, which is not installed. Install it with: pip install 'stratagem[plot]'"
        ) from None
    return matplotlib


def plot(results: Sequence[ColumnResult], path: str, *, model: str, devices: int) -> None:
    """A bar chart of the table: memory per rank (MB) on the left, iterations per second on the right."""
    require_matplotlib().use("Agg")
    import matplotlib.pyplot as plt

    labels = [r.column.label for r in results]
    cuda = results[0].ranks[0].get("cuda_max_allocated_bytes") is not None
    series = [("params + grads + optimizer", "state_bytes")]
    if cuda:
        series.append(("peak CUDA allocated", "cuda_max_allocated_bytes"))
    series += [("peak RSS", "peak_rss_bytes"), ("peak RSS above baseline", "peak_rss_above_baseline_bytes")]
    fig, (left, right) = plt.subplots(
        1, 2, figsize=(max(8.0, 2.2 * len(labels) + 4), 4.8), gridspec_kw={"width_ratios": [3, 2]}
    )
    width = 0.8 / len(series)
    for i, (name, key) in enumerate(series):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(labels))]
        values = [(r.largest(key) or 0) / MB for r in results]
        bars = left.bar(xs, values, width, label=name)
        left.bar_label(bars, fmt="%.0f", fontsize=7)
    left.set_xticks(range(len(labels)), labels, rotation=20, ha="right")
    left.set_xlabel("strategy")
    left.set_ylabel("memory per rank (MB)")
    left.set_title("Memory per rank (largest rank)")
    top = max((r.largest(key) or 0) / MB for _, key in series for r in results)
    # Head room above the tallest bar keeps the legend clear of the bars.
    left.set_ylim(0, top * 1.45 or 1)
    left.legend(fontsize=8, loc="upper right")
    speeds = [r.iterations_per_second for r in results]
    bars = right.bar(range(len(labels)), speeds, 0.6, color="tab:green")
    right.bar_label(bars, fmt="%.2f", fontsize=8)
    right.set_xticks(range(len(labels)), labels, rotation=20, ha="right")
    right.set_xlabel("strategy")
    right.set_ylabel("iterations per second (it/s)")
    right.set_title("Training speed")
    fig.suptitle(f"stratagem compare: model {model}, {devices} process(es), {'CUDA' if cuda else 'CPU'}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
