"""The simulator against real runs: the committed `refit bench` results of 2 and 4 x H200.

Each case re-plans the benchmark's own layouts (Megatron-style trainer -> vLLM-style engine, built on
the meta device) with the options the benchmark used, simulates the schedule on the benchmark's
GPUs with the measured wire rate of that run as the NVLink rate, and compares: bytes per GPU pair
must equal the measured ones exactly, and the predicted time must be within 15 % of the measured.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.environments import require

from refit_core.contract.experts import group_side
from refit_core.contract.options import RefitOptions
from refit_core.kit.models import load_config
from refit_core.plan.reference import plan_transfers
from refit_core.plan.schedule import Schedule, build_schedule
from refit_core.plan.simulate import GpuPlacement, Topology, simulate
from refit_core.tools.bench.layouts import MegatronStyleModel, VllmStyleModel, register

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def _bench_schedule(model: str, train_tp: int, gen_tp: int, gen_dp: int) -> Schedule:
    pm = register()
    config = load_config(model)
    src = [[p.meta for p in MegatronStyleModel(config, tp=train_tp, rank=r, device="meta").pieces]
           for r in range(train_tp)]
    dst = [[p.meta for p in VllmStyleModel(config, tp=gen_tp, rank=r % gen_tp, device="meta").pieces]
           for r in range(gen_tp * gen_dp)]
    options = RefitOptions().resolved("cuda")
    grouped_src, grouped_dst = group_side(src, pm.expert_name), group_side(dst, pm.expert_name)
    transfers = plan_transfers(grouped_src.metas, grouped_dst.metas, cast=options.cast)
    assert options.bucket_bytes is not None
    return build_schedule(transfers, len(src), len(dst), options.bucket_bytes, options.messages,
                          expert_groups=set(grouped_src.counts) | set(grouped_dst.counts),
                          agreed_settings=options.digest())


def _gpu(device: str) -> int:
    return int(device.split()[0].removeprefix("cuda:"))


CASES = [  # (result file, model, whether the timing is comparable: one rank per GPU)
    ("h200x2-2026-11-22-final", "llama-3-8b-shape", True),
    ("h200x2-2026-11-22-final", "qwen3-30b-a3b-shape", True),
    ("h200x4-reshard-2026-11-22", "llama-3-8b-shape", True),
    ("h200x4-reshard-2026-11-22", "qwen3-30b-a3b-shape", True),
    ("h200x2-reshard-dp-2026-11-22", "llama-3-8b-shape", False),
]


@pytest.mark.slow
@pytest.mark.parametrize(("result", "model", "timed"), CASES, ids=[f"{r}-{m}" for r, m, _ in CASES])
def test_simulator_matches_measured_bench_runs(result: str, model: str, timed: bool) -> None:
    data = json.loads((RESULTS / f"{result}.json").read_text())
    settings = data["settings"]
    (run,) = [m for m in data["models"] if m["model"] == model]
    rows = {row["method"]: row for row in run["rows"]}
    schedule = _bench_schedule(model, settings["train_tp"], settings["gen_tp"], settings["gen_dp"])
    placement = GpuPlacement(tuple(_gpu(d) for d in run["train"]), tuple(_gpu(d) for d in run["gen"]))
    topology = Topology(gpus_per_node=8, nvlink_gbps=rows["wire"]["gbps"])
    sim = simulate(schedule, topology, placement)

    measured_links = {tuple(int(g.removeprefix("cuda:")) for g in key.split("->")): n
                      for key, n in rows["refit"]["links"].items()}
    assert sim.link_bytes == measured_links
    if timed:  # several ranks time-slicing one GPU are slower than its link: not modelled
        assert sim.predicted_s == pytest.approx(rows["refit"]["time_s"], rel=0.15)
        assert sim.predicted_s >= sim.bound_s


def test_simulator_charges_the_nic_between_nodes_and_reports_the_receiver_bound() -> None:
    schedule = _bench_schedule("tiny-qwen3", 2, 1, 2)
    topology = Topology(gpus_per_node=2, nvlink_gbps=400.0, nic_gbps=50.0, latency_us=0.0)
    across = simulate(schedule, topology, GpuPlacement((0, 1), (2, 3)))  # gen on the second node
    within = simulate(schedule, Topology(gpus_per_node=4, nvlink_gbps=400.0, latency_us=0.0),
                      GpuPlacement((0, 1), (2, 3)))
    assert across.link_bytes == within.link_bytes
    assert across.predicted_s == pytest.approx(within.predicted_s * 8, rel=1e-6)  # 400 / 50 GB/s
    per_gen = schedule.summary.busiest_receiver_bytes
    assert across.bound_s == pytest.approx(per_gen / 50e9)
    assert across.predicted_s >= across.bound_s
    lines = "\n".join(across.lines())
    assert "nic" in lines and "predicted / bound" in lines



def test_a_sender_feeding_replicas_bounds_the_step_from_its_side() -> None:
    """One train GPU feeds two engine replicas on another node: it sends twice what either receives,
    so the sender-side bound is the larger, and no prediction beats it."""
    schedule = _bench_schedule("tiny-qwen3", 1, 1, 2)
    sim = simulate(schedule, Topology(gpus_per_node=2, nic_gbps=50.0, latency_us=0.0), GpuPlacement((0,), (2, 3)))
    per_gen = schedule.summary.busiest_receiver_bytes
    assert schedule.summary.busiest_sender_bytes == 2 * per_gen
    assert sim.bound_s == pytest.approx(per_gen / 50e9)
    assert sim.sender_bound_s == pytest.approx(2 * per_gen / 50e9)
    assert sim.two_sided_bound_s == sim.sender_bound_s
    assert sim.predicted_s >= sim.two_sided_bound_s
    assert "predicted / the larger bound" in "\n".join(sim.lines())

def test_topology_parses_presets_and_items() -> None:
    assert Topology.parse("h100").gpus_per_node == 8
    assert Topology.parse("gpus_per_node=4,nic_gbps=25").nic_gbps == 25.0
    from refit_core import RefitError

    with pytest.raises(RefitError, match="keys are"):
        Topology.parse("nics=3")


def test_refit_plan_simulates_and_explains_as_a_picture(tmp_path, capsys) -> None:
    require("matplotlib")
    from refit_core.tools.cli import main

    png = tmp_path / "plan.png"
    assert main(["plan", "--model", "tiny-qwen3-moe", "--train", "dtensor:fsdp=2", "--gen", "vllm:tp=2",
                 "--simulate", "--topology", "gpus_per_node=2", "--explain", str(png)]) == 0
    out = capsys.readouterr().out
    assert "predicted / bound" in out and "NeMo-RL" in out and "theirs" in out
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    import struct

    width, height = struct.unpack(">II", data[16:24])
    assert width >= 800 and height >= 400
