"""The randomized fault campaign (``tests/faults/campaign.py``) at scale: a few hundred runs, then the census.

    python benchmarks/fault_campaign.py --runs 300 --seed 1 [--out benchmarks/results/fault-campaign-cpu.md]

Exits non-zero if the census finds a problem (torn weights unreported, an engine serving split weights, a
survivor past its deadline or hung).
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
    from campaign import campaign

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    start = time.monotonic()

    def progress(index, run, census):
        print(f"\r{index + 1}/{args.runs} runs, {len(census.problems)} problems, "
              f"{time.monotonic() - start:.0f} s", end="" if sys.stdout.isatty() else "\n", flush=True)

    census = campaign(args.runs, args.seed, progress)
    print()
    text = (f"# Fault campaign: {args.runs} runs, seed {args.seed}\n\n"
            f"{platform.node()} ({platform.machine()}, Python {platform.python_version()}), "
            f"{time.monotonic() - start:.0f} s\n\n```\n{census.summary()}\n```\n")
    print(text)
    if args.out:
        args.out.write_text(text)
    return 1 if census.problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
