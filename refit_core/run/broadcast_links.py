"""A relay by broadcast as the executors see it: their data sends and receives become the groups' broadcasts.

With ``RelayOptions.broadcast`` the trainers' executors send to the first replica's ranks and every relayed
rank's executor receives the first replica's messages from the trainers, exactly as without relay;
:class:`BroadcastLinks` turns each such operation into a broadcast of its group
(:func:`~refit_core.plan.relay.broadcast_groups`: the sender, then one rank of every replica), so that every
member posts the same broadcasts in the same order. Step headers stay point to point: the trainers exchange
theirs with every member of their groups.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from refit_core.contract.errors import TransferError
from refit_core.contract.side import Side
from refit_core.net.transport import Fence, Transport
from refit_core.net.transport.base import SpanRecorder
from refit_core.plan.relay import RelayPlan, broadcast_groups
from refit_core.plan.schedule import Schedule


class BroadcastLinks(Transport):
    """``inner`` with this rank's broadcast groups open: a data send to (or receive from) a peer is the
    broadcast of the group the two share, rooted at the sender; control exchanges go to ``inner`` as they are."""

    def __init__(self, inner: Transport, groups: Sequence[tuple[int, ...]], rank: int) -> None:
        self.inner, self.rank = inner, rank
        self.kind, self.device, self.counters = inner.kind, inner.device, inner.counters
        self.records_spans = inner.records_spans
        self._group = {(members[0], member): index for index, members in enumerate(groups) for member in members[1:]}
        """(root, member) -> the group's index."""

    @property  # the executors set the timeline on the transport they hold
    def timeline(self) -> SpanRecorder | None:
        return self.inner.timeline

    @timeline.setter
    def timeline(self, value: SpanRecorder | None) -> None:
        self.inner.timeline = value

    def exchange(self, sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]],
                 after: Sequence[Fence] = (), *, control: bool = False) -> Fence:
        if control:
            return self.inner.exchange(sends, recvs, after, control=True)
        try:
            posts = [(self._group[(self.rank, peer)], tensor) for peer, tensor in sends]
            posts += [(self._group[(peer, self.rank)], tensor) for peer, tensor in recvs]
        except KeyError as exc:
            raise TransferError(f"refit bug: rank {self.rank} shares no broadcast group with rank(s) "
                                f"{exc.args[0]}") from None
        return self.inner.broadcast(posts, after)

    def __getattr__(self, name: str) -> object:  # what else the inner transport reports (its mode, its choice)
        return getattr(self.inner, name)

    def register(self, tensors: Sequence[torch.Tensor]) -> None:
        self.inner.register(tensors)

    def abort(self, reason: str) -> None:
        self.inner.abort(reason)

    def close(self) -> None:
        self.inner.close()


def broadcast_view(transport: Transport, schedule: Schedule, relay: RelayPlan, side: Side, rank: int,
                   num_train: int) -> BroadcastLinks:
    """Open this rank's broadcast groups on ``transport`` (collective over each group's members) and return
    the view its executors use; ``rank`` is the rank on ``side``, ``num_train`` the number of train ranks."""
    train = side is Side.TRAIN
    groups = broadcast_groups(schedule, relay, rank, train)
    own = rank if train else num_train + rank
    transport.open_broadcasts(groups, own)
    return BroadcastLinks(transport, groups, own)


__all__ = ["BroadcastLinks", "broadcast_view"]
