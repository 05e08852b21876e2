"""Whether an SGLang engine may serve: every TP worker's weight version, agreed after every refit step.

After each step (landed or failed) every TP worker states its :class:`RankState` and the workers
exchange them over SGLang's TP group (int64 tensors: nothing is unpickled). If any worker needs a
refit (a failed step wrote part of its weights -- SGLang's parameters are written in place and the
old ones are gone -- or it could not confirm a staged commit) or the workers hold different versions,
every worker's model refuses to serve: its forward raises :class:`EngineRefusesError` naming the ranks
and their versions, on every worker at once (no worker waits in a TP collective for a peer that
refused). The next step that lands on every worker with one version lifts it.
:func:`refit_sglang.worker.rank_state` shows a worker's state.

The verdict itself is :mod:`refit_core.kit`'s (the same as the vLLM plugin's); this module keeps what
is SGLang's: its TP group and the remedy a refusal names.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from refit_core.kit import (
    EngineRefusesError,
    RankState,
    Suspect,
    WorkerReport,
    engine_refusal,
    gather_reports,
    serving_verdict,
    settle_serving,
)

REMEDY = "a step that lands on every TP worker"
"""What a refusal tells the user to do."""

refused = engine_refusal  # why a model refuses to serve, None while it serves


def refusal(states: Sequence[RankState]) -> str | None:
    """Why an engine whose workers are ``states`` must not serve; None when it may."""
    return serving_verdict(states, REMEDY)


def settle(states: Sequence[RankState], model: torch.nn.Module) -> str | None:
    """Refuse or resume serving on this worker by the engine's ``states``; the refusal, or None."""
    return settle_serving(model, states, REMEDY)


Exchange = Callable[[RankState], list[RankState]]
"""Every TP worker's state, given this worker's (a collective of the engine's TP group)."""


def sglang_exchange(state: RankState) -> list[RankState]:
    """:data:`Exchange` over SGLang's TP group (its CPU / gloo side)."""
    from sglang.srt.distributed import get_tp_group

    group = get_tp_group()
    return [report.state for report in gather_reports(WorkerReport(state), group.cpu_group, group.world_size)]


__all__ = ["EngineRefusesError", "Exchange", "RankState", "Suspect", "refusal", "refused", "sglang_exchange"]
