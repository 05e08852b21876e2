"""Choose relay settings by simulation: the replicas the trainers feed, or the floor of forwarding within nodes.

Each candidate's plan is simulated on a :class:`~refit_core.plan.simulate.Topology` and the fastest wins; only
the fastest plan so far is kept in memory (plans at scale take gigabytes). What ``refit plan --relay
replicas=N`` and ``--forward-min-bytes auto`` run, and what an RL framework calls to ask for the fastest relay.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from refit_core.contract.errors import PlanError
from refit_core.contract.options import RelayOptions
from refit_core.plan.offline import PlanSummary
from refit_core.plan.relay import RelayPlan, ReplicaTree, plan_tree, relay_down_tree
from refit_core.plan.simulate import Simulation, Topology, simulate
from refit_core.units import format_bytes

FORWARD_FLOORS = (0, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20)
"""The ``forward_min_bytes`` that :func:`choose_forwarding` simulates by default."""

RELAY_BUCKETS: tuple[int | None, ...] = (None, 64 << 20, 32 << 20, 16 << 20, 8 << 20, 4 << 20)
"""The buckets :func:`choose_relay` tries relay trees with, largest first (None: the planner's own): a relayed
rank forwards a round once it landed, so a tree's depth costs about one round's bytes per hop, and smaller
buckets make smaller rounds at a latency per message; deep chains want small ones."""


RELAY_CHUNKS: tuple[int, ...] = (0, 16 << 20, 8 << 20, 4 << 20, 2 << 20)
"""The ``chunk_bytes`` :func:`choose_relay` tries each relay tree with, whole rounds first (0): slices of a
round are forwarded as they land, so a hop costs a slice instead of a round, at a latency per piece."""


class Planner(Protocol):
    """Plans the refit with the given relay options and bucket (None: its own; e.g. with
    :func:`~refit_core.plan.offline.plan_from_metadata`)."""

    def __call__(self, relay: RelayOptions, bucket_bytes: int | None = None) -> PlanSummary: ...


class RelayShape(enum.StrEnum):
    """How a candidate's replicas get the step."""

    DIRECT = "direct"  # the trainers feed every replica (no relay)
    CHAIN = "chain"  # fanout 1: every holder forwards to one replica
    TREE = "tree"  # every holder forwards to up to ``fanout`` replicas
    BROADCAST = "broadcast"  # every replica hears the trainers' messages in NCCL broadcasts


@dataclass(frozen=True)
class Prediction:
    """One candidate's relay options and what its plan predicts.

    ``predicted_s`` is None where the options plan no forwarding at all (no shared region reaches the
    floor), so there was nothing new to simulate. ``baseline`` is True for the candidate without relay
    (direct fanout, or no forwarding within nodes). ``shape`` and ``levels`` describe the replica relay's
    tree (``levels`` 1: the trainers feed every replica); ``bound_s`` is the receiver-side bound;
    ``forwarded_bytes`` the bytes gen ranks forward to each other.
    """

    relay: RelayOptions
    predicted_s: float | None
    baseline: bool = False
    shape: RelayShape = RelayShape.DIRECT
    levels: int = 1
    bound_s: float = 0.0
    forwarded_bytes: int = 0
    bucket_bytes: int | None = None
    """The bucket it was planned with (None: the planner's own)."""
    chunk_bytes: int = 0
    """The relay's slices (:attr:`~refit_core.plan.relay.RelayPlan.chunk_bytes`; 0: whole rounds)."""

    @property
    def label(self) -> str:
        """``direct``, ``chain, 2 roots`` or ``tree fanout 4, 1 root, bucket 8.0 MiB, chunks 2.0 MiB``."""
        if self.shape is RelayShape.DIRECT:
            return self.shape.value
        if self.shape is RelayShape.BROADCAST:
            bucket = "" if self.bucket_bytes is None else f", bucket {format_bytes(self.bucket_bytes)}"
            return f"{self.shape.value}{bucket}"
        roots = f"{self.relay.direct} root{'s' if self.relay.direct > 1 else ''}"
        label = f"chain, {roots}" if self.shape is RelayShape.CHAIN else f"tree fanout {self.relay.fanout}, {roots}"
        if self.bucket_bytes is not None:
            label = f"{label}, bucket {format_bytes(self.bucket_bytes)}"
        return label if not self.chunk_bytes else f"{label}, chunks {format_bytes(self.chunk_bytes)}"


@dataclass(frozen=True)
class RelayChoice:
    """The fastest candidate: its relay options, its plan and its prediction, beside every candidate's.

    ``baseline`` is the candidate without relay (direct fanout, or no forwarding within nodes); ties go to it.
    """

    relay: RelayOptions
    plan: PlanSummary
    predicted_s: float
    baseline: Prediction
    candidates: tuple[Prediction, ...]
    refused: str = ""
    """Why no relay was planned (the replicas' layouts differ, e.g. experts sharded across them); empty if none."""
    skipped: tuple[int, ...] = ()
    """Numbers of roots not planned: the trainers' share alone (direct fanout's sender-side bound, scaled to
    the roots) was no faster than the fastest candidate before them."""

    @property
    def chosen(self) -> Prediction:
        """The chosen candidate's prediction (a tree's candidates in slices share its relay options)."""
        chunk = self.plan.relay.chunk_bytes if self.plan.relay is not None else 0
        return next(p for p in self.candidates if p.relay is self.relay and p.chunk_bytes == chunk)

    @property
    def chose_baseline(self) -> bool:
        """True when no candidate beat the baseline."""
        return self.relay is self.baseline.relay

    @property
    def speedup(self) -> float:
        """The baseline's predicted time over the chosen one's (1.0 when the baseline was chosen)."""
        assert self.baseline.predicted_s is not None  # the baseline is always simulated
        return self.baseline.predicted_s / self.predicted_s


OnPrediction = Callable[[Prediction], None]
"""Hears each candidate's prediction as soon as it is simulated."""


def simulated(summary: PlanSummary, topology: Topology) -> Simulation:
    """A planned refit (its relay or forwarding included) simulated on ``topology``."""
    return simulate(summary.schedule, topology, relay=summary.relay)


def predicted_s(summary: PlanSummary, topology: Topology) -> float:
    """The simulated time of a planned refit (its relay or forwarding included) on ``topology``."""
    return simulated(summary, topology).predicted_s


def relay_options(relay: RelayOptions, *, drop: Sequence[str] = (), **changes: Any) -> RelayOptions:
    """``relay`` with ``changes`` set and the ``drop`` settings back to their defaults; the settings it
    was given explicitly stay explicit (what ranks that must agree on them compare)."""
    given = {name: getattr(relay, name) for name in relay.explicit if name not in drop}
    return RelayOptions(**{**given, **changes})


def without_forwarding(relay: RelayOptions) -> RelayOptions:
    """``relay`` without forwarding within nodes (``node_ranks`` and ``forward_min_bytes`` at their defaults)."""
    return relay_options(relay, drop=("node_ranks", "forward_min_bytes"))


class _Fastest:
    """The fastest plan so far (ties keep the earlier one) and every prediction."""

    def __init__(self, on_prediction: OnPrediction | None) -> None:
        self.on_prediction = on_prediction
        self.predictions: list[Prediction] = []
        self.best: tuple[float, RelayOptions, PlanSummary] | None = None

    def add(self, prediction: Prediction, summary: PlanSummary) -> bool:
        """Record ``prediction``; True when its plan is the fastest so far."""
        self.predictions.append(prediction)
        if self.on_prediction is not None:
            self.on_prediction(prediction)
        seconds = prediction.predicted_s
        if seconds is not None and (self.best is None or seconds < self.best[0]):
            self.best = (seconds, prediction.relay, summary)
            return True
        return False

    @property
    def best_s(self) -> float:
        return self.best[0] if self.best is not None else float("inf")

    def choice(self, refused: str = "", skipped: Sequence[int] = ()) -> RelayChoice:
        assert self.best is not None  # the baseline is always simulated
        seconds, relay, summary = self.best
        baseline = next(p for p in self.predictions if p.baseline)
        return RelayChoice(relay, summary, seconds, baseline, tuple(self.predictions), refused, tuple(skipped))


def relay_candidates(replicas: int) -> list[int]:
    """The ``direct`` values :func:`choose_relay` tries: every replica, then 1, 2, 4... roots below it."""
    return [replicas, *(1 << k for k in range(replicas.bit_length()) if 1 << k < replicas)]


def fanout_candidates(replicas: int) -> list[int]:
    """The ``fanout`` values :func:`choose_relay` tries: 1 (chains), 2, 4... up to the first that lets one root
    feed every other replica."""
    fanouts = [1]
    while fanouts[-1] < replicas - 1:
        fanouts.append(fanouts[-1] * 2)
    return fanouts


def choose_relay(plan: Planner, relay: RelayOptions, topology: Topology, *, fanouts: Sequence[int] | None = None,
                 buckets: Sequence[int | None] = (None,), chunks: Sequence[int] = RELAY_CHUNKS,
                 broadcast: bool = True, on_prediction: OnPrediction | None = None) -> RelayChoice:
    """Simulate direct fanout (the trainers feed all ``relay.replicas``) and relay trees with 1, 2, 4...
    roots (skipping those the trainers' share alone rules out), each with the fanouts of ``fanouts``
    (default: ``relay.fanout`` where given explicitly, else :func:`fanout_candidates`: chains and trees) and
    the buckets of ``buckets`` (e.g. :data:`RELAY_BUCKETS`) and the slices of ``chunks`` (e.g.
    :data:`RELAY_CHUNKS`), each in order while they get faster; with ``broadcast`` (the transport has broadcasts
    of its own: NCCL), the relay by broadcast with each bucket too; the fastest, direct fanout on ties.

    The trainers' schedule depends on the roots and the bucket only: it is planned once for each, and each
    fanout's and chunk's relay messages derived from it (:func:`~refit_core.plan.relay.relay_down_tree`);
    trees that come out the same for two fanouts are simulated once. A chosen candidate that was derived is
    planned again with its own options, so that its fingerprint hashes its tree, and cut in its chunks."""
    if fanouts is None:
        fanouts = [relay.fanout] if "fanout" in relay.explicit else fanout_candidates(relay.replicas)
    fastest = _Fastest(on_prediction)
    options = relay_options(relay, direct=relay.replicas)
    summary = plan(options)
    sim = simulated(summary, topology)
    fastest.add(Prediction(options, sim.predicted_s, baseline=True, bound_s=sim.bound_s), summary)
    skipped: list[int] = []
    try:
        best_derived = _relay_trees(plan, relay, topology, fastest, _Grid(fanouts, buckets, chunks),
                                    sim.sender_bound_s, skipped)
    except PlanError as e:
        return fastest.choice(refused=str(e))
    if broadcast:
        _broadcasts(plan, relay, topology, fastest, buckets)
    choice = fastest.choice(skipped=skipped)
    if best_derived:
        chosen = choice.chosen
        summary = plan(choice.relay, chosen.bucket_bytes)
        if chosen.chunk_bytes:
            assert summary.relay is not None  # a relay candidate
            summary = replace(summary, relay=_chunked(summary, chosen.chunk_bytes))
        choice = replace(choice, plan=summary)
    return choice


@dataclass(frozen=True)
class _Grid:
    """The relay candidates' settings besides the roots: fanouts, buckets and chunks, each tried in order."""

    fanouts: Sequence[int]
    buckets: Sequence[int | None]
    chunks: Sequence[int]


def _chunked(summary: PlanSummary, chunk_bytes: int) -> RelayPlan:
    """``summary``'s relay plan with its messages cut in slices of ``chunk_bytes``."""
    assert summary.relay is not None
    return relay_down_tree(ReplicaTree(summary.relay.replica_size, summary.relay.tree), summary.schedule, chunk_bytes)


def _relay_trees(plan: Planner, relay: RelayOptions, topology: Topology, fastest: _Fastest, grid: _Grid,
                 sender_s: float, skipped: list[int]) -> bool:
    """:func:`choose_relay`'s relay candidates; True when the fastest one's relay messages were derived.

    Roots are tried fewest first; a number of roots whose trainers' share alone (``sender_s``, direct
    fanout's sender-side bound, scaled to the roots: replicas are identical) is no faster than the fastest
    so far is not planned (added to ``skipped``). Per number of roots, the buckets are tried in order until
    one predicts slower than the one before."""
    best_derived = False
    for direct in relay_candidates(relay.replicas)[1:]:
        if sender_s * direct / relay.replicas >= fastest.best_s:
            skipped.append(direct)
            continue
        previous = float("inf")
        for bucket in grid.buckets:
            seconds, derived = _trees(plan, relay, topology, fastest, grid, direct, bucket)
            best_derived = best_derived if derived is None else derived
            if seconds > previous:
                break
            previous = seconds
    return best_derived


def _trees(plan: Planner, relay: RelayOptions, topology: Topology, fastest: _Fastest, grid: _Grid,
           direct: int, bucket: int | None) -> tuple[float, bool | None]:
    """The trees of ``direct`` roots and one bucket, fanouts in order while they get faster, each with the
    chunks in order while they get faster: the fastest one's prediction, and whether the fastest candidate
    so far is now one of them with derived relay messages (None: none of them became the fastest)."""
    planned: PlanSummary | None = None
    seen: set[tuple[int, ...]] = set()
    best, derived = float("inf"), None
    for fanout in grid.fanouts:
        tree = plan_tree(relay.replicas, direct, fanout)
        if tree.parent in seen:
            continue
        seen.add(tree.parent)
        options = relay_options(relay, direct=direct, fanout=fanout)
        if planned is None:
            planned = plan(options, bucket)
        assert planned.relay is not None  # planned with 0 < direct < replicas
        fanout_best = float("inf")
        for chunk in grid.chunks:
            if chunk:  # the options a run takes: RelayOptions.chunk_bytes reaches the planner and the receivers
                options = relay_options(relay, direct=direct, fanout=fanout, chunk_bytes=chunk)
            summary = planned
            if chunk or planned.relay.tree.parent != tree.parent:
                summary = replace(planned, relay=relay_down_tree(ReplicaTree(planned.relay.replica_size, tree),
                                                                 planned.schedule, chunk))
            sim = simulated(summary, topology)
            shape = RelayShape.CHAIN if fanout == 1 else RelayShape.TREE
            if fastest.add(Prediction(options, sim.predicted_s, shape=shape, levels=len(tree.levels),
                                      bound_s=sim.bound_s, bucket_bytes=bucket, chunk_bytes=chunk), summary):
                derived = summary is not planned
            if sim.predicted_s >= fanout_best:  # equal: the pieces change nothing (every message fits one)
                break
            fanout_best = sim.predicted_s
        if fanout_best > best:
            break
        best = fanout_best
    return best, derived


def _broadcasts(plan: Planner, relay: RelayOptions, topology: Topology, fastest: _Fastest,
                buckets: Sequence[int | None]) -> None:
    """:func:`choose_relay`'s relay by broadcast, with each of ``buckets`` in order while they get faster."""
    options = relay_options(relay, direct=1, broadcast=True, drop=("fanout", "chunk_bytes", "slice_pieces"))
    previous = float("inf")
    for bucket in buckets:
        summary = plan(options, bucket)
        sim = simulated(summary, topology)
        fastest.add(Prediction(options, sim.predicted_s, shape=RelayShape.BROADCAST, levels=2, bound_s=sim.bound_s,
                               bucket_bytes=bucket), summary)
        if sim.predicted_s >= previous:
            break
        previous = sim.predicted_s


def choose_forwarding(plan: Planner, relay: RelayOptions, topology: Topology, *,
                      floors: Sequence[int] = FORWARD_FLOORS,
                      on_prediction: OnPrediction | None = None) -> RelayChoice:
    """Simulate the refit without forwarding within nodes and with ``relay`` forwarding from each of
    ``floors`` (``forward_min_bytes``) up; the fastest, no forwarding on ties."""
    fastest = _Fastest(on_prediction)
    options = without_forwarding(relay)
    summary = plan(options)
    fastest.add(Prediction(options, predicted_s(summary, topology), baseline=True), summary)
    for floor in floors:
        options = relay_options(relay, forward_min_bytes=floor)
        summary = plan(options)
        if summary.relay is None:
            fastest.add(Prediction(options, None), summary)
            continue
        fastest.add(Prediction(options, predicted_s(summary, topology),
                               forwarded_bytes=summary.relay.schedule.summary.bytes), summary)
    return fastest.choice()


__all__ = ["FORWARD_FLOORS", "RELAY_BUCKETS", "RELAY_CHUNKS", "OnPrediction", "Planner", "Prediction", "RelayChoice",
           "RelayShape", "choose_forwarding", "choose_relay", "fanout_candidates", "predicted_s", "relay_candidates",
           "relay_options", "simulated", "without_forwarding"]
