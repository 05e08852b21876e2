"""Whether an SGLang engine may serve: every TP worker's weight version, agreed after every refit step.

After each step (landed or failed) every TP worker states its :class:`RankState` and the workers
exchange them over SGLang's TP group (int64 tensors: nothing is unpickled). If any worker needs a
refit (a failed step wrote part of its weights -- SGLang's parameters are written in place and the
old ones are gone -- or it could not confirm a staged commit) or the workers hold different versions,
every worker's model refuses to serve: its forward raises :class:`EngineRefusesError` naming the ranks
and their versions, on every worker at once (no worker waits in a TP collective for a peer that
refused). The next step that lands on every worker with one version lifts it.
:func:`refit_sglang.worker.rank_state` shows a worker's state.

The same verdict as the vLLM plugin's ``refit_vllm.serving`` (the two plugins are separate
distributions; the engine-agnostic part belongs in ``refit_core.kit``).
"""

from __future__ import annotations

import enum
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from refit_core import RefitError

if TYPE_CHECKING:
    from refit_core import RefitReceiver

RANKS_SHOWN = 8
"""How many ranks a refusal names."""


class EngineRefusesError(RefitError):
    """The engine's workers hold different weight versions, or one needs a refit: serve nothing until a
    refit lands on every worker."""


class Suspect(enum.IntEnum):
    """Why a worker's weights need a refit."""

    TORN = 1
    """A failed step wrote part of its tensors (in place: the previous weights are gone)."""
    UNCONFIRMED = 2
    """It could not learn whether a staged step was committed: its peers may hold another version."""

    def describe(self) -> str:
        return "a failed step left weights partly written" if self is Suspect.TORN else \
            "a staged commit could not be confirmed"


@dataclass(frozen=True)
class RankState:
    """One TP worker as refit left it. ``rank``: its gen rank in the refit; ``version``: the weight
    version it holds (None: none from refit yet); ``suspect``: why it needs a refit, None when its
    weights are one whole version."""

    rank: int
    version: int | None
    suspect: Suspect | None = None

    @property
    def needs_refit(self) -> bool:
        """True while this worker must not serve until a refit lands on it."""
        return self.suspect is not None

    def describe(self) -> str:
        held = "the engine's initial weights" if self.version is None else f"version {self.version}"
        why = "" if self.suspect is None else f" and needs a refit ({self.suspect.describe()})"
        return f"gen rank {self.rank} holds {held}{why}"


def refusal(states: Sequence[RankState]) -> str | None:
    """Why an engine whose workers are ``states`` must not serve; None when it may."""
    needy = any(s.needs_refit for s in states)
    if not needy and len({s.version for s in states}) <= 1:
        return None
    ordered = sorted(states, key=lambda s: (not s.needs_refit, s.rank))
    shown = ", ".join(s.describe() for s in ordered[:RANKS_SHOWN])
    more = f" (and {len(ordered) - RANKS_SHOWN} more)" if len(ordered) > RANKS_SHOWN else ""
    split = "" if needy else " (the last step landed on some ranks only)"
    return f"engine refuses to serve: {shown}{more}{split}; refit again (a step that lands on every TP worker)"


class _Refusal:
    def __init__(self, model: torch.nn.Module, message: str) -> None:
        self.message = message
        self.handle = model.register_forward_pre_hook(self, prepend=True)

    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        raise EngineRefusesError(self.message)


_REFUSALS: weakref.WeakKeyDictionary[torch.nn.Module, _Refusal] = weakref.WeakKeyDictionary()
_SUSPECT: weakref.WeakKeyDictionary[torch.nn.Module, Suspect] = weakref.WeakKeyDictionary()
"""Models whose own weights a step left suspect; cleared only by a step that lands (not by a new session)."""


def refused(model: torch.nn.Module) -> str | None:
    """Why ``model`` refuses to serve, or None when it serves."""
    found = _REFUSALS.get(model)
    return None if found is None else found.message


def refuse(model: torch.nn.Module, message: str) -> None:
    """Make every forward of ``model`` raise :class:`EngineRefusesError` with ``message`` until :func:`resume`."""
    resume(model)
    _REFUSALS[model] = _Refusal(model, message)


def resume(model: torch.nn.Module) -> None:
    """``model`` serves again (no-op when it was not refused)."""
    previous = _REFUSALS.pop(model, None)
    if previous is not None:
        previous.handle.remove()


def settle(states: Sequence[RankState], model: torch.nn.Module) -> str | None:
    """Refuse or resume serving on this worker by the engine's ``states``; the refusal, or None."""
    message = refusal(states)
    if message is None:
        resume(model)
    else:
        refuse(model, message)
    return message


def own_state(receiver: RefitReceiver, model: torch.nn.Module, version: int | None) -> RankState:
    """This worker's state right after a step: a landed step clears its suspicion; a failed one that
    the core says needs a refit sets it (nothing of SGLang's is restorable)."""
    failure = receiver.last_failure
    if failure is None and receiver.version is not None:
        _SUSPECT.pop(model, None)
    elif failure is not None and receiver.needs_refit:
        _SUSPECT[model] = Suspect.TORN if failure.torn else Suspect.UNCONFIRMED
    return RankState(receiver.rank, version, _SUSPECT.get(model))


def suspect(model: torch.nn.Module) -> Suspect | None:
    """Why ``model``'s own weights need a refit (None: they are one whole version)."""
    return _SUSPECT.get(model)


Exchange = Callable[[RankState], list[RankState]]
"""Every TP worker's state, given this worker's (a collective of the engine's TP group)."""


def gather_over(state: RankState, group: Any, size: int) -> list[RankState]:
    """Every member's state over the gloo ``group`` of ``size`` ranks, as int64 tensors (no pickle)."""
    if size == 1:
        return [state]
    mine = torch.tensor([state.rank, -1 if state.version is None else state.version, int(state.suspect or 0)],
                        dtype=torch.int64)
    everyone = [torch.empty_like(mine) for _ in range(size)]
    torch.distributed.all_gather(everyone, mine, group=group)
    return [RankState(r, None if v < 0 else v, Suspect(s) if s else None) for r, v, s in (t.tolist() for t in everyone)]


def sglang_exchange(state: RankState) -> list[RankState]:
    """:data:`Exchange` over SGLang's TP group (its CPU / gloo side)."""
    from sglang.srt.distributed import get_tp_group

    group = get_tp_group()
    return gather_over(state, group.cpu_group, group.world_size)
