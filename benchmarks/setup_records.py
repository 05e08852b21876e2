"""What setup moves through the store at world sizes too large to launch here: real-shape layouts
described by the plugins' layout hooks (no model built), planned once as train rank 0 does, and
sliced into every rank's part of the plan (:mod:`refit_core.plan.rankplan`).

Printed per case: the world, the plan's segments, the planner's time to plan and to slice and encode
every rank's record, the bytes it publishes in all, the largest and the median rank's record (what
that rank reads), and the metadata of every rank (what the planner reads; before plan-once, what
every rank read).

    .venv/bin/python benchmarks/setup_records.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

from refit_core.contract.backend import GEN, TRAIN
from refit_core.contract.experts import group_side
from refit_core.contract.layout import parse_backend_layout
from refit_core.contract.options import RefitOptions
from refit_core.contract.pieces import DestinationPiece, PieceMeta
from refit_core.contract.plugins import get_plugin_manager
from refit_core.kit.models import load_config
from refit_core.net import wire
from refit_core.plan import codec, rankplan
from refit_core.plan.links import Link
from refit_core.plan.planning import plan_with_relay
from refit_core.plan.relay import RelayPlan
from refit_core.plan.schedule import Schedule

CASES = [
    ("llama-3-8b-shape", "dtensor:fsdp=8,tp=2", "vllm:tp=4,dp=2"),
    ("qwen3-30b-a3b-shape", "dtensor:fsdp=16,tp=8", "vllm:tp=8"),
]


@dataclass(frozen=True)
class Planned:
    """A case planned from metadata as train rank 0 plans it: every rank's (expert-grouped) piece metadata,
    the schedule and its relay, and the planner's time."""

    metas: dict[str, list[list[PieceMeta]]]
    counts: dict[str, dict[str, int]]
    schedule: Schedule
    relay: RelayPlan | None
    plan_s: float
    metadata_bytes: int


def plan_case(model: str, train: str, gen: str) -> Planned:
    """Plan ``model`` (a shape :func:`load_config` knows) from ``train`` to ``gen`` (``backend:layout``)
    over the plugins' layout hooks: no model is built."""
    pm = get_plugin_manager()
    config = load_config(model)
    (tb, tl), (gb, gl) = parse_backend_layout(train), parse_backend_layout(gen)
    pm.backend(tb, TRAIN)
    pm.backend(gb, GEN)
    metas: dict[str, list[list[PieceMeta]]] = {
        TRAIN: [[p.meta for p in pm.source_layout(tb, config, tl, r)] for r in range(tl.world_size)], GEN: []}
    for r in range(gl.world_size):
        mapping = pm.destination_layout(gb, config, gl, r)
        metas[GEN].append([p.meta for p in mapping.pieces] + [DestinationPiece(s, s.full_box()).meta
                                                              for s in mapping.loader])
    metadata = sum(len(wire.encode(codec.metas_to_wire(m))) for side in (TRAIN, GEN) for m in metas[side])
    settings = RefitOptions().resolved("cuda")
    began = time.perf_counter()
    grouped = {side: group_side(metas[side], pm.expert_name) for side in (TRAIN, GEN)}
    schedule, relay = plan_with_relay(grouped[TRAIN].metas, grouped[GEN].metas, settings,
                                      expert_groups=set(grouped[TRAIN].counts) | set(grouped[GEN].counts))
    return Planned({side: grouped[side].metas for side in (TRAIN, GEN)},
                   {side: grouped[side].counts for side in (TRAIN, GEN)}, schedule, relay,
                   time.perf_counter() - began, metadata)


def measure(model: str, train: str, gen: str) -> dict[str, Any]:
    planned = plan_case(model, train, gen)
    schedule, relay = planned.schedule, planned.relay
    links = {(m.src, m.dst): Link.NETWORK for msgs in schedule.rounds for m in msgs}
    facts = rankplan.PlanFacts(schedule.fingerprint, schedule.num_src, schedule.num_dst, schedule.bucket_bytes,
                               schedule.summary, True, planned.counts, None)
    began = time.perf_counter()
    record = rankplan.facts_to_wire(facts)
    sizes = [len(wire.encode(rankplan.to_wire(part, record)))
             for part in rankplan.rank_plans(facts, schedule, relay, links, planned.metas, {})]
    slice_s = time.perf_counter() - began
    return {"case": f"{model} {train} -> {gen}", "world": schedule.num_src + schedule.num_dst,
            "segments": schedule.summary.segments, "plan_s": planned.plan_s, "slice_s": slice_s,
            "published": sum(sizes), "record_max": max(sizes), "record_median": statistics.median(sizes),
            "metadata": planned.metadata_bytes}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=len(CASES), help="run the first N cases")
    args = parser.parse_args()
    print("| case | world | plan segments | planner: plan | planner: slice + encode | published | record max "
          "| record median | every rank's metadata (planner reads) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for case in CASES[:args.cases]:
        r = measure(*case)
        print(f"| {r['case']} | {r['world']} | {r['segments']} | {r['plan_s']:.2f} s | {r['slice_s']:.2f} s "
              f"| {r['published'] / 2**20:.2f} MiB | {r['record_max'] / 1024:.1f} KiB "
              f"| {r['record_median'] / 1024:.1f} KiB | {r['metadata'] / 2**20:.2f} MiB |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
