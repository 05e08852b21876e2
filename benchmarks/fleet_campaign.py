"""The randomized fleet campaign (``tests/faults/fleet_campaign.py``) at scale: a few hundred runs, then the census.

    nice -n 19 python benchmarks/fleet_campaign.py --runs 300 --seed 1 --workers 3 \
        [--out benchmarks/results/fleet-campaign-cpu.md]

Each run: 1 or 2 train ranks refit 3 toy replicas (1 or 2 ranks each) for 6 steps over gloo, in a random mode,
with one or two membership strikes: a replica rank killed or stopped at a random point of a step (and maybe
restarted under its name), a replica added, an impostor under a live name. No relay parent is struck: a fleet
feeds every replica from the trainers directly. Exits non-zero if the census finds a problem (a replica reported
landed that does not hold the step bitwise, train ranks that disagree, a step past its deadline, a run that hung,
a replica out though no strike hit it, a dead replica kept, a rejoin not back within a step, an impostor admitted).
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests" / "faults"), str(ROOT / "tests" / "example_plugin"), str(ROOT)]


def main() -> int:
    from fleet_campaign import campaign

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=4.0, help="each step's deadline (timeout_s)")
    parser.add_argument("--workers", type=int, default=3, help="runs at a time (their ranks mostly wait)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    start = time.monotonic()

    def progress(index, run, census):
        print(f"\r{index + 1}/{args.runs} runs, {len(census.problems)} problems, "
              f"{time.monotonic() - start:.0f} s", end="" if sys.stdout.isatty() else "\n", flush=True)

    census = campaign(args.runs, args.seed, progress, timeout_s=args.timeout, workers=args.workers)
    print()
    text = (f"# Fleet campaign: {args.runs} runs, seed {args.seed}, timeout_s={args.timeout:g}, "
            f"{args.workers} at a time\n\n"
            f"{platform.node()} ({platform.machine()}, Python {platform.python_version()}), "
            f"{time.monotonic() - start:.0f} s\n\n```\n{census.summary()}\n```\n")
    print(text)
    if args.out:
        args.out.write_text(text)
    return 1 if census.problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
