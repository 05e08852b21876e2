"""The command line both randomized campaigns share (``fault_campaign.py``, ``fleet_campaign.py``): run a few
hundred runs with progress, print the census, write it to ``--out``, exit non-zero on a problem."""

from __future__ import annotations

import argparse
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests" / "faults"), str(ROOT / "tests" / "example_plugin"), str(ROOT)]


def run(description: str, title: str, campaign: Callable[..., Any], workers: int) -> int:
    """Parse the campaign's options, run it, print and keep its census (``title``: its Markdown heading's name)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=4.0, help="each step's deadline (timeout_s)")
    parser.add_argument("--workers", type=int, default=workers, help="runs at a time (their ranks mostly wait)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    start = time.monotonic()

    def progress(index: int, run: Any, census: Any) -> None:
        print(f"\r{index + 1}/{args.runs} runs, {len(census.problems)} problems, "
              f"{time.monotonic() - start:.0f} s", end="" if sys.stdout.isatty() else "\n", flush=True)

    census = campaign(args.runs, args.seed, progress, timeout_s=args.timeout, workers=args.workers)
    print()
    text = (f"# {title}: {args.runs} runs, seed {args.seed}, timeout_s={args.timeout:g}, "
            f"{args.workers} at a time\n\n"
            f"{platform.node()} ({platform.machine()}, Python {platform.python_version()}), "
            f"{time.monotonic() - start:.0f} s\n\n```\n{census.summary()}\n```\n")
    print(text)
    if args.out:
        args.out.write_text(text)
    return 1 if census.problems else 0
