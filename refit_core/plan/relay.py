"""Relay fanout: engine replicas forward each message to the replicas below them as soon as it landed.

When engine replicas outnumber what the trainers' links can feed (one trainer GPU into 3 replicas,
one trainer node into 32: every replica's bytes leave the same GPUs), the trainers feed only the
first ``direct`` replicas (the roots); every other replica gets the step from its parent in a
:class:`RelayTree` of ``fanout`` children per holder (``fanout=1``: chains). Each relayed rank receives
exactly the messages its root's rank receives from the trainers, round for round, and its parent
forwards each of them as soon as it landed, while the rest of the step still arrives: the step is
pipelined down the tree message by message, so every byte crosses each link once and a chain of N
replicas costs about what one replica costs (plus one message per hop). With ``chunk_bytes`` the relay's
messages travel in slices of at most that size (:func:`relay_slices`), and a holder forwards each slice
as soon as it landed: a hop then costs one piece, not one round, which deep chains need; every piece
pays the transport's cost per message, which short chains on fast links do not repay. With ``slice_pieces``
each slice travels as that many operations (:func:`piece_bytes`), so that one slice spreads over a link's
communicators instead of running on one.

Replicas are ``replicas`` consecutive, equal blocks of gen ranks (vLLM's data-parallel replicas:
replica ``d`` is gen ranks ``d*size .. d*size+size-1``) whose destination pieces are identical rank by
rank; rank ``i`` of a replica forwards to rank ``i`` of its children. The plan is static and part of
the fingerprint: the tree (every replica's parent) is hashed into the settings, and the relay
messages follow from it and the trainers' schedule (:func:`relay_down_tree`). A relayed rank's
messages keep the operations (:attr:`~refit_core.plan.items.Message.parts`) of its root's, so the
forward of each operation is the operation its parent received. A failed relay fails the step on
both ends like any other step (:class:`~refit_core.contract.failures.StepFailedError` naming the
tensors that may be torn), and every rank below the lost one fails it within the deadline.

**Broadcast** (``RelayOptions.broadcast``): the trainers feed the first replica only, and each of their
messages to its rank ``i`` reaches rank ``i`` of every replica in one collective broadcast over the sender
and those ranks (:func:`broadcast_groups`): NCCL pipelines it down a chain inside its kernels, so no holder
posts a forward per piece. The relayed ranks receive the first replica's messages, from the trainers, as
its rank does; the plan's relay messages say so (the trainers' messages, re-addressed to them).

**Forwarding within nodes** (``RelayOptions.node_ranks``) is the same idea inside one replica: a
region that several gen ranks of one node hold (norms that tensor parallelism replicates, MLA's
``q_a`` / ``kv_a`` projections at TP 32) crosses the network once per node instead of once per GPU.
The trainers feed each such region to one holder, its *leader* (leaders are spread so that every
rank of the node leads about as many bytes), and the leaders forward it whole to the node's other
holders over NVLink after their own step landed. In the forwarding rounds a rank both sends and
receives; each round is posted as one exchange, so ranks never wait on each other in a cycle.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from refit_core.contract.errors import PlanError
from refit_core.contract.options import MessageOptions, RelayOptions
from refit_core.contract.pieces import PieceMeta
from refit_core.contract.spec import Box, dtype_size
from refit_core.plan.items import Message, Segment, Transfer
from refit_core.plan.links import Placement
from refit_core.plan.schedule import Schedule, build_schedule, digest_rounds, summarize
from refit_core.units import format_bytes


@dataclass(frozen=True)
class RelayTree:
    """Which replica forwards the step to which: ``parent[c]`` is the replica that forwards to replica
    ``c`` (-1 for a root, fed by the trainers); ``levels[k]`` are the replicas ``k`` hops below a root."""

    levels: tuple[tuple[int, ...], ...]
    parent: tuple[int, ...]

    @property
    def replicas(self) -> int:
        return len(self.parent)

    @property
    def roots(self) -> tuple[int, ...]:
        """The replicas the trainers feed."""
        return self.levels[0]

    def children(self, replica: int) -> tuple[int, ...]:
        """The replicas ``replica`` forwards to (empty: a leaf)."""
        return tuple(c for c, p in enumerate(self.parent) if p == replica)

    def root_of(self, replica: int) -> int:
        """The root whose messages ``replica`` receives (itself for a root)."""
        while self.parent[replica] >= 0:
            replica = self.parent[replica]
        return replica


def plan_tree(replicas: int, direct: int, fanout: int = 1) -> RelayTree:
    """The relay tree of ``replicas`` replicas, ``direct`` of them fed by the trainers.

    Replicas are numbered breadth first: replica ``c >= direct`` hangs below replica
    ``(c - direct) // fanout``, so every holder forwards to at most ``fanout`` replicas (``fanout=1``:
    ``direct`` chains of about equal length). ``direct >= replicas`` gives one level (no relay).
    """
    if replicas < 1 or direct < 1 or fanout < 1:
        raise PlanError(f"relay: replicas={replicas}, direct={direct}, fanout={fanout} must all be >= 1")
    direct = min(direct, replicas)
    parent = [-1] * direct + [(c - direct) // fanout for c in range(direct, replicas)]
    level = [0] * replicas
    for c in range(direct, replicas):
        level[c] = level[parent[c]] + 1
    levels = tuple(tuple(c for c in range(replicas) if level[c] == k) for k in range(max(level) + 1))
    return RelayTree(levels, tuple(parent))


@dataclass(frozen=True)
class ReplicaTree:
    """The replica relay before the trainers' schedule exists: replicas of ``replica_size`` gen ranks and
    their :class:`RelayTree`. What the trainers' schedule is planned against (:meth:`direct_metas`)."""

    replica_size: int
    tree: RelayTree
    broadcast: bool = False
    """The relayed replicas hear the trainers' messages to the first replica in broadcasts (no forwards)."""

    def replica_of(self, gen_rank: int) -> int:
        return gen_rank // self.replica_size

    def fed_by_trainers(self, gen_rank: int) -> bool:
        """True when the trainers feed this gen rank (it belongs to a root replica)."""
        return self.tree.parent[self.replica_of(gen_rank)] < 0

    def direct_metas(self, gen_metas: Sequence[Sequence[PieceMeta]]) -> list[list[PieceMeta]]:
        """The gen ranks' metadata as the trainers feed it: relayed ranks emptied."""
        return [list(m) if self.fed_by_trainers(r) else [] for r, m in enumerate(gen_metas)]

    @property
    def digest(self) -> str:
        """What the plan's fingerprint hashes of the relay (its messages follow from it and the schedule)."""
        tree = f"relay-tree:{self.replica_size}:{self.tree.parent}"
        return f"{tree}:broadcast" if self.broadcast else tree


