"""Whether a vLLM engine may serve: every rank's weight version, agreed after every refit step.

After each step (landed or failed) every worker of the engine states its :class:`RankState` and the
workers exchange them (vLLM's world group, as int64 tensors: nothing is unpickled). If any rank needs
a refit (a failed step tore weights vLLM could not restore, or a staged commit this rank could not
confirm) or the ranks hold different versions, every worker's model refuses to serve: its forward
raises :class:`EngineRefusesError` naming the ranks and their versions -- on every rank at once, so no
rank waits in a collective for a peer that refused. The next step that lands on every rank with one
version lifts the refusal. ``RefitWorkerExtension.refit_rank_state`` (through ``collective_rpc``) and
:func:`engine_rank_states` show each rank's state.
"""

from __future__ import annotations

import enum
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from refit_core import RefitError
from refit_core.kit import torn_tensors

if TYPE_CHECKING:
    from refit_core import RefitReceiver

RANKS_SHOWN = 8
"""How many ranks a refusal names."""


class EngineRefusesError(RefitError):
    """The engine's ranks hold different weight versions, or one needs a refit: serve nothing until a
    refit lands on every rank."""


class Suspect(enum.IntEnum):
    """Why a rank's weights need a refit."""

    TORN = 1
    """A failed step left some of its tensors partly written."""
    UNCONFIRMED = 2
    """It could not learn whether a staged step was committed: its peers may hold another version."""

    def describe(self) -> str:
        return "a failed step left weights partly written" if self is Suspect.TORN else \
            "a staged commit could not be confirmed"


@dataclass(frozen=True)
class RankState:
    """One engine rank as refit left it. ``rank``: its gen rank in the refit (its worker index before
    any refit session); ``version``: the weight version it holds (None: the engine's own, none from
    refit yet); ``suspect``: why its weights need a refit (a failed or unconfirmed step), None when
    they are one whole version."""

    rank: int
    version: int | None
    suspect: Suspect | None = None

    @property
    def needs_refit(self) -> bool:
        """True while this rank must not serve until a refit lands on it."""
        return self.suspect is not None

    def describe(self) -> str:
        held = "the engine's initial weights" if self.version is None else f"version {self.version}"
        why = "" if self.suspect is None else f" and needs a refit ({self.suspect.describe()})"
        return f"gen rank {self.rank} holds {held}{why}"


def refusal(states: Sequence[RankState]) -> str | None:
    """Why an engine whose ranks are ``states`` must not serve; None when it may."""
    needy = any(s.needs_refit for s in states)
    if not needy and len({s.version for s in states}) <= 1:
        return None
    ordered = sorted(states, key=lambda s: (not s.needs_refit, s.rank))
    shown = ", ".join(s.describe() for s in ordered[:RANKS_SHOWN])
    more = f" (and {len(ordered) - RANKS_SHOWN} more)" if len(ordered) > RANKS_SHOWN else ""
    split = "" if needy else " (the last step landed on some ranks only)"
    return (f"engine refuses to serve: {shown}{more}{split}; refit again "
            "(init_weight_transfer_engine / refit_init, then a step that lands on every rank)")


class _Refusal:
    def __init__(self, model: torch.nn.Module, message: str) -> None:
        self.message = message
        self.handle = model.register_forward_pre_hook(self, prepend=True)

    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        raise EngineRefusesError(self.message)


_REFUSALS: weakref.WeakKeyDictionary[torch.nn.Module, _Refusal] = weakref.WeakKeyDictionary()
_SUSPECT: weakref.WeakKeyDictionary[torch.nn.Module, Suspect] = weakref.WeakKeyDictionary()
"""Models whose own weights a step left suspect; cleared only by a step that lands (not by a new session)."""


def refuse(model: torch.nn.Module, message: str) -> None:
    """Make every forward of ``model`` raise :class:`EngineRefusesError` with ``message`` until :func:`resume`."""
    resume(model)
    _REFUSALS[model] = _Refusal(model, message)


def resume(model: torch.nn.Module) -> None:
    """``model`` serves again (no-op when it was not refused)."""
    refused = _REFUSALS.pop(model, None)
    if refused is not None:
        refused.handle.remove()


def refused(model: torch.nn.Module) -> str | None:
    """Why ``model`` refuses to serve, or None when it serves."""
    found = _REFUSALS.get(model)
    return None if found is None else found.message


def own_state(receiver: RefitReceiver | None, model: torch.nn.Module, rank: int, version: int | None) -> RankState:
    """This rank's state right after a step (or at any time): a landed step clears ``needs_refit``; a
    failed one sets it when the core says the rank needs a refit, except where vLLM restored every
    tensor the step touched (the plugin's reload path puts the old kernel tensors back)."""
    if receiver is not None:
        failure = receiver.last_failure
        if failure is None and receiver.version is not None:
            _SUSPECT.pop(model, None)
        elif failure is not None and receiver.needs_refit:
            if not failure.torn:  # nothing written, yet the core says refit: the commit was not learned
                _SUSPECT[model] = Suspect.UNCONFIRMED
            elif torn_tensors(model):  # what vLLM could not restore (the plugin's abort hook names it)
                _SUSPECT[model] = Suspect.TORN
        rank = receiver.rank
    return RankState(rank, version, _SUSPECT.get(model))


