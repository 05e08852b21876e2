"""The reference of a fleet: NCCL's own broadcast of one replica's bytes from the train rank to every replica.

A refit of one train rank into N engine replicas of one layout lands the same bytes on every replica;
the collective made for that is a broadcast. ``broadcast`` moves, from the train rank's device, the bytes
one replica receives in a refit step to the same rank of every replica (one broadcast group per gen TP
rank), in buckets of refit's bucket size, each bucket a contiguous slice of one buffer. With several train
ranks no one rank holds a replica's bytes, and with one replica there is no fleet: the reference is then
the wire of the same bytes over the same pairs (:func:`broadcast_does_not_apply` says why).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from refit_core.contract.options import RefitOptions
from refit_core.tools.bench.comms import open_bench_comm
from refit_core.tools.bench.method import Method, current_stream
from refit_core.tools.bench.wire import payload, verify_checksums

NAME = "broadcast"


@dataclass(frozen=True)
class BroadcastGroup:
    """One broadcast: ``nbytes`` from the train rank ``members[0]`` to the other members, one gen rank of each
    replica (global rank numbers)."""

    members: tuple[int, ...]
    nbytes: int

    @property
    def root(self) -> int:
        return self.members[0]


@dataclass(frozen=True)
class BroadcastPlan:
    """Every broadcast of a step (one per gen TP rank) and the number of replicas each feeds."""

    groups: tuple[BroadcastGroup, ...]
    replicas: int

    @property
    def replica_bytes(self) -> int:
        """The bytes one replica receives (what refit moves per replica in a step)."""
        return sum(g.nbytes for g in self.groups)

    @property
    def landed_bytes(self) -> int:
        """The bytes a step lands on every replica together (what refit's row counts)."""
        return self.replica_bytes * self.replicas

    def of_rank(self, rank: int) -> tuple[BroadcastGroup, ...]:
        return tuple(g for g in self.groups if rank in g.members)


def _gen_groups(ranks: Sequence[Mapping[str, Any]]) -> dict[int, list[int]]:
    """The gen ranks (global numbers) by TP rank, one of each replica in each."""
    groups: dict[int, list[int]] = {}
    for r, spec in enumerate(ranks):
        if spec["side"] == "gen":
            groups.setdefault(spec["tp_rank"], []).append(r)
    return groups


def broadcast_does_not_apply(ranks: Sequence[Mapping[str, Any]], num_train: int) -> str | None:
    """Why the broadcast is no reference for a run of ``ranks`` (train ranks first), or None when it is."""
    if num_train != 1:
        return (f"{num_train} train ranks each hold a part of every replica, so no one rank broadcasts a replica; "
                "the reference is the wire of the same bytes over the same pairs")
    groups = _gen_groups(ranks)
    replicas = min(len(g) for g in groups.values())
    if replicas < 2:
        return "one replica, no fleet: the reference is the wire of the same bytes over the same pair"
    for members in groups.values():
        devices = [ranks[r]["device"] for r in (0, *members)]
        shared = sorted({d for d in devices if d != "cpu" and devices.count(d) > 1})
        if shared:
            return f"ranks of one broadcast share {', '.join(shared)}: NCCL cannot broadcast between them"
    return None


def broadcast_plan(ranks: Sequence[Mapping[str, Any]], nbytes_of: Callable[[int], int]) -> BroadcastPlan:
    """The broadcasts of a one-train-rank run of ``ranks``; ``nbytes_of(rank)``: a gen rank's model bytes
    (every replica's rank of one TP rank holds as many)."""
    groups = []
    for _, members in sorted(_gen_groups(ranks).items()):
        sizes = {nbytes_of(r) for r in members}
        if len(sizes) != 1:
            raise ValueError(f"replicas of unlike layout: gen ranks {members} hold {sorted(sizes)} bytes")
        groups.append(BroadcastGroup((0, *members), sizes.pop()))
    return BroadcastPlan(tuple(groups), replicas=len(groups[0].members) - 1)


def with_broadcast(methods: list[str], ranks: Sequence[Mapping[str, Any]],
                   num_train: int) -> tuple[list[str], str | None]:
    """``methods`` with the broadcast first wherever it is the run's fleet reference (added to a run of
    several replicas), else without it; and why it does not apply (None when it runs, or when a run of one
    replica did not ask for it)."""
    rest = [m for m in methods if m != NAME]
    why = broadcast_does_not_apply(ranks, num_train)
    fleet = sum(1 for spec in ranks if spec["side"] == "gen" and spec["tp_rank"] == 0) > 1
    if why is None:
        return [NAME, *rest], None
    return rest, (why if fleet or NAME in methods else None)


class Broadcast(Method):
    """NCCL's broadcast (gloo on CPU) of one replica's bytes from the train rank to every replica, bucket by
    bucket (:class:`BroadcastPlan`); the receivers check the bytes by checksum."""

    name = NAME
    checked_by_checksum = True

    buffer: torch.Tensor | None = None

    def setup(self) -> None:
        c = self.ctx
        plan = broadcast_plan(c.extra["ranks"], lambda r: int(c.store.get(f"bytes/{r}").decode()))
        bucket = int(RefitOptions(bucket_bytes=c.bucket_bytes).resolved(c.device.type).bucket_bytes or 0)
        own = plan.of_rank(c.rank)
        mine = [(i, group) for i, group in enumerate(plan.groups) if group in own]
        self.buffer, views = payload(c.device, c.is_train, [group.nbytes for _, group in mine])
        self.lanes: list[tuple[Any, torch.Tensor, str]] = []  # (comm, bytes, checksum key)
        for (i, group), view in zip(mine, views):
            comm = open_bench_comm(c.store, f"{self.name}/{i}", len(group.members), group.members.index(c.rank),
                                   c.device)
            self.lanes.append((comm, view, f"{self.name}/checksum/{i}"))
        self.buckets = [(comm, list(data.split(bucket))) for comm, data, _ in self.lanes]
        self.info.update(broadcast_bytes=plan.replica_bytes, bytes_moved=plan.landed_bytes,
                         broadcast_replicas=plan.replicas, broadcast_groups=len(plan.groups),
                         broadcast_buckets=sum(-(-g.nbytes // bucket) for g in plan.groups),
                         broadcast_bucket_bytes=bucket)

    def step(self, index: int) -> None:
        stream = current_stream(self.ctx.device)
        for comm, buckets in self.buckets:
            for data in buckets:
                comm.broadcast(data, 0, stream)

    def verify(self, checksum: Callable[[torch.Tensor], int]) -> str | None:
        """The train rank publishes each group's checksum; every replica's rank compares its own."""
        return verify_checksums(self.ctx.store, self.ctx.is_train, [(data, key) for _, data, key in self.lanes],
                                checksum)

    def close(self) -> None:
        for comm, _, _ in self.lanes:
            comm.close()
        self.lanes, self.buckets = [], []
        self.buffer = None
        if self.ctx.device.type == "cuda":
            torch.cuda.empty_cache()


__all__ = ["NAME", "Broadcast", "BroadcastGroup", "BroadcastPlan", "broadcast_does_not_apply", "broadcast_plan",
           "with_broadcast"]
