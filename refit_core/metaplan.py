"""Planning from metadata alone: HF config + parallel layouts, no model built, no tensor allocated."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .backend import GEN, TRAIN
from .env import with_overrides
from .experts import group_side
from .layout import ParallelLayout
from .options import RefitOptions
from .pieces import DestinationPiece, PieceMeta
from .plugins import PluginManager
from .relay import RelayPlan, plan_with_relay
from .schedule import Schedule
from .units import format_bytes


Progress = Callable[[str], None]


@dataclass
class PlanSummary:
    """A plan's schedule and how long planning took."""

    schedule: Schedule
    train_ranks: int
    gen_ranks: int
    seconds: float
    relay: RelayPlan | None = None

    def lines(self) -> list[str]:
        s = self.schedule.summary
        return [
            f"ranks:        {self.train_ranks} train -> {self.gen_ranks} gen",
            f"bytes:        {format_bytes(s.bytes)} in {s.segments} segments",
            f"messages:     {s.messages} in {s.rounds} rounds (bucket {format_bytes(self.schedule.bucket_bytes)})",
            f"busiest:      sender {format_bytes(s.busiest_sender_bytes)}, "
            f"receiver {format_bytes(s.busiest_receiver_bytes)}",
            f"fingerprint:  {self.schedule.fingerprint}",
            f"planned in:   {self.seconds:.3f} s",
            *(self.relay.lines() if self.relay is not None else []),
        ]


def _every_tenth(total: int, progress: Progress | None, what: str) -> Callable[[int], None]:
    step = max(1, total // 10)

    def tick(done: int) -> None:
        if progress is not None and total >= 64 and (done % step == 0 or done == total):
            progress(f"described {done}/{total} {what} ranks")
    return tick


def plan_from_metadata(pm: PluginManager, config: dict[str, Any], train: str, train_layout: ParallelLayout,
                       gen: str, gen_layout: ParallelLayout, *, options: RefitOptions | None = None,
                       device: str = "cpu", progress: Progress | None = None) -> PlanSummary:
    """Every rank's pieces from the plugins' layout hooks, then the same planner as a live refit.

    ``options`` (default ``RefitOptions()``, with the environment's overrides, as a live refit takes
    them) are resolved for a train rank 0 on ``device``, so the plan and its fingerprint are those of
    a live refit with the same options there. ``progress`` receives a line now and then on large layouts.
    """
    settings = with_overrides(options or RefitOptions()).resolved(device)
    assert settings.bucket_bytes is not None  # resolved above
    start = time.perf_counter()
    pm.backend(train, TRAIN)
    pm.backend(gen, GEN)
    src: list[list[PieceMeta]] = []
    tick = _every_tenth(train_layout.world_size, progress, TRAIN)
    for r in range(train_layout.world_size):
        src.append([p.meta for p in pm.source_layout(train, config, train_layout, r)])
        tick(r + 1)
    dst: list[list[PieceMeta]] = []
    tick = _every_tenth(gen_layout.world_size, progress, GEN)
    for r in range(gen_layout.world_size):
        mapping = pm.destination_layout(gen, config, gen_layout, r)
        dst.append([p.meta for p in mapping.pieces]
                   + [DestinationPiece(s, s.full_box()).meta for s in mapping.loader])
        tick(r + 1)
    if progress is not None and len(src) + len(dst) >= 64:
        progress(f"planning {sum(map(len, src))} source and {sum(map(len, dst))} destination pieces")
    grouped_src, grouped_dst = group_side(src, pm.expert_name), group_side(dst, pm.expert_name)
    schedule, relay = plan_with_relay(grouped_src.metas, grouped_dst.metas, settings,
                                      expert_groups=set(grouped_src.counts) | set(grouped_dst.counts))
    return PlanSummary(schedule, len(src), len(dst), time.perf_counter() - start, relay)