def replica_tree(options: RelayOptions, gen_metas: Sequence[Sequence[PieceMeta]]) -> ReplicaTree:
    """The replica relay's tree for ``options`` (``options.fans_out``); a :class:`PlanError` naming the ranks
    if the replicas' layouts differ. A broadcast's tree is a star: every replica one hop below the first."""
    size = _check_replicas(gen_metas, options.replicas)
    if options.broadcast:
        return ReplicaTree(size, plan_tree(options.replicas, 1, max(1, options.replicas - 1)), broadcast=True)
    return ReplicaTree(size, plan_tree(options.replicas, options.direct, options.fanout))


def chunk_spans(nbytes: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """``(start, end)`` of the pieces a relay message of ``nbytes`` travels in: at most ``chunk_bytes``
    each, the last one shorter (``chunk_bytes`` 0: the whole message). Both ends of a link cut alike."""
    if chunk_bytes <= 0 or nbytes <= chunk_bytes:
        return [(0, nbytes)]
    return [(start, min(start + chunk_bytes, nbytes)) for start in range(0, nbytes, chunk_bytes)]


PIECE_ALIGN = 4096
"""Pieces of a slice cut in several (``slice_pieces``) are whole multiples of this many bytes."""


def piece_bytes(chunk_bytes: int, slice_pieces: int = 1) -> int:
    """The most bytes of one relay operation: ``chunk_bytes`` (0: whole messages) cut in ``slice_pieces``
    (so that ``slice_pieces`` of them fill a slice), rounded down to a multiple of :data:`PIECE_ALIGN` where
    a piece is larger than that."""
    if chunk_bytes <= 0 or slice_pieces <= 1:
        return chunk_bytes
    piece = max(1, chunk_bytes // slice_pieces)
    return piece - piece % PIECE_ALIGN if piece >= PIECE_ALIGN else piece


@dataclass(frozen=True)
class RelayPiece:
    """Bytes ``start`` to ``end`` of a round's ``message``-th message to one child (or from the parent)."""

    message: int
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def relay_slices(sizes: Sequence[int], chunk_bytes: int, slice_pieces: int = 1) -> list[list[RelayPiece]]:
    """How one round's messages of ``sizes`` bytes (in order) travel over one relay link: each cut into
    pieces of at most :func:`piece_bytes` (:func:`chunk_spans`), consecutive pieces grouped into slices of
    at most ``chunk_bytes``; a holder forwards each slice once it landed. ``chunk_bytes`` 0: one slice, the
    whole messages."""
    slices: list[list[RelayPiece]] = []
    filled = chunk_bytes  # bytes in the open slice: none open yet
    cut = piece_bytes(chunk_bytes, slice_pieces)
    for message, nbytes in enumerate(sizes):
        for start, end in chunk_spans(nbytes, cut):
            if not slices or (chunk_bytes > 0 and filled + end - start > chunk_bytes):
                slices.append([])
                filled = 0
            slices[-1].append(RelayPiece(message, start, end))
            filled += end - start
    return slices


def relay_down_tree(relay: ReplicaTree, schedule: Schedule, chunk_bytes: int = 0, slice_pieces: int = 1
                    ) -> RelayPlan:
    """The relay plan: round by round, every message the trainers send to a root replica's rank ``i``,
    forwarded from each replica's rank ``i`` to rank ``i`` of each of its children (same bytes, same
    destination segments, same operations); receiver-side quantizations are copied to the relayed ranks.
    ``chunk_bytes``: the relay messages travel in slices of at most that size (0: whole), each in
    ``slice_pieces`` operations; both hashed into the fingerprint (both ends must cut alike)."""
    if chunk_bytes < 0 or slice_pieces < 1:
        raise PlanError(f"relay: chunk_bytes={chunk_bytes} must be >= 0 (0: whole messages) and "
                        f"slice_pieces={slice_pieces} >= 1")
    size, tree = relay.replica_size, relay.tree
    if relay.broadcast:
        return _broadcast_plan(relay, schedule)
    below: dict[int, list[tuple[int, int]]] = {root: [] for root in tree.roots}  # root -> (parent, child)
    for level in tree.levels[1:]:
        for child in level:
            below[tree.root_of(child)].append((tree.parent[child], child))
    rounds: list[list[Message]] = []
    for msgs in schedule.rounds:
        forwards = []
        for m in msgs:
            root, i = divmod(m.dst, size)
            if not below[root]:
                continue
            segments = _as_forwarded(m)
            forwards += [Message(parent * size + i, child * size + i, m.nbytes, segments, m.dst_segments)
                         for parent, child in below[root]]
        if forwards:
            rounds.append(forwards)
    quantizing = tuple(dataclasses.replace(q, dst=child * size + q.dst % size)
                       for q in schedule.receiver_quantizations
                       for _, child in below[q.dst // size])
    world = schedule.num_dst
    digest = f"{relay.digest}:chunks:{chunk_bytes}" if chunk_bytes else relay.digest
    if chunk_bytes and slice_pieces > 1:
        digest = f"{digest}:pieces:{slice_pieces}"
    relayed = Schedule(world, world, schedule.bucket_bytes, rounds,
                       digest_rounds(world, world, schedule.bucket_bytes, rounds, digest, quantizing),
                       summarize(rounds), quantizing)
    return RelayPlan(size, tree, relayed, chunk_bytes=chunk_bytes, slice_pieces=slice_pieces)


def _broadcast_plan(relay: ReplicaTree, schedule: Schedule) -> RelayPlan:
    """A broadcast's relay plan: every relayed rank receives the first replica's messages (the trainers'
    messages re-addressed to it, sender kept), round for round, and its receiver-side quantizations."""
    size, others = relay.replica_size, range(1, relay.tree.replicas)
    rounds = [[dataclasses.replace(m, dst=r * size + m.dst) for m in msgs for r in others]
              for msgs in schedule.rounds]
    quantizing = tuple(dataclasses.replace(q, dst=r * size + q.dst) for q in schedule.receiver_quantizations
                       for r in others)
    world = schedule.num_dst
    relayed = Schedule(schedule.num_src, world, schedule.bucket_bytes, rounds,
                       digest_rounds(schedule.num_src, world, schedule.bucket_bytes, rounds, relay.digest, quantizing),
                       summarize(rounds), quantizing)
    return RelayPlan(size, relay.tree, relayed, broadcast=True)


def broadcast_groups(schedule: Schedule, relay: RelayPlan, rank: int, train: bool) -> list[tuple[int, ...]]:
    """The broadcast groups of a relay by broadcast that train (``train``) or gen rank ``rank`` belongs to, in
    one order on every rank: per train rank ``s`` and rank ``i`` of the first replica that ``s`` sends to,
    the global ranks ``s`` (the root), then rank ``i`` of every replica (gen ranks follow the train ranks).
    ``schedule``: this rank's part of the trainers' schedule (a relayed rank's relay messages for it)."""
    num_src, size = schedule.num_src, relay.replica_size
    if train:
        pairs = {(rank, m.dst) for msgs in schedule.rounds for m in msgs if m.src == rank}
    else:
        rounds = schedule.rounds if relay.fed_by_trainers(rank) else relay.schedule.rounds
        pairs = {(m.src, rank % size) for msgs in rounds for m in msgs if m.dst == rank}
    return [(src, *(num_src + r * size + i for r in range(relay.tree.replicas))) for src, i in sorted(pairs)]


def _as_forwarded(m: Message) -> tuple[Segment, ...]:
    """A root message's destination segments, as the source segments of its forward: a value segment the
    trainer quantized keeps its scales' offset, so the forward travels as the same operations."""
    if not m.scales_at:
        return m.dst_segments
    out: list[Segment] = []
    destinations = iter(m.dst_segments)
    for src in m.src_segments:
        values = next(destinations)
        if src.scales is None:
            out.append(values)
        else:  # as a quantizing sender's: the values' segment, its scales' segment following in dst_segments
            out.append(dataclasses.replace(values, scales=src.scales))
            next(destinations)
    return tuple(out)


@dataclass(frozen=True)
class RelayPlan:
    """The static relay plan: replicas of ``replica_size`` gen ranks, their tree, and the relay messages
    (gen rank -> gen rank) as a :class:`~refit_core.plan.schedule.Schedule`. Replica relay: round ``k``
    forwards the ``k``-th round (of those with messages to a root replica) down the tree. Forwarding within
    nodes is one replica of the whole gen world and ``node_ranks`` > 1; its rounds run after the step."""

    replica_size: int
    tree: RelayTree
    schedule: Schedule
    node_ranks: int = 0
    """Gen ranks per node when this plan forwards within nodes (0: replica relay)."""
    forwarded: frozenset[tuple[int, int]] = frozenset()
    """``(gen rank, piece)`` of every region a node peer forwards instead of the trainers (node forwarding)."""
    chunk_bytes: int = 0
    """Replica relay: its messages travel in pieces of at most this many bytes, each forwarded once landed
    (:func:`chunk_spans`; 0: whole messages, each round forwarded once it landed)."""
    slice_pieces: int = 1
    """With :attr:`chunk_bytes`: the operations each slice travels as (:func:`piece_bytes`)."""
    broadcast: bool = False
    """Replica relay by broadcast: the relay messages come from the trainers, in broadcasts (no forwards)."""

    @property
    def within_nodes(self) -> bool:
        """True for forwarding within nodes, False for replica relay."""
        return self.node_ranks > 1

    def replica_of(self, gen_rank: int) -> int:
        return gen_rank // self.replica_size

    def fed_by_trainers(self, gen_rank: int) -> bool:
        """True when the trainers feed this gen rank (all its pieces, or all not forwarded to it)."""
        return self.tree.parent[self.replica_of(gen_rank)] < 0

    def direct_metas(self, gen_metas: Sequence[Sequence[PieceMeta]]) -> list[list[PieceMeta]]:
        """Node forwarding: the gen ranks' metadata as the trainers feed it, forwarded pieces shrunk to
        empty boxes (piece indices stay those of the gen ranks)."""
        return [[_emptied(m) if (r, i) in self.forwarded else m for i, m in enumerate(metas)]
                for r, metas in enumerate(gen_metas)]

    @property
    def digest(self) -> str:
        """What the plan's fingerprint hashes of node forwarding (its messages)."""
        return f"forward:{self.node_ranks}:{self.schedule.fingerprint}"

    def lines(self) -> list[str]:
        if self.within_nodes:
            s = self.schedule.summary
            return [f"forwarding:   within nodes of {self.node_ranks} gen ranks: {s.messages} messages, "
                    f"{format_bytes(s.bytes)} over the nodes' links in {s.rounds} round(s)"]
        tree = self.tree
        if self.broadcast:
            return [f"relay:        {tree.replicas} replicas of {self.replica_size} gen rank(s): each message of the "
                    f"trainers to the first replica reaches every replica in one broadcast "
                    f"({self.schedule.summary.messages} relayed receives)"]
        shape = ("chains" if all(len(tree.children(r)) <= 1 for r in range(tree.replicas))
                 else f"a tree of fanout {max(len(tree.children(r)) for r in range(tree.replicas))}")
        pieces = f" in slices of {format_bytes(self.chunk_bytes)}" if self.chunk_bytes else ""
        if self.chunk_bytes and self.slice_pieces > 1:
            pieces = f"{pieces}, {self.slice_pieces} pieces each"
        return [f"relay:        {tree.replicas} replicas of {self.replica_size} gen rank(s): {len(tree.roots)} fed by "
                f"the trainers, the others pipelined down {shape} ({len(tree.levels) - 1} hop(s) deep); "
                f"{self.schedule.summary.messages} relay messages{pieces}"]


def _emptied(meta: PieceMeta) -> PieceMeta:
    return PieceMeta(meta.spec, Box(meta.box.offsets, (0,) * len(meta.box.sizes)))


def _check_replicas(gen_metas: Sequence[Sequence[PieceMeta]], replicas: int) -> int:
    """The replica size; a :class:`PlanError` naming the ranks if replicas differ."""
    world = len(gen_metas)
    if world % replicas:
        raise PlanError(f"relay: {world} gen ranks cannot form {replicas} equal replicas "
                        "(RelayOptions.replicas must divide the gen world size)")
    size = world // replicas
    for rank in range(size, world):
        first = rank % size
        if list(gen_metas[rank]) != list(gen_metas[first]):
            raise PlanError(f"relay: gen rank {rank} (replica {rank // size}) has other destination pieces "
                            f"than gen rank {first} (replica 0): replicas must hold identical layouts to relay")
    return size


_Region = tuple[str, tuple[int, ...], tuple[int, ...]]  # a tensor's name, a box's offsets and sizes


def plan_node_forwarding(node_ranks: int, gen_metas: Sequence[Sequence[PieceMeta]], bucket_bytes: int,
                         formation: MessageOptions | None = None, *, expert_groups: Collection[str] = (),
                         min_bytes: int = 0) -> RelayPlan | None:
    """Forwarding within nodes of ``node_ranks`` consecutive gen ranks, or None when no region of at
    least ``min_bytes`` is held by two ranks of one node.

    Per node, every region (tensor and box) that several ranks hold goes to a leader: largest
    regions first, each to the holder with the fewest bytes to receive from the trainers so far (ties:
    the lowest rank). The others get it from the leader. A rank that would then hear nothing from the
    trainers (it leads nothing and holds nothing else) gets its smallest shared region from them too,
    so that every gen rank learns the step's version from the trainers. Quantized destinations and
    their scales are not forwarded (a receiver may quantize them after forwarding). Deterministic for
    the same input.
    """
    world = len(gen_metas)
    transfers: list[Transfer] = []
    forwarded: set[tuple[int, int]] = set()
    quantized = {name for metas in gen_metas for m in metas if m.spec.quant is not None
                 for name in (m.spec.name, m.spec.quant.scale_name)}
    for first in range(0, world, node_ranks):
        node = range(first, min(first + node_ranks, world))
        holders: dict[_Region, list[tuple[int, int]]] = {}
        for rank in node:
            for piece, meta in enumerate(gen_metas[rank]):
                box = meta.box
                holders.setdefault((meta.spec.name, box.offsets, box.sizes), []).append((rank, piece))
        size = {key: _nbytes(gen_metas[held[0][0]][held[0][1]]) for key, held in holders.items()}
        floor = max(min_bytes, 1)
        shared = {key: held for key, held in holders.items()  # holders come in rank order
                  if held[0][0] != held[-1][0] and size[key] >= floor and key[0] not in quantized}
        if not shared:
            continue
        fed = {rank: 0 for rank in node}  # bytes each rank gets from the trainers, so far
        for key, held in holders.items():
            if key not in shared:
                for rank, _ in held:
                    fed[rank] += size[key]
        order = sorted(shared, key=lambda key: -size[key])
        leaders: dict[_Region, tuple[int, int]] = {}
        for key in order:
            leaders[key] = min(shared[key], key=lambda rp: (fed[rp[0]], rp[0]))
            fed[leaders[key][0]] += size[key]
        fed_anyway: set[tuple[int, int]] = set()  # who would hear nothing from the trainers keeps its smallest
        for rank in node:
            if fed[rank] == 0:
                mine = [(size[key], p) for key in order for r, p in shared[key] if r == rank]
                if mine:
                    fed_anyway.add((rank, min(mine)[1]))
        for key in order:
            leader, leader_piece = leaders[key]
            meta = gen_metas[leader][leader_piece]
            whole = Box((0,) * len(meta.box.sizes), meta.box.sizes)
            for rank, piece in shared[key]:
                if rank == leader or (rank, piece) in fed_anyway:
                    continue
                forwarded.add((rank, piece))
                transfers.append(Transfer(meta.spec.name, leader, leader_piece, whole, rank, piece, whole,
                                          meta.spec.dtype))
    if not transfers:
        return None
    schedule = build_schedule(transfers, world, world, bucket_bytes, formation, expert_groups=expert_groups)
    return RelayPlan(world, plan_tree(1, 1), schedule, node_ranks, frozenset(forwarded))


def _nbytes(meta: PieceMeta) -> int:
    return meta.box.numel * dtype_size(meta.spec.dtype)


def check_relay_pairs(relay: RelayPlan, gen_places: Sequence[Placement]) -> None:
    """A :class:`PlanError` if the relay would connect two gen ranks of one GPU (NCCL cannot)."""
    for msgs in relay.schedule.rounds:
        for m in msgs:
            src, dst = gen_places[m.src], gen_places[m.dst]
            if src.on_gpu and src == dst:
                raise PlanError(f"relay: gen ranks {m.src} and {m.dst} share one GPU ({src.device}), and NCCL cannot "
                                "connect two ranks of one GPU; relay or forward only between ranks on different "
                                "GPUs, or run without relay")


__all__ = ["PIECE_ALIGN", "RelayPiece", "RelayPlan", "RelayTree", "ReplicaTree", "broadcast_groups",
           "check_relay_pairs", "chunk_spans", "piece_bytes", "plan_node_forwarding", "plan_tree", "relay_down_tree",
           "relay_slices", "replica_tree"]
