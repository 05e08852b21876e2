"""Subset steps of one endpoint: which executor a step naming only some tensors runs (:mod:`refit_core.plan.subset`).

A step may move only some of the plan's tensors (``send(only=...)`` / ``receive(only=...)``). Each
subset gets its own sub-schedule, derived from this rank's network rounds and made into an executor once;
its headers go to every peer of the whole schedule with the subset's digest, so a peer running another
subset fails the step on both ends before any byte moves.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Union

import torch

from refit_core.contract.errors import RefitError
from refit_core.contract.experts import ExpertNamer
from refit_core.contract.side import Side
from refit_core.net.keys import RankId, subset_key, subset_verdict_key
from refit_core.net.rendezvous import Rendezvous
from refit_core.plan import subset
from refit_core.plan.items import Message
from refit_core.plan.subset import SubSchedules, Subset
from refit_core.endpoints.binding import BoundMemory
from refit_core.run.executor import HeaderScope, ReceiveExecutor, SendExecutor, StepCount, SubsetTag

PLANNER = RankId(Side.TRAIN, 0)
"""The rank that checks every new subset against the plan."""
NetworkExecutor = Union[SendExecutor, ReceiveExecutor]
MakeExecutor = Callable[[list[list[Message]], HeaderScope, StepCount | None], NetworkExecutor]
"""Makes a network executor of this rank's side for ``rounds`` whose headers claim ``scope``, counting its
steps on the given :class:`StepCount` (None: its own)."""


class Subsets:
    """The subsets one endpoint moved since setup, each with its executor, made and bound once.

    ``group_sizes`` are every grouped expert tensor's expert count; ``plan_names`` the logical tensors the
    train side sends (the planner's; None elsewhere: the planner alone refuses names the plan does not move);
    ``make`` makes this side's network executors.
    """

    def __init__(self, side: Side, rank: int, rendezvous: Rendezvous, expert_name: ExpertNamer,
                 group_sizes: dict[str, int], plan_names: frozenset[str] | None, make: MakeExecutor) -> None:
        self.side, self.rank = side, rank
        self._make = make
        self._rdv = rendezvous
        self._expert_name = expert_name
        self._group_sizes = group_sizes
        self._plan_names = plan_names
        self._schedules: SubSchedules | None = None
        """This rank's sub-schedules, derived from its network rounds (None: no subset asked for yet)."""
        self._executors: dict[int, NetworkExecutor] = {}
        """The network executor of each subset asked for (by digest)."""
        self._bound: dict[int, list[torch.Tensor]] = {}
        """The views each subset's executor was last bound to (by digest)."""
        self._names: dict[int, frozenset[str]] = {}
        """The subsets this rank moved (by digest), each offered to the store once (:func:`subset_key`)."""

    def of(self, names: Iterable[str]) -> Subset:
        """The :class:`~refit_core.plan.subset.Subset` a step naming ``names`` moves. On the train side every
        rank refuses, by name, a subset naming a tensor the plan does not move: the planner checks each
        new subset and publishes its verdict, which the other train ranks wait for (once per subset)."""
        chosen = subset.subset_of(names, self._expert_name, self._group_sizes)
        if self.side is Side.TRAIN and chosen.digest not in self._names:
            verdict = self._verdict(chosen)
            if verdict is not None:
                raise RefitError(verdict)
        return chosen

    def _verdict(self, chosen: Subset) -> str | None:
        """Why the plan cannot move ``chosen`` (None: it can): the planner's own check, published for the
        other train ranks, or the planner's verdict as they read it."""
        key = subset_verdict_key(chosen.digest)
        known = self._plan_names
        if known is None:
            (verdict,) = self._rdv.wait([key], "train rank 0's check of the subset", watched={str(PLANNER)})
            return None if verdict is None else str(verdict)
        unknown = sorted(chosen.names - known)
        verdict = None if not unknown else (
            f"the subset names {len(unknown)} tensor(s) the plan does not move: {subset.listed(unknown)} (the plan "
            f"moves {len(known)} tensor(s): {subset.listed(sorted(known))})")
        self._rdv.offer(key, verdict)
        return verdict

    @property
    def derived(self) -> int:
        """How many sub-schedules were derived (a subset asked for again derives nothing)."""
        return 0 if self._schedules is None else self._schedules.derived

    @property
    def whole_scope(self) -> HeaderScope:
        """What the whole schedule's executor's headers claim: the whole plan, explaining subset mismatches."""
        return HeaderScope(explain=self.explain)

    def executor_for(self, only: Iterable[str] | None, whole: NetworkExecutor | None, bound: BoundMemory,
                     refusal: str | None) -> tuple[Subset | None, NetworkExecutor | None]:
        """The subset a step moving ``only`` moves (None: the whole plan) and the executor it runs: ``whole``
        for the whole plan, else the subset's (made once, bound to the ``bound`` views once per bind).
        ``refusal`` says why this rank cannot run a subset step (None: it can)."""
        if only is None:
            return None, whole
        chosen = self.of(only)
        if refusal is not None:
            raise RefitError(f"{self.side} rank {self.rank} cannot move a subset of the plan in one step: {refusal}")
        if chosen.digest not in self._names:  # for the error of a peer moving another subset
            self._names[chosen.digest] = chosen.names
            self._rdv.offer(subset_key(chosen.digest), sorted(chosen.names))
        if whole is None:
            return chosen, None  # no network pairs here: nothing moves either way
        if self._schedules is None:
            self._schedules = SubSchedules(whole.rounds, bound.names, sender=self.side is Side.TRAIN)
        executor = self._executors.get(chosen.digest)
        if executor is None:
            scope = HeaderScope(SubsetTag(chosen.digest, len(chosen)), tuple(whole.peers()), self.explain)
            executor = self._executors[chosen.digest] = self._make(self._schedules.rounds_for(chosen), scope,
                                                                   whole.steps)
        if self._bound.get(chosen.digest) is not bound.views:
            executor.bind(bound.views)
            self._bound[chosen.digest] = bound.views
        return chosen, executor

    def explain(self, theirs: SubsetTag, ours: SubsetTag) -> str:
        """What the peer's subset ``theirs`` moves that this rank's ``ours`` does not, and the reverse."""
        return subset.difference(theirs.digest, self._names_of(theirs.digest), ours.digest,
                                 self._names_of(ours.digest))

    def close(self) -> None:
        """Drop the subsets' executors (they hold the bound views and, through their headers, this object)."""
        self._executors.clear()
        self._bound.clear()
        self._schedules = None

    def _names_of(self, digest: int) -> frozenset[str] | None:
        """The names of the subset ``digest`` (this rank's, or as its first mover offered them), else None."""
        if digest in self._names:
            return self._names[digest]
        names = self._rdv.read(subset_key(digest))
        if isinstance(names, list) and all(isinstance(n, str) for n in names):
            return frozenset(names)
        return None


__all__ = ["MakeExecutor", "NetworkExecutor", "Subsets"]
