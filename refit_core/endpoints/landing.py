"""Staged mode's landing vote: every gen rank says whether it landed a step, and no rank applies it unless all did."""

from __future__ import annotations

from refit_core.contract.errors import RefitError, TransferError
from refit_core.net.keys import landed_key, landed_keys
from refit_core.net.rendezvous import Rendezvous

REASON_CHARS = 500
"""How much of a failed rank's error its vote carries."""


def vote(rdv: Rendezvous, step: int, gen_rank: int, failure: str | None = None) -> None:
    """Gen rank ``gen_rank``'s vote on ``step``: landed (``failure`` None) or not, and why."""
    verdict = {"ok": True} if failure is None else {"ok": False, "reason": failure[:REASON_CHARS]}
    rdv.publish(landed_key(step, gen_rank), verdict)


def await_landing(rdv: Rendezvous, step: int, gen_size: int) -> None:
    """Wait until every gen rank has voted on ``step``; raise :class:`TransferError` unless all landed it."""
    try:
        verdicts = rdv.wait(landed_keys(step, gen_size), f"every gen rank to land step {step}")
    except RefitError as exc:
        raise TransferError(f"step {step} was not applied on any gen rank (staged mode): {exc}") from exc
    failed = [(r, v) for r, v in enumerate(verdicts) if not (isinstance(v, dict) and v.get("ok") is True)]
    if failed:
        rank, verdict = failed[0]
        reason = verdict.get("reason") if isinstance(verdict, dict) else verdict
        raise TransferError(f"gen rank {rank} did not land step {step} ({str(reason)[:300]}); "
                            "no gen rank applied it (staged mode): the engine keeps its previous weights")
