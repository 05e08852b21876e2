"""The randomized fault campaign (``tests/faults/campaign.py``) at scale: a few hundred runs, then the census.

    nice -n 19 python benchmarks/fault_campaign.py --runs 300 --seed 1 --workers 4 \
        [--out benchmarks/results/fault-campaign-cpu.md]

Some runs strike a memory fault instead (one rank's model rebinds, ``set_()``s, resizes or frees a tensor before
the second step). Exits non-zero if the census finds a problem (a silent stale send, an engine serving split
weights, torn weights unreported, a byte of another job, a survivor past its deadline or hung, a recovery not
bitwise, a memory fault not named on every rank or that moved bytes).
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
    parser.add_argument("--timeout", type=float, default=4.0, help="each step's deadline (timeout_s)")
    parser.add_argument("--workers", type=int, default=2, help="runs at a time (their ranks mostly wait)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    start = time.monotonic()

    def progress(index, run, census):
        print(f"\r{index + 1}/{args.runs} runs, {len(census.problems)} problems, "
              f"{time.monotonic() - start:.0f} s", end="" if sys.stdout.isatty() else "\n", flush=True)

    census = campaign(args.runs, args.seed, progress, timeout_s=args.timeout, workers=args.workers)
    print()
    text = (f"# Fault campaign: {args.runs} runs, seed {args.seed}, timeout_s={args.timeout:g}, "
            f"{args.workers} at a time\n\n"
            f"{platform.node()} ({platform.machine()}, Python {platform.python_version()}), "
            f"{time.monotonic() - start:.0f} s\n\n```\n{census.summary()}\n```\n")
    print(text)
    if args.out:
        args.out.write_text(text)
    return 1 if census.problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
