"""Choose relay settings by simulation: the replicas the trainers feed, or the floor of forwarding within nodes.

Each candidate's plan is simulated on a :class:`~refit_core.plan.simulate.Topology` and the fastest wins; only
the fastest plan so far is kept in memory (plans at scale take gigabytes). What ``refit plan --relay
replicas=N`` and ``--forward-min-bytes auto`` run, and what an RL framework calls to ask for the fastest relay.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from refit_core.contract.options import RelayOptions
from refit_core.plan.offline import PlanSummary
from refit_core.plan.simulate import Topology, simulate

FORWARD_FLOORS = (0, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20)
"""The ``forward_min_bytes`` that :func:`choose_forwarding` simulates by default."""

Planner = Callable[[RelayOptions], PlanSummary]
"""Plans the refit with the given relay options (e.g. :func:`~refit_core.plan.offline.plan_from_metadata`)."""


@dataclass(frozen=True)
class Prediction:
    """One candidate's relay options and what its plan predicts.

    ``predicted_s`` is None where the options plan no forwarding at all (no shared region reaches the
    floor), so there was nothing new to simulate. ``baseline`` is True for the candidate without relay
    (direct fanout, or no forwarding within nodes). ``waves`` counts the replica relay's waves (1: the
    trainers feed every replica); ``forwarded_bytes`` the bytes gen ranks forward to each other.
    """

    relay: RelayOptions
    predicted_s: float | None
    baseline: bool = False
    waves: int = 1
    forwarded_bytes: int = 0


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


def predicted_s(summary: PlanSummary, topology: Topology) -> float:
    """The simulated time of a planned refit (its relay or forwarding rounds included) on ``topology``."""
    return simulate(summary.schedule, topology, relay=summary.relay).predicted_s


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

    def add(self, prediction: Prediction, summary: PlanSummary) -> None:
        self.predictions.append(prediction)
        if self.on_prediction is not None:
            self.on_prediction(prediction)
        seconds = prediction.predicted_s
        if seconds is not None and (self.best is None or seconds < self.best[0]):
            self.best = (seconds, prediction.relay, summary)

    def choice(self) -> RelayChoice:
        assert self.best is not None  # the baseline is always simulated
        seconds, relay, summary = self.best
        baseline = next(p for p in self.predictions if p.baseline)
        return RelayChoice(relay, summary, seconds, baseline, tuple(self.predictions))


def relay_candidates(replicas: int) -> list[int]:
    """The ``direct`` values :func:`choose_relay` tries: every replica, then 1, 2, 4... fewer, largest first."""
    return sorted({replicas, *(1 << k for k in range(replicas.bit_length()) if 1 << k < replicas)}, reverse=True)


def choose_relay(plan: Planner, relay: RelayOptions, topology: Topology, *,
                 on_prediction: OnPrediction | None = None) -> RelayChoice:
    """Simulate direct fanout (the trainers feed all ``relay.replicas``) and relay with 1, 2, 4... replicas
    fed directly (``relay``'s other settings kept); the fastest, direct fanout on ties."""
    fastest = _Fastest(on_prediction)
    for direct in relay_candidates(relay.replicas):
        options = relay_options(relay, direct=direct)
        summary = plan(options)
        waves = len(summary.relay.tree.levels) if summary.relay is not None else 1
        fastest.add(Prediction(options, predicted_s(summary, topology), baseline=direct == relay.replicas,
                               waves=waves), summary)
    return fastest.choice()


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


__all__ = ["FORWARD_FLOORS", "OnPrediction", "Planner", "Prediction", "RelayChoice", "choose_forwarding",
           "choose_relay", "predicted_s", "relay_candidates", "relay_options", "without_forwarding"]
