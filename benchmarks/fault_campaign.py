"""The randomized fault campaign (``tests/faults/campaign.py``) at scale: a few hundred runs, then the census.

    nice -n 19 python benchmarks/fault_campaign.py --runs 300 --seed 1 --workers 4 \
        [--out benchmarks/results/fault-campaign-cpu.md]

Some runs strike a memory fault instead (one rank's model rebinds, ``set_()``s, resizes or frees a tensor before
the second step). Exits non-zero if the census finds a problem (a silent stale send, an engine serving split
weights, torn weights unreported, a byte of another job, a survivor past its deadline or hung, a recovery not
bitwise, a memory fault not named on every rank or that moved bytes).
"""

from __future__ import annotations

import campaign_cli


def main() -> int:
    from campaign import campaign

    return campaign_cli.run(__doc__.splitlines()[0], "Fault campaign", campaign, workers=2)


if __name__ == "__main__":
    raise SystemExit(main())
