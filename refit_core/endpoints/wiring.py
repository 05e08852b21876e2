"""How a rank's part of the schedule becomes its executors: network rounds apart from colocated messages,
the executors' settings, and one step's stats over both parts."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from refit_core.contract.errors import RefitError
from refit_core.contract.options import RefitOptions
from refit_core.net.transport.registry import transport_type
from refit_core.plan.items import Message
from refit_core.plan.schedule import Schedule
from refit_core.run.colocated import ColocatedReceiver, ColocatedSender
from refit_core.run.executor import ExecutorSettings, StepStats
from refit_core.run.ipc import ColocatedPath

COLOCATED_KIND = "ipc"
"""The registered name of the colocated path."""


def colocated_path() -> ColocatedPath:
    """The colocated path (CUDA IPC / shared memory), found through the transport registry as any kind is
    (its entry point ``ipc`` under ``refit.transports``); :class:`RefitError` if what is registered there
    builds no colocated ends."""
    kind = transport_type(COLOCATED_KIND)
    if not isinstance(kind, ColocatedPath):
        raise RefitError(f"the transport registered as {COLOCATED_KIND!r} ({type(kind).__name__}) is no colocated "
                         "path: refit's colocated pairs need refit_core.run.ipc:IPC there")
    return kind


def executor_settings(schedule: Schedule, settings: RefitOptions) -> ExecutorSettings:
    """The network executors' settings from the agreed ``settings`` (resolved: ``bucket_bytes`` is set)."""
    assert settings.bucket_bytes is not None
    return ExecutorSettings(settings.bucket_bytes, settings.num_buffers, settings.messages.zero_copy,
                            schedule.fingerprint, settings.timeout_s, settings.mode)


def split_rounds(rounds: list[list[Message]], network: Callable[[Message], bool]
                 ) -> tuple[list[list[Message]], list[Message]]:
    """A rank's rounds split into the network part (rounds kept in order) and the colocated messages."""
    kept, colocated = [], []
    for msgs in rounds:
        net = [m for m in msgs if network(m)]
        colocated += [m for m in msgs if not network(m)]
        if net:
            kept.append(net)
    return kept, colocated


def by_peer(messages: Sequence[Message], peer: Callable[[Message], int]) -> dict[int, list[Message]]:
    """``messages`` grouped by their ``peer`` rank, each group in the order given."""
    out: dict[int, list[Message]] = {}
    for m in messages:
        out.setdefault(peer(m), []).append(m)
    return out


def combined_stats(network: StepStats | None, version: int, colocated: ColocatedSender | ColocatedReceiver | None,
                   start: float) -> StepStats:
    """One rank's stats of a step over its network part and its colocated part (started at ``start``)."""
    extra = colocated.nbytes if colocated is not None else 0
    if network is None:
        return StepStats(version, extra, time.perf_counter() - start, 0, extra)
    return StepStats(network.version, network.bytes + extra, time.perf_counter() - start,
                     network.staging_bytes, network.direct_bytes + extra)


__all__ = ["COLOCATED_KIND", "by_peer", "colocated_path", "combined_stats", "executor_settings", "split_rounds"]
