"""The transport interface: post a grouped set of sends and receives, get a fence back.

Ranks are global within one refit: train ranks ``0..S-1``, gen ranks ``S..S+D-1``. A transport
only ever receives contiguous tensors (refit packs everything into contiguous buffers first).
Every failure of a transport surfaces as a :class:`~refit_core.contract.errors.TransferError` naming the
peer(s).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from refit_core.contract.errors import TransferError

Stamp = float | torch.cuda.Event
"""A moment of a recorded step: a host ``perf_counter`` value (CPU), or an event recorded on a stream (CUDA)."""


class SpanRecorder(Protocol):
    """What a transport calls on the step recording it (:class:`refit_core.run.timing.Timeline`)."""

    def stamp(self, stream: torch.cuda.Stream | None = None) -> Stamp:
        """Now on the host (CPU), or an event recorded on ``stream`` (CUDA)."""

    def transferred(self, stream: torch.cuda.Stream, start: Stamp, end: Stamp) -> None:
        """The transport's span of the current round on ``stream``, from ``start`` to ``end``."""


class Fence(ABC):
    """Completion of posted work (an exchange, or a batch of copies)."""

    @abstractmethod
    def wait(self, stream: torch.cuda.Stream | None = None) -> None:
        """Make ``stream`` wait for the work (CUDA), or block the host until it is done (CPU)."""

    @abstractmethod
    def synchronize(self, timeout_s: float) -> None:
        """Block the host until done; raise :class:`~refit_core.contract.errors.TransferError` on timeout."""


SPIN_S = 0.05
"""How long :func:`spin_until` spins before it sleeps between checks."""


def spin_until(done: Callable[[], bool], timeout_s: float, what: str,
               poll: Callable[[], None] | None = None) -> None:
    """Wait on the host until ``done()``; :class:`TransferError` naming ``what`` after ``timeout_s``.

    Spins (yielding the CPU) for up to :data:`SPIN_S`, then sleeps 50 us between checks: a GPU
    fence completes within a step's milliseconds, and each sleep would add up to a tenth of a
    millisecond to it. ``poll`` (e.g. a check for NCCL's asynchronous errors, which raises) runs
    every 2000 checks and once more before timing out.
    """
    if done():
        return
    now = time.monotonic()
    deadline, spinning = now + timeout_s, now + SPIN_S
    spins = 0
    while not done():
        spins += 1
        if poll is not None and spins % 2000 == 0:
            poll()
        now = time.monotonic()
        if now > deadline:
            if poll is not None:
                poll()
            raise TransferError(f"{what} did not complete within {timeout_s:.0f} s (a peer died or hung)")
        time.sleep(0 if now < spinning else 5e-5)


class DoneFence(Fence):
    """Work that is already complete."""

    def wait(self, stream: torch.cuda.Stream | None = None) -> None:
        pass

    def synchronize(self, timeout_s: float) -> None:
        pass


@dataclass
class TransportCounters:
    """What a transport posted since it opened, as it counts itself: data operations and their bytes each
    way, and control exchanges (step headers) apart. What shows that a relay's trainer sends each byte
    once per step, whatever the number of replicas."""

    sent_bytes: int = 0
    received_bytes: int = 0
    sends: int = 0
    receives: int = 0
    control_exchanges: int = 0

    def add(self, sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]],
            control: bool) -> None:
        """Count one exchange."""
        if control:
            self.control_exchanges += 1
            return
        self.sends += len(sends)
        self.receives += len(recvs)
        self.sent_bytes += sum(t.nbytes for _, t in sends)
        self.received_bytes += sum(t.nbytes for _, t in recvs)


