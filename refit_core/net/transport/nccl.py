"""The GPU transport: NCCL point-to-point through nccl4py, built from the refit's own store.

Every exchange is one NCCL group (``ncclGroupStart``/``End``) of all its sends and receives, so all
pairs move at once, posted on a high-priority stream of this transport after the ``after`` fences
(CUDA events: no host wait). The communicator is created from the refit's rendezvous store, like the
gloo transport's process group: rank 0 draws the NCCL unique id and publishes it there. Trainers and
engines keep their own process groups; refit never touches the default group.

Placement. NCCL refuses two ranks of one communicator on the same GPU ("Duplicate GPU detected").
When every rank has a GPU of its own there is one communicator for the whole refit; when some ranks
share a GPU (several ranks per GPU on a small machine), every pair of ranks on *different* GPUs gets a
2-rank communicator of its own, created in one global order (deadlock-free), each with its own
stream. Two ranks on the same GPU cannot exchange through NCCL at all: setup refuses such a plan
before any collective (:func:`~refit_core.plan.links.pair_links`; such pairs use CUDA IPC instead).
Processes sharing a GPU time-slice it unless an MPS daemon runs: then one step of a two-ranks-per-GPU
reshard took anywhere from the wire's time to six times it. Under MPS their kernels run side by side, but
ranks that each exchanged with two peers at once deadlocked with 4 communicators per pair (16 on a GPU) and
ran at the wire with 2: setup warns above :data:`PAIRWISE_COMMS_PER_GPU` when the default is in use.

Several communicators per link. NCCL runs the operations to one peer one after another, and each
costs some 20 us beyond its bytes (filling and draining its pipeline). With
:attr:`NcclOptions.comms_per_link <refit_core.contract.options.NcclOptions.comms_per_link>` = K (by default
4, :data:`~refit_core.contract.options.DEFAULT_CHOICE`) every link has K communicators, each on its own stream
(built with ``NcclOptions.max_ctas``), and the i-th operation of a step to a peer goes to
communicator ``i % K``: both sides post the same sequence of operations per peer (NCCL needs that
anyway), so they agree on the communicator without a word, and consecutive operations overlap. The step
header (a *control* exchange, both directions at once) goes on the first communicator as one group,
outside that rotation, and restarts it: every step sends each operation on the same communicator as the
step before. An operation of at most :data:`SMALL_OP_BYTES` (the scales part of a message quantized on
the sender) goes on the communicator of the operation before it and leaves the rotation as it is: were
it counted, a step of values, scales, values, scales... would put every large operation on the same
communicators. (A rotation carried across steps gives a step of N operations a new mapping each step
until all K have been seen, when N is not a multiple of K; NCCL warms each new mapping up anew, about
90 ms per step on 2 x H200, so K slow steps came after setup instead of one.)

Broadcasts (the relay by broadcast). :meth:`NcclTransport.open_broadcasts` builds K communicators for each
group of ranks (its root first, on GPUs of their own), in the order given, the same on every member; a
group's broadcasts rotate over them as a link's operations do, and the step header restarts that rotation
too. NCCL moves each broadcast down a chain of the members inside its kernels.

Backends (:class:`~refit_core.contract.options.NcclBackend`). ``nccl4py`` (``pip install nccl4py``; the
default) or, where it cannot be imported, a ``torch.distributed.ProcessGroupNCCL`` built on the same
store (``torch`` forces it; it has no pairwise mode). ``nccl4py`` does not check contiguity: only
contiguous tensors may be handed to it, which :func:`~refit_core.net.transport.base.check_contiguous`
enforces.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist

from refit_core.contract.errors import RefitError, TransferError
from refit_core.contract.nccl_options import NcclBackend, NcclChoice, NcclOptions
from refit_core.contract.options import TransportKind
from refit_core.net.keys import NCCL_PREFIX, nccl_broadcast_key, nccl_comm_key, nccl_gpu_key
from refit_core.net.transport.base import Fence, Transport, TransportCounters, check_contiguous, spin_until
from refit_core.net.transport.kind import TransportContext, TransportType
from refit_core.net.transport.nccl_comms import (
    Communicator,
    NcclComm,
    TorchNcclComm,
    open_comm,
    resolve_backend,
)
from refit_core.net.transport.watch import FIRST_CHECK_S, MAX_CHECK_S, PeerWatch

log = logging.getLogger("refit")

SMALL_OP_BYTES = 1 << 20
"""Data operations of at most this many bytes ride with the one before them (see the module doc)."""


def _stream_for(device: torch.device) -> torch.cuda.Stream:
    # The lowest number is the highest priority (torch clamps to the device's range): NCCL's blocks
    # then win over concurrently queued packing copies when SMs free up.
    return torch.cuda.Stream(device=device, priority=-8)


class _Cadence:
    """When a slow wait asks the watch: first after ``FIRST_CHECK_S``, then at most every ``MAX_CHECK_S``."""

    def __init__(self) -> None:
        self.restart()

    def restart(self) -> None:
        self._interval = FIRST_CHECK_S
        self._next = time.monotonic() + FIRST_CHECK_S

    def due(self) -> bool:
        now = time.monotonic()
        if now < self._next:
            return False
        self._interval = min(2 * self._interval, MAX_CHECK_S)
        self._next = now + self._interval
        return True



def _rotated(links: Sequence[_Link], counts: dict[int, int], key: int, nbytes: int) -> _Link:
    """The next of ``links`` for an operation of ``nbytes`` in the sequence ``key`` (a peer and direction, or a
    broadcast group), ``counts`` holding each sequence's operations so far: data operations rotate over the
    links; one of at most :data:`SMALL_OP_BYTES` (a message's scales) goes with the operation before it and
    does not move the rotation, so that the large ones still alternate. Both ends see the same sizes in the
    same order: they agree."""
    index = counts.get(key, 0)
    if nbytes <= SMALL_OP_BYTES:
        return links[max(index - 1, 0) % len(links)]
    counts[key] = index + 1
    return links[index % len(links)]


@dataclass(frozen=True)
class _Link:
    """One communicator to a peer: the peer's rank in it and the stream operations go on."""

    comm: Communicator
    peer_rank: int
    stream: torch.cuda.Stream


@dataclass
class _Group:
    """The operations of one exchange on one communicator (one NCCL group)."""

    link: _Link
    sends: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    recvs: list[tuple[int, torch.Tensor]] = field(default_factory=list)


class _NcclFence(Fence):
    """Completion of one exchange: an event per stream it was posted on."""

    def __init__(self, events: list[torch.cuda.Event], transport: NcclTransport, peers: list[int]) -> None:
        self.events = events
        self.transport = transport
        self.peers = peers

    def wait(self, stream: torch.cuda.Stream | None = None) -> None:
        for event in self.events:
            if stream is None:
                event.synchronize()
            else:
                stream.wait_event(event)

    def synchronize(self, timeout_s: float) -> None:
        transport = self.transport
        what = f"NCCL exchange of rank {transport.rank} with rank(s) {sorted(set(self.peers))}"
        transport._watching.restart()
        try:
            spin_until(lambda: all(e.query() for e in self.events), timeout_s, what,
                       poll=lambda: transport.check(self.peers))
        except TransferError as exc:
            transport.abort(str(exc))
            raise
        if self.events:
            self.events = []
            transport._in_flight -= 1


class _AllFence(Fence):
    def __init__(self, fences: Sequence[Fence]) -> None:
        self.fences = list(fences)

    def wait(self, stream: torch.cuda.Stream | None = None) -> None:
        for fence in self.fences:
            fence.wait(stream)

    def synchronize(self, timeout_s: float) -> None:
        for fence in self.fences:
            fence.synchronize(timeout_s)


PAIRWISE_COMMS_PER_GPU = 8
"""The most communicators one GPU's ranks have held in pairwise mode in a measured run where every pair
was busy at once under MPS (2 x H200, 2026-11-27: TP2 -> TP1 x DP2, two ranks per GPU, ran with 8 on each GPU
and deadlocked with 16; TP2 -> TP2 holds 16 too but uses half of its pairs, and ran)."""


def pairwise_comms_per_gpu(gpus: Sequence[str], count: int) -> int:
    """The most NCCL communicators the ranks of one GPU hold in pairwise mode: ``count`` for every pair of
    ranks on different GPUs (``gpus[rank]``: the GPU of each rank)."""
    return count * max((n * (len(gpus) - n) for n in Counter(gpus).values()), default=0)


class NcclTransport(Transport):
    """Grouped NCCL send/recv between the ranks of one refit (one rank per process)."""

    kind = TransportKind.NCCL
    records_spans = True

    def __init__(self, store: dist.Store, rank: int, world_size: int, device: torch.device,
                 timeout_s: float, options: NcclOptions, watch: PeerWatch | None = None) -> None:
        if not torch.cuda.is_available():
            raise RefitError("the nccl transport needs CUDA; use transport='gloo' on CPU")
        device = torch.device(device)
        if device.type != "cuda":
            raise RefitError(f"the nccl transport needs CUDA tensors, but this rank's pieces are on {device}")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.watch = watch
        """Asked while a fence is slow (NCCL never reports a dead peer process: its kernels just wait)."""
        self._watching = _Cadence()
        self._in_flight = 0  # fences posted and not yet seen complete
        self.counters: TransportCounters = TransportCounters()
        self._broken: str | None = None
        store = dist.PrefixStore(NCCL_PREFIX, store)
        self._store, self._timeout_s = store, timeout_s
        self._broadcasts: list[list[_Link]] = []  # group -> one link (its root's member index) per communicator
        self._broadcasted: dict[int, int] = {}  # group -> broadcasts posted since the last control exchange
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        store.set(nccl_gpu_key(rank), uuid)
        gpus = [store.get(nccl_gpu_key(r)).decode() for r in range(world_size)]
        self.gpus = gpus
        self._comms: list[Communicator] | None = []
        self._links: dict[int, list[_Link]] = {}  # peer -> one link per communicator
        self._sent: dict[int, int] = {}
        self._received: dict[int, int] = {}
        self.backend = resolve_backend(options.backend)
        choice = options.choice()
        count = choice.comms_per_link if self.backend == NcclBackend.NCCL4PY else 1
        self.choice = NcclChoice(count, choice.max_ctas)
        """The communicators per link and their ``maxCTAs`` this transport built (0: NCCL's default)."""
        if len(set(gpus)) == world_size:
            for k in range(count):
                comm = open_comm(store, nccl_comm_key(None, k), world_size, rank, device, timeout_s, self.backend,
                                 choice.max_ctas)
                stream = _stream_for(device)
                self._comms.append(comm)
                for peer in range(world_size):
                    if peer != rank:
                        self._links.setdefault(peer, []).append(_Link(comm, peer, stream))
            self.mode = "world"
        else:
            if self.backend != NcclBackend.NCCL4PY:
                raise RefitError("several refit ranks share a GPU: that needs one NCCL communicator per "
                                 "pair of ranks, which only the nccl4py backend provides")
            for i in range(world_size):
                for j in range(i + 1, world_size):
                    if rank not in (i, j) or gpus[i] == gpus[j]:
                        continue
                    peer = j if rank == i else i
                    for k in range(count):
                        comm = open_comm(store, nccl_comm_key((i, j), k), 2, 0 if rank == i else 1, device, timeout_s,
                                         self.backend, choice.max_ctas)
                        self._comms.append(comm)
                        self._links.setdefault(peer, []).append(_Link(comm, 1 if rank == i else 0,
                                                                      _stream_for(device)))
            self.mode = "pairwise"
            busiest = pairwise_comms_per_gpu(gpus, count)
            if options.comms_per_link is None and busiest > PAIRWISE_COMMS_PER_GPU:
                log.warning(
                    "refit nccl transport: rank %d: ranks share GPUs, so every pair of ranks on different GPUs "
                    "has %d communicators of its own, %d on the busiest GPU. Under MPS, ranks exchanging with "
                    "several peers at once deadlocked with 4 per pair and ran at the wire with 2 (2 x H200, "
                    "TP2 -> TP1 x DP2, two ranks per GPU); if a step does not complete, set "
                    "NcclOptions(comms_per_link=2) (REFIT_NCCL_COMMS=2)", rank, count, busiest)
        log.info("refit nccl transport: rank %d/%d on %s, %s communicators x %d (max CTAs %s), backend %s", rank,
                 world_size, device, self.mode, count, choice.max_ctas or "NCCL's", self.backend.value)

    def _link(self, peer: int, counts: dict[int, int] | None, nbytes: int) -> _Link:
        """The communicator of this rank's next operation with ``peer`` in one direction (``counts``: the
        operations posted so far per peer in that direction; None: a control exchange, on the first). Data
        operations rotate over the link's communicators (:func:`_rotated`)."""
        try:
            links = self._links[peer]
        except KeyError:
            raise TransferError(f"no NCCL link from rank {self.rank} to rank {peer}") from None
        return links[0] if counts is None else _rotated(links, counts, peer, nbytes)

    def _groups(self, sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]],
                control: bool) -> list[_Group]:
        """The exchange's operations, one group per communicator they go on (see :meth:`_link`)."""
        groups: dict[int, _Group] = {}
        if control:  # both ends post it at the same point of each peer's sequence: the rotation restarts there
            for peer, _ in sends:
                self._sent.pop(peer, None)
            for peer, _ in recvs:
                self._received.pop(peer, None)
        for peer, tensor in sends:
            link = self._link(peer, None if control else self._sent, tensor.nbytes)
            groups.setdefault(id(link.comm), _Group(link)).sends.append((link.peer_rank, tensor))
        for peer, tensor in recvs:
            link = self._link(peer, None if control else self._received, tensor.nbytes)
            groups.setdefault(id(link.comm), _Group(link)).recvs.append((link.peer_rank, tensor))
        return list(groups.values())

    def _open(self) -> list[Communicator]:
        if self._comms is None:
            raise TransferError(f"the nccl transport of rank {self.rank} is closed"
                                + (f" (it gave up on a step: {self._broken})" if self._broken else ""))
        return self._comms

    def exchange(self, sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]],
                 after: Sequence[Fence] = (), *, control: bool = False) -> Fence:
        """See :meth:`Transport.exchange`; a ``control`` exchange goes on each link's first communicator,
        one NCCL group for both directions, and restarts the rotation of data operations with its peers (and
        of the broadcasts of its groups)."""
        self._open()
        check_contiguous(sends)
        check_contiguous(recvs)
        if control:
            self._broadcasted.clear()
        groups = self._groups(sends, recvs, control)
        peers = [p for p, _ in (*sends, *recvs)]
        fence = self._post([(g.link, partial(g.link.comm.post, g.sends, g.recvs)) for g in groups], after, peers)
        self.counters.add(sends, recvs, control)
        return fence

    def _post(self, groups: Sequence[tuple[_Link, Callable[[torch.cuda.Stream], None]]], after: Sequence[Fence],
              peers: list[int]) -> Fence:
        """Post each group (its link, and what posts it on a stream) after ``after``; the fence of them all."""
        if not groups:
            return _AllFence(after)
        events = []
        for link, post in groups:
            stream = link.stream
            for fence in after:
                fence.wait(stream)
            timeline = self.timeline
            start = timeline.stamp(stream) if timeline is not None else None
            try:
                post(stream)
            except Exception as exc:  # every transport failure is a TransferError
                raise TransferError(f"NCCL exchange of rank {self.rank} with rank(s) {sorted(set(peers))} "
                                    f"failed to post: {exc}") from exc
            if timeline is not None and start is not None:
                timeline.transferred(stream, start, timeline.stamp(stream))
            event = torch.cuda.Event()
            event.record(stream)
            events.append(event)
        self._in_flight += 1
        return _NcclFence(events, self, peers)

    def open_broadcasts(self, groups: Sequence[Sequence[int]], rank: int) -> None:
        """Build :attr:`choice`'s number of communicators for each group (in order: the same on every member),
        each on a stream of its own. The members must be on different GPUs."""
        super().open_broadcasts(groups, rank)
        comms = self._open()
        for members in self._broadcast_groups:
            gpus = [self.gpus[m] for m in members]
            if len(set(gpus)) < len(gpus) or rank not in members:
                raise RefitError(f"NCCL broadcast group {list(members)}: its ranks must be on different GPUs and "
                                 f"include rank {rank} (GPUs {gpus})")
            links = []
            for k in range(self.choice.comms_per_link):
                comm = open_comm(self._store, nccl_broadcast_key(tuple(members), k), len(members),
                                 members.index(rank), self.device, self._timeout_s, self.backend, self.choice.max_ctas)
                comms.append(comm)
                links.append(_Link(comm, 0, _stream_for(self.device)))
            self._broadcasts.append(links)

    def broadcast(self, posts: Sequence[tuple[int, torch.Tensor]], after: Sequence[Fence] = ()) -> Fence:
        """See :meth:`Transport.broadcast`: NCCL's own broadcasts, rotating over each group's communicators as
        data operations do over a link's (:func:`_rotated`)."""
        self._open()
        check_contiguous(posts)
        by_comm: dict[int, tuple[_Link, list[torch.Tensor]]] = {}
        for group, tensor in posts:
            link = _rotated(self._broadcasts[group], self._broadcasted, group, tensor.nbytes)
            by_comm.setdefault(id(link.comm), (link, []))[1].append(tensor)
        groups = self._broadcast_groups
        mine = [(g, t) for g, t in posts if groups[g][0] == self._broadcast_rank]
        self.counters.add(mine, [(g, t) for g, t in posts if groups[g][0] != self._broadcast_rank], False)
        peers = sorted({m for g, _ in posts for m in groups[g] if m != self.rank})
        return self._post([(link, partial(link.comm.post_broadcasts, tensors, link.peer_rank))
                           for link, tensors in by_comm.values()], after, peers)

    def check(self, peers: Sequence[int] = ()) -> None:
        """Raise :class:`TransferError` if NCCL reported an asynchronous error, or (while a fence on
        ``peers`` is slow, about once a second) the watch says one of them is gone or a rank gave up."""
        for comm in self._comms or ():
            message = comm.error()
            if message is not None:
                raise TransferError(f"NCCL failed on rank {self.rank}: {message}")
        if self.watch is not None and peers and self._watching.due():
            for peer in sorted(set(peers)):
                loss = self.watch.lost(peer)
                if loss is not None:  # the fence's abort() publishes it: ranks waiting on this one may not see it
                    raise TransferError(f"NCCL exchange of rank {self.rank} abandoned: "
                                        f"{loss.describe(self.watch.names)}")

    def abort(self, reason: str) -> None:
        """Give up on the step: tell the peers (if this rank is the first to know), then abort every
        communicator, which ends kernels still waiting on a lost peer (``close()`` would wait for them)."""
        comms, self._comms = self._comms, None
        if self._broken is None and self.watch is not None:
            self.watch.give_up(self.rank, reason)
        self._broken = self._broken or reason
        for comm in comms or ():
            try:
                comm.abort()
            except Exception as exc:  # noqa: BLE001 - aborting must not mask the caller's outcome
                log.warning("refit: aborting an NCCL communicator failed: %s", exc)
        self._links, self._broadcasts = {}, []

    def close(self) -> None:
        if self._in_flight:  # a step is abandoned half way: its kernels may wait on a peer forever
            self.abort(f"rank {self.rank} closed its transport with messages in flight")
        comms, self._comms = self._comms, None
        if not comms:
            return
        for links in (*self._links.values(), *self._broadcasts):
            for link in links:
                link.stream.synchronize()
        for comm in comms:
            try:
                comm.close()
            except Exception as exc:  # noqa: BLE001 - closing must not mask the caller's outcome
                log.warning("refit: closing an NCCL communicator failed: %s", exc)
        self._links, self._broadcasts = {}, []


def open_nccl(context: TransportContext) -> NcclTransport:
    """The NCCL transport of ``context`` (its options: :class:`NcclOptions`, defaults when None)."""
    options = context.options if isinstance(context.options, NcclOptions) else NcclOptions()
    return NcclTransport(context.store, context.rank, context.world_size, context.device, context.timeout_s, options,
                         context.watch)


NCCL = TransportType(TransportKind.NCCL, open_nccl, NcclOptions, "CUDA tensors over NCCL point-to-point")
"""The nccl kind, registered under ``refit.transports`` by refit-core's ``pyproject.toml``."""

__all__ = ["NCCL", "PAIRWISE_COMMS_PER_GPU", "SMALL_OP_BYTES", "Communicator", "NcclComm", "NcclTransport",
           "TorchNcclComm", "open_comm", "open_nccl", "pairwise_comms_per_gpu", "resolve_backend"]
