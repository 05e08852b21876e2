"""Planning from metadata alone: HF config + parallel layouts, no model built, no tensor allocated."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from refit_core.contract.backend import GEN, TRAIN
from refit_core.contract.env import with_overrides
from refit_core.contract.experts import group_side
from refit_core.contract.layout import ParallelLayout
from refit_core.contract.lora import LoraMode, LoraSpec
from refit_core.contract.options import RefitOptions
from refit_core.contract.pieces import DestinationPiece, PieceMeta
from refit_core.contract.plugins import PluginManager
from refit_core.plan.gcpause import gc_paused
from refit_core.plan.lora import adapter_metas
from refit_core.plan.planning import plan_with_relay
from refit_core.plan.relay import RelayPlan
from refit_core.plan.schedule import Schedule
from refit_core.units import format_bytes

Progress = Callable[[str], None]


@dataclass
class PlanSummary:
    """A plan's schedule and what planning cost.

    ``seconds`` is wall time from the first layout hook to the schedule; ``describe_s`` the part the
    plugins' layout hooks took (every rank's pieces); ``cpu_s`` and ``describe_cpu_s`` the process' CPU
    time over the same spans (the one-core cost, whatever else runs on the machine);
    ``peak_rss_bytes`` the process' peak resident memory so far.
    """

    schedule: Schedule
    train_ranks: int
    gen_ranks: int
    seconds: float
    describe_s: float = 0.0
    cpu_s: float = 0.0
    describe_cpu_s: float = 0.0
    peak_rss_bytes: int = 0
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
            f"planned in:   {self.seconds:.3f} s, {self.cpu_s:.3f} s CPU (layout hooks {self.describe_cpu_s:.3f} s, "
            f"planner and schedule {self.cpu_s - self.describe_cpu_s:.3f} s)",
            f"peak memory:  {format_bytes(self.peak_rss_bytes)} (the process' resident set)",
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
                       device: str = "cpu", progress: Progress | None = None,
                       lora: LoraSpec | None = None) -> PlanSummary:
    """Every rank's pieces from the plugins' layout hooks, then the same planner as a live refit.

    ``options`` (default ``RefitOptions()``, with the environment's overrides, as a live refit takes
    them) are resolved for a train rank 0 on ``device``, so the plan and its fingerprint are those of
    a live refit with the same options there. ``progress`` receives a line now and then on large layouts.
    ``lora`` in adapter mode plans the adapter's tensors only: the gen backend's own adapter map where its
    plugin states one (``refit_adapter_destination_layout``, e.g. vLLM's LoRA slots), else derived from the
    base layouts (:func:`refit_core.plan.lora.adapter_metas`); in merged mode (or None) the model's.
    """
    settings = with_overrides(options or RefitOptions()).resolved(device)
    assert settings.bucket_bytes is not None  # resolved above
    start, cpu_start = time.perf_counter(), time.process_time()
    with gc_paused():
        pm.backend(train, TRAIN)
        pm.backend(gen, GEN)
        src: list[list[PieceMeta]] = []
        tick = _every_tenth(train_layout.world_size, progress, TRAIN)
        for r in range(train_layout.world_size):
            src.append([p.meta for p in pm.source_layout(train, config, train_layout, r)])
            tick(r + 1)
        adapter = lora if lora is not None and lora.mode is LoraMode.ADAPTER else None
        dst: list[list[PieceMeta]] = []
        slots: list[bool] = []  # per gen rank: the engine stated its own adapter map (not derived below)
        tick = _every_tenth(gen_layout.world_size, progress, GEN)
        for r in range(gen_layout.world_size):
            mapping = (pm.adapter_destination_layout(gen, config, gen_layout, r, adapter)
                       if adapter is not None else None)
            slots.append(mapping is not None)
            if mapping is None:
                mapping = pm.destination_layout(gen, config, gen_layout, r)
            dst.append([p.meta for p in mapping.pieces]
                       + [DestinationPiece(s, s.full_box()).meta for s in mapping.loader])
            tick(r + 1)
        if adapter is not None:
            src = adapter_metas(src, adapter)
            derived = iter(adapter_metas([m for m, own in zip(dst, slots) if not own], adapter)
                           if not all(slots) else [])
            dst = [m if own else next(derived) for m, own in zip(dst, slots)]
        described, described_cpu = time.perf_counter(), time.process_time()
        if progress is not None and len(src) + len(dst) >= 64:
            progress(f"planning {sum(map(len, src))} source and {sum(map(len, dst))} destination pieces")
        grouped_src, grouped_dst = group_side(src, pm.expert_name), group_side(dst, pm.expert_name)
        schedule, relay = plan_with_relay(grouped_src.metas, grouped_dst.metas, settings,
                                          expert_groups=set(grouped_src.counts) | set(grouped_dst.counts))
    return PlanSummary(schedule, len(src), len(dst), time.perf_counter() - start, described - start,
                       time.process_time() - cpu_start, described_cpu - cpu_start, peak_rss_bytes(), relay)


def peak_rss_bytes() -> int:
    """This process' peak resident memory (0 where the platform does not say)."""
    try:
        import resource
    except ImportError:  # not on POSIX
        return 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux
