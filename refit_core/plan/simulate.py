"""Predict a refit's time on a cluster from its static schedule: ``refit plan --simulate``.

The schedule says exactly which bytes go from which train rank to which gen rank in which round; a
:class:`Topology` says where the ranks sit (GPUs per node) and what each GPU's links move per second.
Bytes between GPUs of one node ride NVLink, bytes between nodes ride the GPUs' NICs, and bytes
between two ranks of one GPU are a device copy. A round lasts as long as its most loaded GPU link
(each direction counted apart) plus one message latency per message that GPU posts; rounds run one
after another. A relay by broadcast moves each message down its chain of replicas in NCCL's chunks while the
rounds arrive (:func:`_broadcast_relay`). A replica relay (:mod:`refit_core.plan.relay`) is pipelined with
them round by round, or
slice by slice when it travels in slices (``chunk_bytes``): a relayed slice starts once its sender holds
it and both its sender's egress and its receiver's ingress are free, and pays a latency per piece. The
**receiver-side bound** is the bytes the busiest gen GPU must receive over its ingress link; the
**sender-side bound** the bytes the busiest train GPU must send over its egress link (where train ranks
hold unique bytes, such as experts without DP replicas, it can be the larger).
No schedule beats the larger of the two.

The model ignores NCCL's protocol overheads and assumes links reach their rate; validated against
`refit bench` runs on 2 and 4 x H200 (``tests/scale/test_simulate.py``): per-link bytes equal, time
within 15 %; and against issue #48's 4 x H200 runs (one GPU into 3 replicas, TP2 -> TP1 x DP2) within
10 % (``tests/relay/test_relay_simulation.py``).
"""

from __future__ import annotations

import enum
import itertools
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields

from refit_core.contract.errors import RefitError
from refit_core.plan.items import Message
from refit_core.plan.relay import RelayPlan, relay_slices
from refit_core.plan.schedule import Schedule
from refit_core.units import format_bytes, format_duration


class LinkKind(enum.StrEnum):
    """How two GPUs are connected."""

    LOCAL = "local"  # the same GPU: a device copy
    NVLINK = "nvlink"  # two GPUs of one node
    NIC = "nic"  # two nodes


@dataclass(frozen=True)
class Topology:
    """A cluster of identical nodes.

    Rates are per GPU and per direction, in GB/s: ``nvlink_gbps`` within a node (the measured
    point-to-point wire: 370 on 2 x H200 here; NVLink 4's nominal 450), ``nic_gbps`` the GPU's share of
    the node's network (8 x 400 Gb/s NICs: 50), ``copy_gbps`` a same-GPU copy (bytes moved, read +
    write counted once). ``latency_us`` is charged per message a GPU sends or receives in a round.
    """

    gpus_per_node: int = 8
    nvlink_gbps: float = 370.0
    nic_gbps: float = 50.0
    copy_gbps: float = 2000.0
    latency_us: float = 15.0

    @classmethod
    def parse(cls, text: str) -> Topology:
        """``"gpus_per_node=8,nvlink_gbps=370,nic_gbps=50"`` or a preset name (``h100``, ``h200``)."""
        if text in TOPOLOGIES:
            return TOPOLOGIES[text]
        kinds = {f.name: f.type for f in fields(cls)}
        values: dict[str, float | int] = {}
        for item in filter(None, (p.strip() for p in text.split(","))):
            key, _, value = item.partition("=")
            if key not in kinds:
                raise RefitError(f"topology item {item!r}: keys are {sorted(kinds)} (or a preset: "
                                 f"{', '.join(TOPOLOGIES)})")
            try:
                values[key] = int(value) if key == "gpus_per_node" else float(value)
            except ValueError:
                raise RefitError(f"topology item {item!r}: {value!r} is not a number") from None
        return cls(**values)  # type: ignore[arg-type]

    def link(self, src_gpu: int, dst_gpu: int) -> LinkKind:
        if src_gpu == dst_gpu:
            return LinkKind.LOCAL
        if src_gpu // self.gpus_per_node == dst_gpu // self.gpus_per_node:
            return LinkKind.NVLINK
        return LinkKind.NIC

    def rate(self, kind: LinkKind) -> float:
        """Bytes per second of one GPU's link of ``kind``, one direction."""
        return 1e9 * {LinkKind.LOCAL: self.copy_gbps, LinkKind.NVLINK: self.nvlink_gbps,
                      LinkKind.NIC: self.nic_gbps}[kind]


TOPOLOGIES = {
    "h200": Topology(),
    "h100": Topology(copy_gbps=1500.0),
}
"""Defaults for 8-GPU H100 / H200 nodes with 8 x 400 Gb/s NICs (NVLink rate as measured on H200 here)."""


@dataclass(frozen=True)
class GpuPlacement:
    """Which GPU of the simulated cluster each rank uses: ``train[i]`` for train rank i, ``gen[j]`` for gen rank j
    (a live rank's host and device are :class:`refit_core.plan.links.Placement`)."""

    train: tuple[int, ...]
    gen: tuple[int, ...]

    @classmethod
    def disaggregated(cls, train_ranks: int, gen_ranks: int, topology: Topology) -> GpuPlacement:
        """Train ranks on the first GPUs, gen ranks from the next whole node on (separate nodes
        whenever the train side fills whole nodes)."""
        per_node = topology.gpus_per_node
        first_gen = -(-train_ranks // per_node) * per_node if train_ranks >= per_node else train_ranks
        return cls(tuple(range(train_ranks)), tuple(range(first_gen, first_gen + gen_ranks)))

    def distance(self, topology: Topology) -> Callable[[int, int], int]:
        """``distance(train_rank, gen_rank)`` for the planner's replica choice: 0 on the same GPU,
        1 within a node (NVLink), 2 across nodes (the NICs)."""
        order = {LinkKind.LOCAL: 0, LinkKind.NVLINK: 1, LinkKind.NIC: 2}
        return lambda src, dst: order[topology.link(self.train[src], self.gen[dst])]

    @classmethod
    def colocated(cls, train_ranks: int, gen_ranks: int) -> GpuPlacement:
        """Both sides share GPUs: rank i of each side on GPU i."""
        return cls(tuple(range(train_ranks)), tuple(range(gen_ranks)))


Direction = tuple[int, LinkKind, str]  # (gpu, link kind, "out" | "in")


@dataclass(frozen=True)
class Simulation:
    """What :func:`simulate` predicts for one schedule on one topology."""

    topology: Topology
    placement: GpuPlacement
    link_bytes: dict[tuple[int, int], int]
    """Bytes per (source GPU, destination GPU) pair."""
    load_bytes: dict[Direction, int]
    """Bytes per GPU link and direction (``(gpu, kind, "out")``)."""
    round_seconds: list[float]
    """The trainers' rounds, then those of forwarding within nodes (the replica relay overlaps them)."""
    bound_s: float
    """Receiver-side bound: the busiest gen GPU's bytes over its ingress link."""
    sender_bound_s: float = 0.0
    """Sender-side bound: the busiest train GPU's bytes over its egress link."""
    bytes: int = 0
    notes: list[str] = field(default_factory=list)
    relay_end_s: float = 0.0
    """Replica relay: when its last message landed, counted from the step's start (0: no replica relay)."""

    @property
    def predicted_s(self) -> float:
        return max(sum(self.round_seconds), self.relay_end_s)

    @property
    def two_sided_bound_s(self) -> float:
        """What no schedule beats: the larger of the receiver- and sender-side bounds."""
        return max(self.bound_s, self.sender_bound_s)

    @property
    def busiest(self) -> tuple[Direction, int]:
        """The most loaded GPU link direction and its bytes (relative to its rate)."""
        key = max(self.load_bytes, key=lambda d: self.load_bytes[d] / self.topology.rate(d[1]))
        return key, self.load_bytes[key]

    def lines(self) -> list[str]:
        t = self.topology
        (gpu, kind, way), nbytes = self.busiest
        by_kind: dict[LinkKind, int] = defaultdict(int)
        for (src, dst), n in self.link_bytes.items():
            by_kind[t.link(src, dst)] += n
        kinds = ", ".join(f"{kind.value} {format_bytes(n)}" for kind, n in sorted(by_kind.items()))
        ratio = self.predicted_s / self.bound_s if self.bound_s else float("nan")
        two_sided = self.predicted_s / self.two_sided_bound_s if self.two_sided_bound_s else float("nan")
        return [
            f"topology:     {t.gpus_per_node} GPUs/node, NVLink {t.nvlink_gbps:g} GB/s, NIC {t.nic_gbps:g} GB/s "
            f"per GPU, {t.latency_us:g} us/message",
            f"traffic:      {format_bytes(self.bytes)} over {len(self.link_bytes)} GPU pairs ({kinds})",
            f"busiest link: GPU {gpu} {kind.value} {way}: {format_bytes(nbytes)}",
            f"predicted:    {format_duration(self.predicted_s)} over {len(self.round_seconds)} rounds",
            f"bound:        {format_duration(self.bound_s)} (receiver side: the busiest gen GPU's bytes over its "
            f"ingress link); predicted / bound = {ratio:.2f}",
            f"sender side:  {format_duration(self.sender_bound_s)} (the busiest train GPU's bytes over its egress "
            f"link); predicted / the larger bound = {two_sided:.2f}",
            *self.notes,
        ]


class _Traffic:
    """Every message's bytes per GPU pair and link direction, and each gen GPU's slowest ingress link
    (and each train GPU's slowest egress link) for the bounds."""

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self.link_bytes: dict[tuple[int, int], int] = defaultdict(int)
        self.load: dict[Direction, int] = defaultdict(int)
        self.received: dict[int, int] = defaultdict(int)
        self.sent: dict[int, int] = defaultdict(int)  # by train GPUs
        self.ingress: dict[int, LinkKind] = {}
        self.egress: dict[int, LinkKind] = {}

    def add(self, src: int, dst: int, nbytes: int, *, by_trainer: bool) -> tuple[Direction, Direction, float]:
        """Count one message from GPU ``src`` to GPU ``dst``: its two link directions and its seconds on them."""
        kind = self.topology.link(src, dst)
        self.link_bytes[(src, dst)] += nbytes
        self.received[dst] += nbytes
        if kind is not LinkKind.LOCAL and (dst not in self.ingress or kind is LinkKind.NIC):
            self.ingress[dst] = kind  # the slowest link a gen GPU receives through
        if by_trainer:
            self.sent[src] += nbytes
            if kind is not LinkKind.LOCAL and (src not in self.egress or kind is LinkKind.NIC):
                self.egress[src] = kind
        out, into = (src, kind, "out"), (dst, kind, "in")
        self.load[out] += nbytes
        self.load[into] += nbytes
        return out, into, nbytes / self.topology.rate(kind) + self.topology.latency_us * 1e-6

    def rounds(self, rounds: Sequence[Sequence[Message]], src_gpus: Sequence[int], dst_gpus: Sequence[int], *,
               by_trainer: bool) -> list[float]:
        """Rounds one after another, each as long as its most loaded link direction."""
        out = []
        for msgs in rounds:
            busy: dict[Direction, float] = defaultdict(float)
            for m in msgs:
                src, dst, seconds = self.add(src_gpus[m.src], dst_gpus[m.dst], m.nbytes, by_trainer=by_trainer)
                busy[src] += seconds
                busy[dst] += seconds
            out.append(max(busy.values(), default=0.0))
        return out

    def bounds(self) -> tuple[float, float]:
        """The receiver- and sender-side bounds."""
        rate = self.topology.rate
        return (max((n / rate(self.ingress.get(g, LinkKind.LOCAL)) for g, n in self.received.items()), default=0.0),
                max((n / rate(self.egress.get(g, LinkKind.LOCAL)) for g, n in self.sent.items()), default=0.0))


def _pipelined_relay(traffic: _Traffic, relay: RelayPlan, schedule: Schedule, round_ends: Sequence[float],
                     gen_gpus: Sequence[int]) -> float:
    """When the replica relay's last message landed. Each relay link carries round ``k``'s messages in
    slices (:func:`~refit_core.plan.relay.relay_slices`; without ``relay.chunk_bytes``, one slice: the
    whole round); a slice starts once its sender holds it (a root: once the trainers' round it forwards
    landed; a relayed rank: once the same slice landed there) and both its sender's egress and its
    receiver's ingress are free, and lasts its bytes over the link plus one latency per piece in it.
    List scheduling, linear in the slices; each link serves its slices in plan order."""
    size, tree = relay.replica_size, relay.tree
    depth = {replica: level for level, members in enumerate(tree.levels) for replica in members}
    feeding = {root for root in tree.roots if tree.children(root)}
    # relay_down_tree() forwards exactly the trainers' rounds with a message to a root that has children
    sources = [end for msgs, end in zip(schedule.rounds, round_ends) if any(m.dst // size in feeding for m in msgs)]
    latency = traffic.topology.latency_us * 1e-6
    free: dict[Direction, float] = defaultdict(float)
    last = 0.0
    for k, msgs in enumerate(relay.schedule.rounds):
        streams: dict[tuple[int, int], list[int]] = defaultdict(list)  # (sender, receiver) -> message sizes
        for m in msgs:
            streams[(m.src, m.dst)].append(m.nbytes)
        sliced = {pair: relay_slices(sizes, relay.chunk_bytes, relay.slice_pieces) for pair, sizes in streams.items()}
        landed: dict[tuple[int, int], float] = {}  # (gen rank, slice) -> when that slice of round k landed there
        for level in sorted({depth[src // size] for src, _ in sliced}):  # parents' forwards before their children's
            links = [pair for pair in sliced if depth[pair[0] // size] == level]
            for j in range(max(len(sliced[pair]) for pair in links)):  # slice by slice: a holder's children alike
                for src, dst in links:
                    if j >= len(sliced[(src, dst)]):
                        continue
                    pieces = sliced[(src, dst)][j]
                    out, into, seconds = traffic.add(gen_gpus[src], gen_gpus[dst], sum(p.nbytes for p in pieces),
                                                     by_trainer=False)
                    ready = sources[k] if level == 0 else landed[(src, j)]
                    done = max(ready, free[out], free[into]) + seconds + (len(pieces) - 1) * latency
                    free[out] = free[into] = landed[(dst, j)] = done
                    last = max(last, done)
    return last


NCCL_CHUNK_BYTES = 512 << 10
"""The piece a broadcast moves down its chain at a time in the model: NCCL's buffer of 4 MiB in 8 steps."""


def _broadcast_relay(traffic: _Traffic, relay: RelayPlan, trainers_end: float, gen_gpus: Sequence[int]) -> float:
    """When a relay by broadcast's last replica has the step. Every message of the trainers to rank ``i`` of the
    first replica travels on down the chain of rank ``i`` of every replica (its relay messages, one per
    replica, name the same bytes); NCCL moves it there in chunks inside its kernels, so each link of a chain
    is busy with its bytes over its rate while the trainers' rounds arrive, and the last replica finishes one
    chunk and one latency per hop after the slowest link of any chain did."""
    size = relay.replica_size
    busy: dict[Direction, float] = defaultdict(float)
    tail = 0.0
    for msgs in relay.schedule.rounds:
        for m in msgs:  # m.dst: rank i of replica r >= 1; its bytes come from rank i of replica r - 1
            out, into, _ = traffic.add(gen_gpus[m.dst - size], gen_gpus[m.dst], m.nbytes, by_trainer=False)
            rate = traffic.topology.rate(out[1])
            busy[out] += m.nbytes / rate
            busy[into] += m.nbytes / rate
            hop = NCCL_CHUNK_BYTES / rate + traffic.topology.latency_us * 1e-6
            tail = max(tail, hop * relay.replica_of(m.dst))
    return max(trainers_end, max(busy.values(), default=0.0)) + tail


def simulate(schedule: Schedule, topology: Topology, placement: GpuPlacement | None = None,
             relay: RelayPlan | None = None) -> Simulation:
    """Predict ``schedule``'s time on ``topology`` (default placement: :meth:`GpuPlacement.disaggregated`).

    With a replica relay plan, its messages are pipelined with the trainers' rounds (a replica forwards
    each round as soon as it landed there, :func:`_pipelined_relay`); forwarding within nodes runs its
    rounds after the trainers' (a leader forwards once its own step landed)."""
    placement = placement or GpuPlacement.disaggregated(schedule.num_src, schedule.num_dst, topology)
    if len(placement.train) != schedule.num_src or len(placement.gen) != schedule.num_dst:
        raise RefitError(f"placement has {len(placement.train)} train / {len(placement.gen)} gen GPUs, "
                         f"the schedule {schedule.num_src} / {schedule.num_dst} ranks")
    traffic = _Traffic(topology)
    rounds = traffic.rounds(schedule.rounds, placement.train, placement.gen, by_trainer=True)
    relay_end, notes = 0.0, []
    if relay is not None and relay.within_nodes:
        forwarding = traffic.rounds(relay.schedule.rounds, placement.gen, placement.gen, by_trainer=False)
        rounds += forwarding
        notes.append(f"forwarding:   {format_duration(sum(forwarding))} of the predicted time, after the trainers' "
                     "rounds; the bound counts every byte a gen GPU holds as if it crossed its NIC, which "
                     "forwarding within nodes avoids, so the prediction can beat it")
    elif relay is not None and relay.broadcast:
        relay_end = _broadcast_relay(traffic, relay, sum(rounds), placement.gen)
        notes.append(f"relay:        by broadcast to {relay.tree.replicas} replicas: the last replica has the step "
                     f"{format_duration(max(relay_end - sum(rounds), 0.0))} after the trainers' last round")
    elif relay is not None:
        ends = list(itertools.accumulate(rounds))
        relay_end = _pipelined_relay(traffic, relay, schedule, ends, placement.gen)
        tail = max(relay_end - sum(rounds), 0.0)
        notes.append(f"relay:        pipelined {len(relay.tree.levels) - 1} hop(s) below the trainers' "
                     f"{len(relay.tree.roots)} replica(s): the last relayed message lands {format_duration(tail)} "
                     "after the trainers' last round")
    bound, sender_bound = traffic.bounds()
    return Simulation(topology, placement, dict(traffic.link_bytes), dict(traffic.load), rounds, bound, sender_bound,
                      bytes=sum(traffic.link_bytes.values()), notes=notes, relay_end_s=relay_end)


@dataclass(frozen=True)
class PublicAnchor:
    """A published refit time, printed beside predictions and labelled as the publisher's."""

    who: str
    what: str
    seconds: str


PUBLIC_ANCHORS: Sequence[PublicAnchor] = (
    PublicAnchor("NeMo-RL", "DeepSeek-V3, Megatron PP16 x EP16 -> vLLM TP32 x DP8, H100", "2.39-2.83 s"),
    PublicAnchor("Perplexity", "Kimi-K2, 256 -> 128 GPUs, BF16 -> FP8 on the sender", "1.3 s"),
    PublicAnchor("vLLM sharded_rdt", "Kimi-K2 on 384 H100", "7.53 s"),
)


def anchor_lines() -> list[str]:
    return ["published refit times (theirs, not measured here):",
            *(f"  {a.who}: {a.what}: {a.seconds}" for a in PUBLIC_ANCHORS)]


__all__ = ["PUBLIC_ANCHORS", "TOPOLOGIES", "GpuPlacement", "LinkKind", "PublicAnchor", "Simulation", "Topology",
           "anchor_lines", "simulate"]
