"""How long `stratagem strategies` takes as a whole process, against importing torch and listing Lightning's.

    python benchmarks/listing.py [--repeats 15]

Prints the median wall time of each command and the ratios, measured in the same run, and checks that the
listing imported no torch.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import median, python, table, time_command

LIGHTNING = "from lightning.pytorch.strategies import StrategyRegistry; print(len(StrategyRegistry.available_strategies()))"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()

    listing = json.loads(
        subprocess.run(
            [python(), "-m", "stratagem", "strategies", "--json"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    names = [row["name"] for row in listing["strategies"]]
    probe = subprocess.run(
        [
            python(),
            "-c",
            "import sys,io,contextlib\nfrom stratagem.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()): main(['strategies'])\nprint('torch' in sys.modules)",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()

    commands = {
        "stratagem strategies": [python(), "-m", "stratagem", "strategies"],
        "python -c 'import torch'": [python(), "-c", "import torch"],
    }
    if importlib.util.find_spec("lightning") is not None:
        commands["lightning: list strategies"] = [python(), "-c", LIGHTNING]
    medians = {label: median(time_command(argv, args.repeats)) for label, argv in commands.items()}
    base = medians["stratagem strategies"]
    rows = [(label, f"{m * 1000:.0f} ms", f"{m / base:.2f}x") for label, m in medians.items()]
    print(f"{len(names)} strategies listed ({', '.join(names)}); torch imported by the listing: {probe}")
    print(table(rows, ["command", "median", "vs stratagem strategies"]))
    if "lightning: list strategies" not in medians:
        print("(lightning not installed: pip install lightning==2.6.6 to add its row)")
    verdict = "meets" if base < 0.25 else "MISSES"
    print(f"target: median under 250 ms -> {base * 1000:.0f} ms, {verdict} it")


if __name__ == "__main__":
    main()
