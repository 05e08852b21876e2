"""``refit bench --gen-dp N``: the broadcast of one replica's bytes, the reference of a fleet (issue #48)."""

from __future__ import annotations

import json
import re

import pytest

from refit_core.tools.bench.broadcast import BroadcastGroup, broadcast_does_not_apply, broadcast_plan, with_broadcast
from refit_core.tools.bench.results import broadcast_ratio, wire_ratio
from refit_core.tools.bench.validity import TOLERANCE

LLAMA_BYTES = 16_060_522_496  # llama-3-8b-shape, one replica


def _ranks(train: int, gen_tp: int, gen_dp: int, devices: list[str] | None = None) -> list[dict]:
    ranks = [{"side": "train", "side_rank": i, "tp": train, "tp_rank": i} for i in range(train)]
    ranks += [{"side": "gen", "side_rank": j, "tp": gen_tp, "tp_rank": j % gen_tp} for j in range(gen_tp * gen_dp)]
    for r, spec in enumerate(ranks):
        spec["device"] = devices[r] if devices else "cpu"
    return ranks


def _row(method: str, seconds: float, nbytes: int) -> dict:
    return {"method": method, "time_s": seconds, "bytes": nbytes, "info": {}}


def test_a_fleet_method_faster_than_the_broadcast_prints_invalid():
    # H200 x4, llama-3-8b-shape, 1 -> 3 replicas: the broadcast took 45.1 ms, direct refit 130.8 ms
    broadcast = _row("broadcast", 0.0451, 3 * LLAMA_BYTES)
    refit = broadcast_ratio(_row("refit", 0.1308, 3 * LLAMA_BYTES), broadcast)
    assert refit.valid and refit.value == pytest.approx(0.0451 / 0.1308)
    assert refit.times_text() == "2.900x (0.345)"
    near = broadcast_ratio(_row("refit@replicas=3+relay=1", 0.0451 / (TOLERANCE - 0.01), 3 * LLAMA_BYTES), broadcast)
    assert near.valid  # within the tolerance: noise
    fast = broadcast_ratio(_row("refit@replicas=3+relay=1", 0.0400, 3 * LLAMA_BYTES), broadcast)
    assert not fast.valid
    assert fast.times_text().startswith("INVALID (1.127 of the broadcast of the same bytes to every replica")
    unlike = broadcast_ratio(_row("refit", 0.1308, 2 * LLAMA_BYTES), broadcast)
    assert not unlike.valid and "not the same bytes" in unlike.text()
    assert not broadcast_ratio(_row("refit", float("nan"), 3 * LLAMA_BYTES), _row("broadcast", float("nan"),
                                                                                  3 * LLAMA_BYTES)).valid
    # the wire of the trainer's pairs bounds direct fanout, not a relay (the pipelined relay took 78.4 ms)
    wire = _row("wire", 0.1300, 3 * LLAMA_BYTES)
    direct = dict(_row("refit", 0.1308, 3 * LLAMA_BYTES), links={f"cuda:0->cuda:{g}": LLAMA_BYTES for g in (1, 2, 3)})
    assert wire_ratio(direct, wire).valid
    relay = dict(_row("refit@replicas=3+relay=1", 0.0784, 3 * LLAMA_BYTES), links={"cuda:0->cuda:1": LLAMA_BYTES})
    relayed = wire_ratio(relay, wire)
    assert not relayed.valid and "the wire of the train ranks' pairs is no bound" in relayed.text()
    assert broadcast_ratio(relay, broadcast).times_text() == "1.738x (0.575)"


def test_the_broadcast_is_the_reference_only_of_one_train_rank_feeding_replicas():
    ranks = _ranks(1, 2, 2)  # one train rank -> TP2 x DP2: a broadcast per gen TP rank
    plan = broadcast_plan(ranks, {1: 100, 2: 60, 3: 100, 4: 60}.__getitem__)
    assert plan.groups == (BroadcastGroup((0, 1, 3), 100), BroadcastGroup((0, 2, 4), 60))
    assert (plan.replicas, plan.replica_bytes, plan.landed_bytes) == (2, 160, 320)
    assert plan.of_rank(2) == (plan.groups[1],)
    assert with_broadcast(["wire", "refit"], ranks, 1) == (["broadcast", "wire", "refit"], None)
    methods, why = with_broadcast(["refit", "broadcast"], _ranks(2, 1, 2), 2)  # TP2 -> TP1 x DP2
    assert methods == ["refit"] and why is not None and "the reference is the wire" in why
    assert with_broadcast(["wire", "refit"], _ranks(1, 1, 1), 1) == (["wire", "refit"], None)  # no fleet: silent
    assert "one replica" in with_broadcast(["broadcast"], _ranks(1, 1, 1), 1)[1]
    shared = broadcast_does_not_apply(_ranks(1, 1, 3, ["cuda:0", "cuda:1", "cuda:1", "cuda:2"]), 1)
    assert shared is not None and "cuda:1" in shared
    assert broadcast_does_not_apply(_ranks(1, 1, 3, ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]), 1) is None


def test_fleet_bench_on_cpu_times_the_broadcast_of_a_replicas_bytes(tmp_path):
    from refit_core.tools.bench import main

    prefix = str(tmp_path / "fleet")
    rc = main(["--device", "cpu", "--models", "tiny-llama", "--gen-dp", "2", "--methods", "refit",
               "--warmup", "1", "--iters", "1", "--min-iters", "1", "--bucket-mib", "1", "--out", prefix])
    assert rc == 0
    summary = json.loads(open(prefix + ".json").read())["models"][0]
    rows = {r["method"]: r for r in summary["rows"]}
    assert list(rows) == ["broadcast", "refit"]  # added by itself, first
    broadcast, refit = rows["broadcast"], rows["refit"]
    assert broadcast["checks"] == ["checksum ok"] and refit["checks"] == ["bitwise ok"]
    replica = summary["ranks"][1]["model_bytes"]  # what one replica (one gen rank) receives in a refit step
    assert broadcast["info"]["broadcast_bytes"] == replica and broadcast["info"]["broadcast_replicas"] == 2
    assert broadcast["bytes"] == refit["bytes"] == 2 * replica
    assert broadcast["info"]["broadcast_buckets"] == -(-replica // (1 << 20))
    text = open(prefix + ".md").read()
    assert f"broadcast (the reference of a fleet): {replica:,} bytes from the train rank to each of 2 replicas" in text
    line = next(ln for ln in text.splitlines() if ln.startswith("- refit: "))
    assert re.fullmatch(r"- refit: (\d+\.\d{3}x \(\d\.\d{3}\)|INVALID \(.+ of the broadcast of the same bytes.+\))",
                        line), line
