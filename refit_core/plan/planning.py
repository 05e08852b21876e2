"""The whole static plan of a refit from metadata: what a live setup and ``refit plan`` both run."""

from __future__ import annotations

from collections.abc import Collection, Sequence

from refit_core.contract.options import RefitOptions
from refit_core.contract.pieces import PieceMeta
from refit_core.plan.fast import plan_transfers_fast
from refit_core.plan.relay import RelayPlan, plan_relay
from refit_core.plan.schedule import Schedule, build_schedule


def plan_with_relay(train_metas: Sequence[Sequence[PieceMeta]], gen_metas: Sequence[Sequence[PieceMeta]],
                    settings: RefitOptions, *,
                    expert_groups: Collection[str] = ()) -> tuple[Schedule, RelayPlan | None]:
    """The whole static plan from (expert-grouped) metadata and the agreed ``settings``: the trainers'
    schedule into the replicas they feed, and the relay plan (None without relay), whose digest is
    hashed into the schedule's fingerprint with the settings. What a live setup and ``refit plan`` run."""
    assert settings.bucket_bytes is not None, "resolve the options first (RefitOptions.resolved)"
    relay = plan_relay(settings.relay, gen_metas, settings.bucket_bytes, settings.messages,
                       expert_groups=expert_groups)
    fed = gen_metas if relay is None else relay.direct_metas(gen_metas)
    transfers = plan_transfers_fast(train_metas, fed, cast=settings.cast,
                                    allow_unused_sources=settings.allow_unused_sources)
    agreed = settings.digest() if relay is None else f"{settings.digest()}|{relay.digest}"
    schedule = build_schedule(transfers, len(train_metas), len(gen_metas), settings.bucket_bytes, settings.messages,
                              expert_groups=expert_groups, agreed_settings=agreed)
    return schedule, relay


__all__ = ["plan_with_relay"]