class Transport(ABC):
    """Grouped point-to-point exchange among the ranks of one refit.

    Two-sided: both ends post the same messages in the same order (a send here, a receive of the same size
    there). A kind registers as a :class:`~refit_core.net.transport.kind.TransportType`
    (:mod:`refit_core.net.transport.registry`); ``docs/writing-a-transport.md`` walks through writing one.
    """

    kind: str
    """The name this transport registered under (``"gloo"``, ``"nccl"``...)."""
    device: torch.device
    timeline: SpanRecorder | None = None
    """Set by an executor recording a step (``refit bench --timeline``): a transport whose work runs
    on CUDA streams records each exchange's span there (:meth:`SpanRecorder.transferred`)."""
    records_spans = False
    """True when this transport records its own spans on a timeline (else the executor observes fences)."""
    counters: TransportCounters | None = None
    """What it posted since it opened (None: this transport does not count; gloo and nccl do)."""
    _broadcast_groups: list[tuple[int, ...]] = []
    _broadcast_rank = -1

    @abstractmethod
    def exchange(self, sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]],
                 after: Sequence[Fence] = (), *, control: bool = False) -> Fence:
        """Post all ``(peer, tensor)`` sends and receives at once, once ``after`` completed.

        ``control``: a small exchange both ends make as one (the step header); a transport with several
        channels per link may post it on a fixed one, outside the rotation of data messages."""

    def abort(self, reason: str) -> None:
        """This rank gives up on the step in progress (``reason``): peers still waiting on it stop within
        about a second instead of at their deadline (they hear why through the transport's watch); then
        :meth:`close`. Safe at any time, and after ``close()``."""
        self.close()

    def register(self, tensors: Sequence[torch.Tensor]) -> None:
        """Memory this rank sends from or receives into directly at every step: the zero-copy regions of its
        bound views (whole parameters, fused rows), each a flat contiguous tensor. Called by each executor at
        its bind, before the first exchange that uses it, again after a rebind (then with the new set: what
        is no longer listed may be released); default: nothing to register. Staged messages travel in
        staging buffers allocated per step and are handed to ``exchange`` as they come: a one-sided transport
        registers those the first time it sees them (a registration cache, as UCX and NIXL keep).

        A one-sided RDMA transport (NIXL, Mooncake, ibverbs) registers each region with its NIC here
        (pinning it and getting a remote key), publishes the descriptors through the refit's store under a
        key of its own, and reads its peers' before its first exchange, so that ``exchange`` can then
        write into (or read from) a peer's memory by address. Exchanges still name whole contiguous tensors
        inside registered memory, so a transport maps each to (region, offset) by its address."""

    def open_broadcasts(self, groups: Sequence[Sequence[int]], rank: int) -> None:
        """Prepare the broadcast groups this rank (global ``rank``) belongs to: each the global ranks of its
        members, its root (the sender) first, in one order on every rank. Collective over each group's members.
        Default: nothing to prepare; :meth:`broadcast` then sends from the root to every member."""
        self._broadcast_groups = [tuple(members) for members in groups]
        self._broadcast_rank = rank

    def broadcast(self, posts: Sequence[tuple[int, torch.Tensor]], after: Sequence[Fence] = ()) -> Fence:
        """Post one broadcast per ``(group, tensor)`` (``group``: an index into :meth:`open_broadcasts`'s
        groups) once ``after`` completed: the root's tensor lands in every member's. Every member posts the
        same broadcasts of a group in the same order. Default: one exchange, the root sending its tensor to
        each member (the root's egress carries every member's bytes; NCCL's own broadcast pipelines them
        down a chain instead)."""
        groups, rank = self._broadcast_groups, self._broadcast_rank
        sends = [(member, tensor) for group, tensor in posts if groups[group][0] == rank
                 for member in groups[group][1:]]
        recvs = [(groups[group][0], tensor) for group, tensor in posts if groups[group][0] != rank]
        return self.exchange(sends, recvs, after)

    @abstractmethod
    def close(self) -> None:
        """Release the communicator; a second call does nothing."""


def check_contiguous(pairs: Sequence[tuple[int, torch.Tensor]]) -> None:
    """Refuse a non-contiguous tensor before it reaches a collective (gloo and nccl4py would
    silently move the wrong bytes)."""
    for peer, tensor in pairs:
        if not tensor.is_contiguous():
            raise TransferError(f"refit bug: non-contiguous buffer for peer {peer} handed to a collective")


__all__ = ["DoneFence", "Fence", "SpanRecorder", "Stamp", "Transport", "TransportCounters", "check_contiguous",
           "spin_until"]
