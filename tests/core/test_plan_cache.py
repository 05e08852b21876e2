"""PlanCache: setups with the same metadata and settings plan once (a fleet's replicas of one layout)."""

import torch

from refit_core import Box, RefitOptions, TensorSpec
from refit_core.contract.pieces import PieceMeta
from refit_core.plan.planning import PlanCache, plan_with_relay


def metas(rows: int, ranks: int) -> list[list[PieceMeta]]:
    spec = TensorSpec("model.w", (rows, 8), torch.float32)
    part = rows // ranks
    return [[PieceMeta(spec, Box((r * part, 0), (part, 8)))] for r in range(ranks)]


def test_one_plan_per_layout_and_settings_each_planned_once():
    cache, settings = PlanCache(capacity=2), RefitOptions().resolved("cpu")
    first = cache.plan(metas(16, 1), metas(16, 2), settings)
    again = cache.plan(metas(16, 1), metas(16, 2), settings)  # equal metadata, other objects
    assert again is first and (cache.misses, cache.hits) == (1, 1)
    assert first[0].fingerprint == plan_with_relay(metas(16, 1), metas(16, 2), settings)[0].fingerprint
    other_layout = cache.plan(metas(16, 1), metas(16, 4), settings)
    other_settings = cache.plan(metas(16, 1), metas(16, 2), RefitOptions(bucket_bytes=64).resolved("cpu"))
    assert len({first[0].fingerprint, other_layout[0].fingerprint, other_settings[0].fingerprint}) == 3
    assert (cache.misses, cache.hits) == (3, 1)
    cache.plan(metas(16, 1), metas(16, 2), settings)  # evicted (capacity 2): planned again
    assert (cache.misses, cache.hits) == (4, 1)
