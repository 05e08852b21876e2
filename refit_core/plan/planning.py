"""The whole static plan of a refit from metadata: what a live setup and ``refit plan`` both run."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Hashable, Sequence

from refit_core.contract.options import RefitOptions
from refit_core.contract.pieces import PieceMeta
from refit_core.plan.fast import plan_transfers_fast
from refit_core.plan.relay import RelayPlan, plan_node_forwarding, relay_down_tree, replica_tree
from refit_core.plan.schedule import Schedule, build_schedule


def plan_with_relay(train_metas: Sequence[Sequence[PieceMeta]], gen_metas: Sequence[Sequence[PieceMeta]],
                    settings: RefitOptions, *,
                    expert_groups: Collection[str] = ()) -> tuple[Schedule, RelayPlan | None]:
    """The whole static plan from (expert-grouped) metadata and the agreed ``settings``: the trainers'
    schedule into the gen ranks they feed, and the relay plan (None without relay), whose tree or
    forwarding messages are hashed into the schedule's fingerprint with the settings. What a live setup
    and ``refit plan`` run."""
    assert settings.bucket_bytes is not None, "resolve the options first (RefitOptions.resolved)"
    options, agreed, fed = settings.relay, settings.digest(), gen_metas
    tree = replica_tree(options, gen_metas) if options.fans_out else None
    forwarding = (plan_node_forwarding(options.node_ranks, gen_metas, settings.bucket_bytes, settings.messages,
                                       expert_groups=expert_groups, min_bytes=options.forward_min_bytes)
                  if options.forwards_within_nodes else None)
    if tree is not None:
        fed, agreed = tree.direct_metas(gen_metas), f"{agreed}|{tree.digest}"
    elif forwarding is not None:
        fed, agreed = forwarding.direct_metas(gen_metas), f"{agreed}|{forwarding.digest}"
    transfers = plan_transfers_fast(train_metas, fed, cast=settings.cast,
                                    allow_unused_sources=settings.allow_unused_sources)
    schedule = build_schedule(transfers, len(train_metas), len(gen_metas), settings.bucket_bytes, settings.messages,
                              expert_groups=expert_groups, agreed_settings=agreed)
    if tree is None:
        return schedule, forwarding
    return schedule, relay_down_tree(tree, schedule, options.chunk_bytes, options.slice_pieces)


class PlanCache:
    """Plans kept by everything that decides them: both sides' (expert-grouped) metadata, the agreed settings
    and the expert groups, so that setups with the same inputs plan once (a fleet's replicas of one layout;
    the trainers' metadata does not change between them). Holds the ``capacity`` plans used last."""

    def __init__(self, capacity: int = 8) -> None:
        self.capacity = capacity
        self._plans: OrderedDict[Hashable, tuple[Schedule, RelayPlan | None]] = OrderedDict()
        self.hits = self.misses = 0

    def plan(self, train_metas: Sequence[Sequence[PieceMeta]], gen_metas: Sequence[Sequence[PieceMeta]],
             settings: RefitOptions, *, expert_groups: Collection[str] = ()) -> tuple[Schedule, RelayPlan | None]:
        """:func:`plan_with_relay` of these inputs, planned on the first call only."""
        key = (tuple(map(tuple, train_metas)), tuple(map(tuple, gen_metas)), settings.digest(),
               frozenset(expert_groups))
        found = self._plans.get(key)
        if found is not None:
            self.hits += 1
            self._plans.move_to_end(key)
            return found
        self.misses += 1
        found = self._plans[key] = plan_with_relay(train_metas, gen_metas, settings, expert_groups=expert_groups)
        while len(self._plans) > self.capacity:
            self._plans.popitem(last=False)
        return found


__all__ = ["PlanCache", "plan_with_relay"]
