"""Relay fanout: engine replicas updated in wave k forward their weights to replicas of wave k+1.

When engine replicas outnumber what the trainers' links can feed (one trainer node into 32 engine
replicas: every replica's bytes leave the same eight NICs), the trainers feed only the first
``direct`` replicas (wave 0); every replica that holds the step then forwards it to up to ``fanout``
replicas of the next wave, so the number of replicas holding the weights grows geometrically while
each trainer GPU sends its share once per wave-0 replica only.

Replicas are ``replicas`` consecutive, equal blocks of gen ranks (vLLM's data-parallel replicas:
replica ``d`` is gen ranks ``d*size .. d*size+size-1``) whose destination pieces are identical rank by
rank; rank ``i`` of a replica forwards every piece whole to rank ``i`` of its children. The plan is
static and part of the fingerprint: the waves, every replica's parent, and the relay messages
(schedule rounds whose ``src`` and ``dst`` are both gen ranks, one wave's rounds after another's).
A relaying rank forwards only after its own step has fully landed (its receive completed), so a
child never sees a half-old region; a failed relay fails the step on both ends like any other step
(:class:`~refit_core.contract.failures.StepFailedError` naming the tensors that may be torn).

**Forwarding within nodes** (``RelayOptions.node_ranks``) is the same idea inside one replica: a
region that several gen ranks of one node hold (norms that tensor parallelism replicates, MLA's
``q_a`` / ``kv_a`` projections at TP 32) crosses the network once per node instead of once per GPU.
The trainers feed each such region to one holder, its *leader* (leaders are spread so that every
rank of the node leads about as many bytes), and the leaders forward it whole to the node's other
holders over NVLink after their own step landed. In the forwarding rounds a rank both sends and
receives; each round is posted as one exchange, so ranks never wait on each other in a cycle.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from refit_core.contract.errors import PlanError
from refit_core.contract.options import MessageOptions, RelayOptions
from refit_core.contract.pieces import PieceMeta
from refit_core.contract.spec import Box, dtype_size
from refit_core.plan.items import Message, Transfer
from refit_core.plan.links import Placement
from refit_core.plan.schedule import Schedule, build_schedule, digest_rounds, summarize
from refit_core.units import format_bytes


@dataclass(frozen=True)
class Waves:
    """Which replicas get a step in which wave, and from whom.

    ``waves[0]`` are fed by the trainers; ``parent[c]`` is the replica that forwards to replica
    ``c`` (-1 for wave 0).
    """

    waves: tuple[tuple[int, ...], ...]
    parent: tuple[int, ...]

    @property
    def replicas(self) -> int:
        return len(self.parent)

    def wave_of(self, replica: int) -> int:
        return next(w for w, members in enumerate(self.waves) if replica in members)


def plan_waves(replicas: int, direct: int, fanout: int = 1) -> Waves:
    """Waves for ``replicas`` replicas, ``direct`` of them fed by the trainers.

    Every replica holding the step after wave k (waves 0..k) forwards to at most ``fanout``
    replicas of wave k+1, holders in order of arrival, so ``direct * (1 + fanout) ** k`` replicas
    hold it after wave k. ``direct >= replicas`` gives one wave (no relay).
    """
    if replicas < 1 or direct < 1 or fanout < 1:
        raise PlanError(f"relay: replicas={replicas}, direct={direct}, fanout={fanout} must all be >= 1")
    direct = min(direct, replicas)
    parent = [-1] * replicas
    waves = [tuple(range(direct))]
    holders = list(waves[0])
    following = direct
    while following < replicas:
        wave = []
        for holder in list(holders):
            for _ in range(fanout):
                if following == replicas:
                    break
                parent[following] = holder
                wave.append(following)
                following += 1
        waves.append(tuple(wave))
        holders += wave
    return Waves(tuple(waves), tuple(parent))


@dataclass(frozen=True)
class RelayPlan:
    """The static relay plan: replicas of ``replica_size`` gen ranks, the waves, and the relay
    messages (gen rank -> gen rank) as a :class:`~refit_core.plan.schedule.Schedule` whose rounds run wave
    after wave (``wave_rounds[k]`` rounds belong to wave ``k+1``). Forwarding within nodes is one
    replica of the whole gen world, one wave, and ``node_ranks`` > 1; its rounds run after the step."""

    replica_size: int
    waves: Waves
    schedule: Schedule
    wave_rounds: tuple[int, ...]
    node_ranks: int = 0
    """Gen ranks per node when this plan forwards within nodes (0: replica relay)."""
    forwarded: frozenset[tuple[int, int]] = frozenset()
    """``(gen rank, piece)`` of every region a node peer forwards instead of the trainers (node forwarding)."""

    @property
    def within_nodes(self) -> bool:
        """True for forwarding within nodes, False for replica relay."""
        return self.node_ranks > 1

    def replica_of(self, gen_rank: int) -> int:
        return gen_rank // self.replica_size

    def fed_by_trainers(self, gen_rank: int) -> bool:
        """True when the trainers feed this gen rank (all its pieces, or all not forwarded to it)."""
        return self.waves.parent[self.replica_of(gen_rank)] < 0

    def direct_metas(self, gen_metas: Sequence[Sequence[PieceMeta]]) -> list[list[PieceMeta]]:
        """The gen ranks' metadata as the trainers feed it: relayed ranks emptied; forwarded pieces
        shrunk to empty boxes (piece indices stay those of the gen ranks)."""
        if self.within_nodes:
            return [[_emptied(m) if (r, i) in self.forwarded else m for i, m in enumerate(metas)]
                    for r, metas in enumerate(gen_metas)]
        return [list(m) if self.fed_by_trainers(r) else [] for r, m in enumerate(gen_metas)]

    @property
    def digest(self) -> str:
        """What the plan's fingerprint hashes of the relay: waves, parents and relay messages."""
        if self.within_nodes:
            return f"forward:{self.node_ranks}:{self.schedule.fingerprint}"
        return f"relay:{self.replica_size}:{self.waves.waves}:{self.waves.parent}:{self.schedule.fingerprint}"

    def lines(self) -> list[str]:
        if self.within_nodes:
            s = self.schedule.summary
            return [f"forwarding:   within nodes of {self.node_ranks} gen ranks: {s.messages} messages, "
                    f"{format_bytes(s.bytes)} over the nodes' links in {s.rounds} round(s)"]
        sizes = " + ".join(str(len(w)) for w in self.waves.waves)
        return [f"relay:        {self.waves.replicas} replicas of {self.replica_size} gen rank(s) in "
                f"{len(self.waves.waves)} waves ({sizes}); {self.schedule.summary.messages} relay messages"]


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


def plan_relay(options: RelayOptions, gen_metas: Sequence[Sequence[PieceMeta]], bucket_bytes: int,
               formation: MessageOptions | None = None, *, expert_groups: Collection[str] = ()) -> RelayPlan | None:
    """The relay plan for ``options`` over the (expert-grouped) gen metadata, or None when relay is off.

    Deterministic for the same input, so every rank computes the same plan.
    """
    if not options.active:
        return None
    if options.forwards_within_nodes:
        return plan_node_forwarding(options.node_ranks, gen_metas, bucket_bytes, formation,
                                    expert_groups=expert_groups, min_bytes=options.forward_min_bytes)
    quantized = sorted({m.spec.name for metas in gen_metas for m in metas if m.spec.quant is not None})
    if quantized:
        raise PlanError(f"relay: quantized destinations ({', '.join(quantized[:3])}"
                        f"{', ...' if len(quantized) > 3 else ''}) cannot be relayed yet; run without relay")
    size = _check_replicas(gen_metas, options.replicas)
    waves = plan_waves(options.replicas, options.direct, options.fanout)
    rounds: list[list[Message]] = []
    wave_rounds = []
    for members in waves.waves[1:]:
        transfers = []
        for child in members:
            parent = waves.parent[child]
            for i in range(size):
                src, dst = parent * size + i, child * size + i
                for piece, meta in enumerate(gen_metas[src]):
                    if meta.box.numel == 0:
                        continue
                    whole = Box((0,) * len(meta.box.sizes), meta.box.sizes)
                    transfers.append(Transfer(meta.spec.name, src, piece, whole, dst, piece, whole, meta.spec.dtype))
        wave = build_schedule(transfers, len(gen_metas), len(gen_metas), bucket_bytes, formation,
                              expert_groups=expert_groups)
        rounds += wave.rounds
        wave_rounds.append(len(wave.rounds))
    world = len(gen_metas)
    schedule = Schedule(world, world, bucket_bytes, rounds, digest_rounds(world, world, bucket_bytes, rounds),
                        summarize(rounds))
    return RelayPlan(size, waves, schedule, tuple(wave_rounds))


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
    return RelayPlan(world, plan_waves(1, 1), schedule, (len(schedule.rounds),), node_ranks, frozenset(forwarded))


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


__all__ = ["RelayPlan", "Waves", "check_relay_pairs", "plan_node_forwarding", "plan_relay", "plan_waves"]
