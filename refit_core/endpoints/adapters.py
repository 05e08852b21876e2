"""Merged-mode LoRA: every train rank arrives at a step's gather of the adapters before any enters it.

A plugin's :class:`~refit_core.contract.lora.AdapterFactors` ``gather()`` may be a collective over the
trainer's ranks (DTensor ``full_tensor()``), which only the trainer's own process group timeout bounds: with
train rank 1 failing before ``send()``, train rank 0 waited 125.6 s at ``timeout_s=10`` (issue 44). So
each train rank first publishes its arrival in refit's store (``gathered/STEP/train/RANK``) and waits for
every other train rank's, within half the step's deadline (:data:`ARRIVAL_SHARE`): a rank that does not
arrive in time, leaves, or failed its step before the gather (:func:`refuse`) is a named error on every
train rank that waits, none of which enters the collective. Train rank 0 deletes the previous step's
arrivals once every rank arrived at this one.
"""

from __future__ import annotations

from typing import Any

from refit_core.contract.errors import RefitError, TransferError
from refit_core.contract.side import Side
from refit_core.net.keys import RankId, gathered_key, gathered_prefix
from refit_core.net.rendezvous import Rendezvous

ARRIVAL_SHARE = 0.5
"""The share of ``timeout_s`` a train rank waits at the gather for the others: the rest is the transfer's, and
the gen ranks, waiting on the train ranks' headers meanwhile, hear why before their own deadline ends."""
REASON_CHARS = 400
"""How much of a train rank's reason for failing before the gather its arrival record carries."""


def arrive(rdv: Rendezvous, step: int, rank: int, world_size: int, timeout_s: float) -> None:
    """Train rank ``rank`` arrived at ``step``'s gather: return once every train rank did; else a
    :class:`~refit_core.contract.errors.TransferError` within :data:`ARRIVAL_SHARE` of ``timeout_s``
    naming the ranks and why."""
    rdv.publish(gathered_key(step, rank), {"ok": True}, within=timeout_s)
    wait_s = ARRIVAL_SHARE * timeout_s
    others = [r for r in range(world_size) if r != rank]
    if not others:
        return
    what = f"every train rank at step {step}'s gather of the LoRA adapters"
    try:
        arrivals = rdv.wait([gathered_key(step, r) for r in others], what, timeout_s=wait_s,
                            watched={str(RankId(Side.TRAIN, r)) for r in others})
    except RefitError as exc:
        raise TransferError(f"train rank {rank}: merged-mode LoRA gathers the adapters over every train rank "
                            f"each step, and not every train rank reached step {step}'s gather: {exc}; nothing of "
                            "the step moved (every train rank must call send() every step)") from exc
    failed = [f"train rank {r} ({_reason(a)})" for r, a in zip(others, arrivals) if _reason(a) is not None]
    if failed:
        raise TransferError(f"train rank {rank}: {', '.join(failed)} failed step {step} before the gather of the "
                            "LoRA adapters; nothing of the step moved")
    if rank == 0 and step > 0:  # every rank arrived here, so each has read the previous step's arrivals
        rdv.client.delete_prefixed([gathered_prefix(step - 1)], within=timeout_s)


def refuse(rdv: Rendezvous | None, step: int, rank: int, reason: str) -> None:
    """Train rank ``rank`` failed ``step`` before its gather: tell the train ranks waiting there at once
    (best effort; nothing if it arrived already)."""
    if rdv is not None:
        rdv.offer(gathered_key(step, rank), {"ok": False, "reason": reason[:REASON_CHARS]})


def _reason(arrival: Any) -> str | None:
    """None for an arrival; a failed rank's reason otherwise."""
    if isinstance(arrival, dict) and arrival.get("ok") is True:
        return None
    return str(arrival.get("reason") if isinstance(arrival, dict) else "a malformed arrival record")


__all__ = ["arrive", "refuse"]
