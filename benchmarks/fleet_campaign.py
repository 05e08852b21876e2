"""The randomized fleet campaign (``tests/faults/fleet_campaign.py``) at scale: a few hundred runs, then the census.

    nice -n 19 python benchmarks/fleet_campaign.py --runs 300 --seed 1 --workers 3 \
        [--out benchmarks/results/fleet-campaign-cpu.md]

Each run: 1 or 2 train ranks refit 3 toy replicas (1 or 2 ranks each) for 6 steps over gloo, in a random mode,
with one or two membership strikes: a replica rank killed or stopped at a random point of a step (and maybe
restarted under its name), a replica added, an impostor under a live name. In half the runs the trainers feed one
replica, which forwards each step to the other two (a relay tree), and half the rank strikes there hit that relay
parent (in its own transfer, while it forwards, around its commit). Exits non-zero if the census finds a problem
(a replica reported landed that does not hold the step bitwise, train ranks that disagree, a step past its
deadline, a run that hung, a replica out though no strike hit it nor a feeder above it, a dead replica kept, a
rejoin not back within a step, an impostor admitted).
"""

from __future__ import annotations

import campaign_cli


def main() -> int:
    from fleet_campaign import campaign

    return campaign_cli.run(__doc__.splitlines()[0], "Fleet campaign", campaign, workers=3)


if __name__ == "__main__":
    raise SystemExit(main())
