"""The plan as a rich table, with a line per strategy that has something the table cannot say."""

from __future__ import annotations

from typing import Any

from stratagem.planning import format_bytes
from stratagem.planning._table import HEADERS, notes, rows


def print_plan(plan: Any) -> None:
    from rich.console import Console
    from rich.table import Table

    world = plan.world
    memory = "" if plan.memory is None else f", {format_bytes(plan.memory)} per device"
    title = (
        f"{plan.model}: {plan.parameter_count / 1e9:.3g} B parameters on {world.size} device(s) "
        f"({world.nodes} x {world.devices}){memory}; {world.precision}, {world.optimizer}, micro-batch "
        f"{world.batch_size} x {world.sequence_length}"
    )
    table = Table(title=title, title_justify="left")
    for header in HEADERS:
        table.add_column(header, justify="left" if header == "strategy" else "right")
    for cells in rows(plan):
        style = {"yes": "green", "no": "red"}.get(cells[-1], "dim" if cells[1] == "-" else None)
        table.add_row(*cells, style=style)
    console = Console()
    console.print(table)
    console.print(
        "Each row: the rank holding the most, per device, in binary units (parameters include buffers)."
    )
    for line in notes(plan):
        console.print(f"  {line}", markup=False, highlight=False)
