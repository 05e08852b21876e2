"""The checkpoint-engine side-by-side bench (refit_core/tools/bench/peer.py) on CPU: everything but
checkpoint-engine itself (it needs CUDA): the HF tensors it registers, the engine's loader it drives,
the process roles, the report's arithmetic and flags, and the four-process run with refit and the wire."""

from __future__ import annotations

import json

import pytest
import torch

from refit_core.kit.models import load_config
from refit_core.tools.bench import layouts, peer
from refit_core.tools.bench.validity import Ratio

CPU = torch.device("cpu")


def _pair(name: str):
    config = load_config(name)
    return (layouts.MegatronStyleModel(config, tp=1, rank=0, device=CPU),
            layouts.VllmStyleModel(config, tp=1, rank=0, device=CPU))


def test_registered_tensors_through_the_engine_loader_land_every_byte():
    """What the trainer registers with checkpoint-engine, loaded by the engine's loader, is the
    benchmark's weights bit for bit (per-expert names into the stacked w13 / w2)."""
    trainer, engine = _pair("tiny-qwen3-moe")
    trainer.fill(seed=4)
    engine.poison()
    state = peer.hf_state(trainer, CPU)
    assert any(".experts.0.gate_proj." in n for n in state)
    peer.engine_loader(engine)(list(state.items()))
    assert engine.mismatches(seed=4) == []


def test_the_engine_loader_fails_on_a_wrong_tensor():
    trainer, engine = _pair("tiny-llama")
    trainer.fill(seed=2)
    state = peer.hf_state(trainer, CPU)
    load = peer.engine_loader(engine)
    with pytest.raises(KeyError, match="no tensor named 'model.layers.0.nope'"):
        load([("model.layers.0.nope", torch.zeros(1))])
    engine.poison()
    swapped = dict(state)
    swapped["model.layers.0.self_attn.q_proj.weight"] = state["model.layers.1.self_attn.q_proj.weight"]
    load(list(swapped.items()))
    assert engine.mismatches(seed=2) == ["model.layers.0.self_attn.q_proj.weight" + str(
        next(p.box for p in engine.pieces if p.spec.name == "model.layers.0.self_attn.q_proj.weight"))]


def test_roles_put_each_process_on_its_gpu():
    one, two = peer.Layout(1), peer.Layout(2)
    assert (one.nprocs, one.bound, two.nprocs, two.bound) == (2, "copy-bound", 4, "wire")
    assert [one.device_index(r) for r in range(2)] == [0, 0]
    assert [two.device_index(r) for r in range(4)] == [0, 1, 1, 0]
    assert [one.ps_rank(r) for r in range(2)] == [0, None]
    assert [two.ps_rank(r) for r in range(4)] == [0, None, 1, None]
    assert [one.worker_of(r) for r in range(2)] == [None, 0]
    assert [two.worker_of(r) for r in range(4)] == [None, 1, None, 0]
    # a slice that fits: the Qwen3 MoE shape does not fit whole next to checkpoint-engine's 24 GiB on 80 GB
    fit = peer.fit_model("qwen3-30b-a3b-shape", load_config("qwen3-30b-a3b-shape"), 76 << 30, one, 4 << 30)
    assert fit.sliced and 0 < fit.layers < 48
    gib = 1 << 30  # two models (+10%), the bound's two chunks or none, checkpoint-engine's 3 buckets, 2 GiB
    assert peer.needed_bytes(gib, one, 4 * gib) == int(2.2 * gib) + 2 * gib + 3 * gib + 2 * gib
    assert peer.needed_bytes(gib, two, 4 * gib) == int(2.2 * gib) + 3 * gib + 2 * gib


def _merged(ce: float, h2d: float, refit: float, bound: float, nbytes: int = 16 * 10**9) -> list[dict]:
    return [{"model": "m", "bytes": nbytes, "device_name": "NVIDIA H100 80GB HBM3",
             "times": {"checkpoint-engine": [ce] * 5, "refit": [refit] * 5, "copy-bound": [bound] * 5},
             "ce": {"h2d": [h2d] * 5, "register": [2.0] * 5, "gather_metas": []},
             "checks": {"checkpoint-engine": "bitwise ok", "refit": "bitwise ok"}, "ce_settings": {"auto_pg": True}}]


def test_report_parts_ratios_and_speedups():
    rows = {r["method"]: r for r in peer.summarize(_merged(ce=0.5, h2d=0.4, refit=0.0125, bound=0.011),
                                                    "copy-bound")}
    ce = rows["checkpoint-engine"]
    assert ce["h2d_ms"] == pytest.approx(400) and ce["gpu_part_ms"] == pytest.approx(100)
    assert ce["refit_speedup"] == pytest.approx(40) and ce["refit_speedup_gpu_part"] == pytest.approx(8)
    assert Ratio.from_json(ce["of_bound"]).value == pytest.approx(0.022)
    assert Ratio.from_json(rows["refit"]["of_bound"]).value == pytest.approx(0.88)
    text = peer.table(list(rows.values()), "copy-bound")
    assert "| m | checkpoint-engine | 16.00 | 500.00 | 0.022 |" in text and "40.00 / 8.00" in text


def test_report_flags_a_gpu_part_faster_than_the_bound_and_a_cold_bound():
    rows = {r["method"]: r for r in peer.summarize(_merged(ce=0.5, h2d=0.495, refit=0.02, bound=0.011),
                                                    "copy-bound")}
    assert "above the bound" in Ratio.from_json(rows["checkpoint-engine"]["gpu_part_of_bound"]).text()
    cold = peer.summarize(_merged(ce=0.5, h2d=0.4, refit=0.05, bound=0.04), "copy-bound")
    assert all("timed cold" in Ratio.from_json(r["of_bound"]).text() for r in cold)


def test_arguments_refuse_what_cannot_run():
    with pytest.raises(SystemExit):
        peer._parse(["--device", "cpu"])  # checkpoint-engine needs CUDA
    with pytest.raises(SystemExit):
        peer._parse(["--device", "cpu", "--methods", "refit", "--iters", "3"])
    with pytest.raises(SystemExit):
        peer._parse(["--device", "cpu", "--methods", "refit,nope"])


@pytest.mark.slow
def test_two_gpu_layout_runs_on_cpu_with_refit_and_the_wire(tmp_path):
    """The four processes of the two-GPU run (trainer, engine, checkpoint-engine's rank 1 and rank 0's
    worker) step together; refit lands every byte and the wire's checksum matches."""
    prefix = str(tmp_path / "peer2")
    rc = peer.main(["--device", "cpu", "--gpus", "2", "--methods", "refit", "--models", "tiny-llama",
                    "--timeout-s", "120", "--out", prefix])
    report = json.loads(open(prefix + ".json").read())
    assert rc == 0
    checks = {r["method"]: r["check"] for r in report["rows"]}
    assert checks == {"wire": "checksum ok", "refit": "bitwise ok"}
    assert all(r["samples"] == 5 for r in report["rows"])
    assert "GPU 0 -> GPU 1, four processes" in open(prefix + ".md").read()
