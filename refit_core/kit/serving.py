"""Whether an engine may serve: every rank's weight version, agreed by its ranks after every refit step.

The engine-agnostic part of the verdict a gen plugin reaches after each step, landed or failed:

1. each rank states its :class:`RankState` (:func:`own_rank_state`, from its ``RefitReceiver``);
2. the ranks exchange them over a ``torch.distributed`` process group the plugin names
   (:func:`gather_reports`: int64 tensors, nothing is unpickled);
3. every rank refuses or resumes by the same verdict (:func:`settle_serving`): if any rank needs a refit or
   the ranks hold different versions, every rank's model raises
   :class:`~refit_core.kit.guard.EngineRefusesError` naming the ranks and their versions -- on every
   rank at once, so no rank waits in a collective for a peer that refused. The next step that lands on
   every rank with one version lifts it.

The plugin keeps what is its engine's: which process group, how it finds its model, whether its engine
restores torn tensors, and the remedy its refusal names.
"""

from __future__ import annotations

import enum
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from refit_core.kit.guard import refuse_engine, resume_engine, torn_tensors

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from refit_core.contract.failures import StepFailure
    from refit_core.endpoints.receiver import RefitReceiver

RANKS_SHOWN = 8
"""How many ranks a refusal names."""


class Suspect(enum.IntEnum):
    """Why a rank's weights need a refit (the values travel in :func:`gather_reports`)."""

    TORN = 1
    """A failed step left some of its tensors partly written, and the engine could not restore them."""
    UNCONFIRMED = 2
    """It could not learn whether a staged step was committed: its peers may hold another version."""

    def describe(self) -> str:
        """The reason as a refusal names it."""
        return "a failed step left weights partly written" if self is Suspect.TORN else \
            "a staged commit could not be confirmed"


@dataclass(frozen=True)
class RankState:
    """One engine rank as refit left it. ``rank``: its gen rank in the refit; ``version``: the weight
    version it holds (None: the engine's own, none from refit yet); ``suspect``: why its weights need a
    refit, None when they are one whole version."""

    rank: int
    version: int | None
    suspect: Suspect | None = None

    @property
    def needs_refit(self) -> bool:
        """True while this rank must not serve until a refit lands on it."""
        return self.suspect is not None

    def describe(self) -> str:
        """This rank as a refusal names it."""
        held = "the engine's initial weights" if self.version is None else f"version {self.version}"
        why = "" if self.suspect is None else f" and needs a refit ({self.suspect.describe()})"
        return f"gen rank {self.rank} holds {held}{why}"


def serving_verdict(states: Sequence[RankState], remedy: str) -> str | None:
    """Why an engine whose ranks are ``states`` must not serve, ending in ``refit again ({remedy})``;
    None when it may (no rank needs a refit and all hold one version). Ranks that need a refit are
    named first, then by gen rank, :data:`RANKS_SHOWN` at most."""
    needy = any(s.needs_refit for s in states)
    if not needy and len({s.version for s in states}) <= 1:
        return None
    ordered = sorted(states, key=lambda s: (not s.needs_refit, s.rank))
    shown = ", ".join(s.describe() for s in ordered[:RANKS_SHOWN])
    more = f" (and {len(ordered) - RANKS_SHOWN} more)" if len(ordered) > RANKS_SHOWN else ""
    split = "" if needy else " (the last step landed on some ranks only)"
    return f"engine refuses to serve: {shown}{more}{split}; refit again ({remedy})"


def settle_serving(module: torch.nn.Module, states: Sequence[RankState], remedy: str) -> str | None:
    """Refuse or resume serving on ``module`` by the engine's ``states`` (:func:`serving_verdict`); the
    refusal, or None when it serves."""
    message = serving_verdict(states, remedy)
    if message is None:
        resume_engine(module)
    else:
        refuse_engine(module, message)
    return message


_SUSPECT: weakref.WeakKeyDictionary[torch.nn.Module, Suspect] = weakref.WeakKeyDictionary()
"""Models whose own weights a step left suspect; cleared only by a step that lands (not by a new session)."""


def own_rank_state(receiver: RefitReceiver | None, module: torch.nn.Module, *, rank: int, version: int | None,
                   restores: bool = False) -> RankState:
    """This rank's state right after a step (or at any time), ``version`` being what ``module`` holds.

    A landed step clears what an earlier one left suspect; a failed one (``receiver.last_failure``) makes
    it :attr:`Suspect.TORN` when it tore tensors the engine did not restore, else
    :attr:`Suspect.UNCONFIRMED` when the staged commit decision could not be learned
    (``StepFailure.undecided``). ``restores``: True when the engine's ``refit_abort_update`` puts torn
    tensors back and names the rest with :func:`~refit_core.kit.guard.refuse_serving` (only those count);
    False when every tensor a failed step touched stays torn. ``receiver`` None (no session yet): the
    state earlier steps left, as gen rank ``rank``; otherwise the receiver's rank.
    """
    if receiver is not None:
        failure = receiver.last_failure
        if failure is None and receiver.version is not None:
            _SUSPECT.pop(module, None)
        elif failure is not None:
            found = _suspect(failure, module, restores)
            if found is not None:
                _SUSPECT[module] = found
        rank = receiver.rank
    return RankState(rank, version, _SUSPECT.get(module))


def _suspect(failure: StepFailure, module: torch.nn.Module, restores: bool) -> Suspect | None:
    if failure.torn and (not restores or torn_tensors(module)):
        return Suspect.TORN
    return Suspect.UNCONFIRMED if failure.undecided else None


@dataclass(frozen=True)
class WorkerReport:
    """One rank's word after a step: its state, and whether its step failed (False: it landed, or the
    plugin does not report it)."""

    state: RankState
    failed: bool = False


def gather_reports(report: WorkerReport, group: ProcessGroup | None, size: int) -> list[WorkerReport]:
    """Every member's report over the CPU (gloo) process ``group`` of ``size`` ranks (None: the default
    group), in group rank order, as int64 tensors (no pickle); one rank: no collective."""
    if size == 1:
        return [report]
    state = report.state
    mine = torch.tensor([state.rank, -1 if state.version is None else state.version, int(state.suspect or 0),
                         int(report.failed)], dtype=torch.int64)
    everyone = [torch.empty_like(mine) for _ in range(size)]
    torch.distributed.all_gather(everyone, mine, group=group)
    return [WorkerReport(RankState(r, None if v < 0 else v, Suspect(s) if s else None), bool(f))
            for r, v, s, f in (t.tolist() for t in everyone)]
