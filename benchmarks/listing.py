"""How long `stratagem strategies` takes as a whole process, against importing torch and listing Lightning's.

    python benchmarks/listing.py [--repeats 15] [--no-certified]

Prints the median wall time of each command and the ratios, measured in the same run, and checks that the
listing imported no torch. Unless --no-certified, it first makes a plugin that ships its certificate, as an
author does (`stratagem new`, pip, `stratagem contract --report`, the certificate in the package, pip again:
about 30 s), and times the listing with it on the path too, alternating with the plain listing.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import median, python, table, time_command

LIGHTNING = "from lightning.pytorch.strategies import StrategyRegistry; print(len(StrategyRegistry.available_strategies()))"


def probe_code() -> str:
    return (
        "import sys,io,contextlib\nfrom stratagem.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()): main(['strategies'])\nprint('torch' in sys.modules)"
    )


def certified_plugin(work: Path) -> dict[str, str]:
    """Install a generated strategy that ships the certificate the suite wrote for it; its environment."""
    name, site = "bench_certified", work / "site"
    package = work / name / "src" / f"stratagem_{name}"
    pip = [python(), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(site)]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])),
    }
    subprocess.run([python(), "-m", "stratagem", "new", "strategy", name], cwd=work, check=True)
    subprocess.run([*pip, str(work / name)], check=True, cwd=work)
    report = package / "stratagem-certificate.json"
    subprocess.run(
        [python(), "-m", "stratagem", "contract", name, "--report", str(report), "--pytest-args=-q"],
        check=True,
        cwd=work,
        env=env,
        capture_output=True,
    )
    subprocess.run([*pip, "--upgrade", str(work / name)], check=True, cwd=work)
    return env


def alternating(
    commands: dict[str, tuple[list[str], dict[str, str] | None]], repeats: int
) -> dict[str, list[float]]:
    """Wall times of each command, one run of each per round, the order reversed every other round."""
    for argv, env in commands.values():  # warm-up
        subprocess.run(argv, check=True, capture_output=True, env=env)
    times: dict[str, list[float]] = {label: [] for label in commands}
    for round_ in range(repeats):
        for label in list(commands) if round_ % 2 == 0 else list(reversed(commands)):
            argv, env = commands[label]
            start = time.perf_counter()
            subprocess.run(argv, check=True, capture_output=True, env=env)
            times[label].append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument(
        "--no-certified", action="store_true", help="skip the plugin that ships a certificate"
    )
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
        [python(), "-c", probe_code()], capture_output=True, text=True, check=True
    ).stdout.strip()

    listing = [python(), "-m", "stratagem", "strategies"]
    runs: dict[str, list[float]] = {}
    certified_note = ""
    with tempfile.TemporaryDirectory() as work:
        if not args.no_certified:
            env = certified_plugin(Path(work))
            shown = subprocess.run(listing, capture_output=True, text=True, check=True, env=env).stdout
            line = next(line for line in shown.splitlines() if "stratagem-bench-certified" in line)
            with_it = subprocess.run(
                [python(), "-c", probe_code()], capture_output=True, text=True, check=True, env=env
            ).stdout.strip()
            certified_note = f"certified plugin's entry: {line.strip()[:60]}...; torch imported: {with_it}"
            pair = alternating(
                {
                    "stratagem strategies": (listing, None),
                    "+ a plugin shipping its certificate": (listing, env),
                },
                args.repeats,
            )
            runs.update(pair)
    others = {"python -c 'import torch'": [python(), "-c", "import torch"]}
    if "stratagem strategies" not in runs:
        others = {"stratagem strategies": listing, **others}
    if importlib.util.find_spec("lightning") is not None:
        others["lightning: list strategies"] = [python(), "-c", LIGHTNING]
    runs.update({label: time_command(argv, args.repeats) for label, argv in others.items()})
    medians = {label: median(times) for label, times in runs.items()}
    base = medians["stratagem strategies"]
    rows = [
        (
            label,
            f"{m * 1000:.0f} ms",
            f"{min(runs[label]) * 1000:.0f}-{max(runs[label]) * 1000:.0f} ms",
            f"{m / base:.2f}x",
        )
        for label, m in medians.items()
    ]
    print(f"{len(names)} strategies listed ({', '.join(names)}); torch imported by the listing: {probe}")
    if certified_note:
        print(certified_note)
    print(table(rows, ["command", "median", "min-max", "vs stratagem strategies"]))
    if "lightning: list strategies" not in medians:
        print("(lightning not installed: pip install lightning==2.6.6 to add its row)")
    listings = ("stratagem strategies", "+ a plugin shipping its certificate")
    worst = max(m for label, m in medians.items() if label in listings)
    verdict = "meets" if worst < 0.15 else "MISSES"
    print(f"target: median under 150 ms -> {worst * 1000:.0f} ms (the slower listing), {verdict} it")


if __name__ == "__main__":
    main()
