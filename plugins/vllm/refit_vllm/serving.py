"""Whether a vLLM engine may serve: every rank's weight version, agreed after every refit step.

After each step (landed or failed) every worker of the engine states its :class:`RankState` and the
workers exchange them (vLLM's world group, as int64 tensors: nothing is unpickled). If any rank needs
a refit (a failed step tore weights vLLM could not restore, or a staged commit this rank could not
confirm) or the ranks hold different versions, every worker's model refuses to serve: its forward
raises :class:`EngineRefusesError` naming the ranks and their versions -- on every rank at once, so no
rank waits in a collective for a peer that refused. The next step that lands on every rank with one
version lifts the refusal. ``RefitWorkerExtension.refit_rank_state`` (through ``collective_rpc``) and
:func:`engine_rank_states` show each rank's state.

The verdict itself is :mod:`refit_core.kit`'s (``serving_verdict``, ``gather_reports``, ``own_rank_state``);
this module keeps what is vLLM's: its world group, its restoring abort hook, which worker reports the
engine's error, and the ``collective_rpc`` views.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from refit_core import RefitError
from refit_core.kit import (
    EngineRefusesError,
    RankState,
    Suspect,
    WorkerReport,
    engine_refusal,
    gather_reports,
    own_rank_state,
    refuse_engine,
    resume_engine,
    serving_verdict,
    settle_serving,
)

from .state import state_of

if TYPE_CHECKING:
    from refit_core import RefitReceiver

REMEDY = "init_weight_transfer_engine / refit_init, then a step that lands on every rank"
"""What a refusal tells the user to do."""

# this plugin's names for the kit's engine-verdict hook on a model
refuse, resume, refused = refuse_engine, resume_engine, engine_refusal


def refusal(states: Sequence[RankState]) -> str | None:
    """Why an engine whose ranks are ``states`` must not serve; None when it may."""
    return serving_verdict(states, REMEDY)


def own_state(receiver: RefitReceiver | None, model: torch.nn.Module, rank: int, version: int | None) -> RankState:
    """This rank's state right after a step (or at any time), as gen rank ``rank`` before any session:
    where vLLM restored every tensor a failed step touched (the reload path puts the old kernel tensors
    back; the plugin's abort hook names the rest), the step leaves nothing torn."""
    return own_rank_state(receiver, model, rank=rank, version=version, restores=True)


def gather(report: WorkerReport) -> tuple[list[WorkerReport], int]:
    """Every worker's report over vLLM's world group (all ranks of the engine; one rank: no
    collective), and this worker's index among them."""
    from vllm.distributed.parallel_state import get_world_group

    group = get_world_group()
    return gather_reports(report, group.cpu_group, group.world_size), group.rank_in_group


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
    state = state_of(model)
    mine = own_state(receiver, model, receiver.rank, None if state is None else state.version)
    reports, index = gather(WorkerReport(mine, failed))
    refused = settle_serving(model, [r.state for r in reports], REMEDY)
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