@dataclass(frozen=True)
class WorkerReport:
    """One worker's word after a step: its state, and whether its step failed."""

    state: RankState
    failed: bool


def gather(report: WorkerReport) -> tuple[list[WorkerReport], int]:
    """Every worker's report over vLLM's world group (all ranks of the engine; one rank: no
    collective), and this worker's index among them."""
    from vllm.distributed.parallel_state import get_world_group

    group = get_world_group()
    if group.world_size == 1:
        return [report], 0
    return gather_over(report, group.cpu_group, group.world_size), group.rank_in_group


def gather_over(report: WorkerReport, group: Any, size: int) -> list[WorkerReport]:
    """Every member's report over the gloo ``group`` of ``size`` ranks, as int64 tensors (no pickle)."""
    state = report.state
    mine = torch.tensor([state.rank, -1 if state.version is None else state.version, int(state.suspect or 0),
                         int(report.failed)], dtype=torch.int64)
    everyone = [torch.empty_like(mine) for _ in range(size)]
    torch.distributed.all_gather(everyone, mine, group=group)
    return [WorkerReport(RankState(r, None if v < 0 else v, Suspect(s) if s else None), bool(f))
            for r, v, s, f in (t.tolist() for t in everyone)]


def settle(states: Sequence[RankState], model: torch.nn.Module) -> str | None:
    """Refuse or resume serving on this worker by the engine's ``states``; the refusal, or None."""
    message = refusal(states)
    if message is None:
        resume(model)
    else:
        refuse(model, message)
    return message


@dataclass(frozen=True)
class StepOutcome:
    """What every worker learned after a step. ``refusal``: why the engine refuses to serve (None: it
    serves); ``failed``: the gen ranks whose step failed; ``reports``: True on the one worker that
    raises the engine's error -- the last: vLLM reads its workers' replies in rank order and stops at
    the first error, so an error from an earlier worker would leave the later ones' replies to answer
    its next call."""

    refusal: str | None
    failed: tuple[int, ...]
    reports: bool

    def error(self, own: Exception | None) -> Exception | None:
        """The engine's error for this step (None: none), given this worker's own (None: it landed)."""
        others = f"; the step failed on gen rank(s) {list(self.failed)}" if self.failed else ""
        if self.refusal is not None:
            mine = "" if own is None else f". This worker's step failed: {own}"
            return EngineRefusesError(f"{self.refusal}{others}{mine}")
        if own is not None:
            return own
        if self.failed:
            return RefitError(f"refit step failed on gen rank(s) {list(self.failed)}; every rank holds the "
                              "same version and serves it (their own errors are in their logs)")
        return None


def after_step(receiver: RefitReceiver, model: torch.nn.Module, *, failed: bool) -> StepOutcome:
    """Every worker, right after a step (``failed``: this worker's failed): agree with the others
    whether the engine may serve, refuse or resume on this worker, and say who reports."""
    from .state import state_of

    state = state_of(model)
    mine = own_state(receiver, model, receiver.rank, None if state is None else state.version)
    reports, index = gather(WorkerReport(mine, failed))
    refused = settle([r.state for r in reports], model)
    if state is not None:  # the last worker of this engine core's executor (with DP, of this replica)
        parallel = state.vllm_config.parallel_config
        last = parallel.rank == parallel.world_size - 1
    else:
        last = index == len(reports) - 1
    return StepOutcome(refused, tuple(r.state.rank for r in reports if r.failed), last)


def engine_rank_states(llm: Any) -> list[RankState]:
    """Each worker's :class:`RankState` of an ``LLM`` built with ``worker_extension_cls=EXTENSION``
    (:mod:`refit_vllm.extension`), through ``collective_rpc``."""
    return [RankState(rank, version, Suspect(suspect) if suspect else None)
            for rank, version, suspect in llm.collective_rpc("refit_rank_state")]


def check_serving(llm: Any) -> None:
    """Raise :class:`EngineRefusesError` if any worker of ``llm`` (built with ``worker_extension_cls=
    EXTENSION``) refuses to serve: call it before generating after a failed step, since vLLM's
    multiprocess engine core stops for good at the first forward that raises."""
    for message in llm.collective_rpc("refit_refusal"):
        if message is not None:
            raise EngineRefusesError(message)


__all__ = ["EngineRefusesError", "RankState", "StepOutcome", "Suspect", "check_serving", "engine_rank_states",
           "refusal", "refused"]
