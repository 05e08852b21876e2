"""GPU tests: a 2-process NCCL refit, bitwise, through the benchmark's Megatron/vLLM-style layouts.

Skipped without two CUDA GPUs (CI has none); ``benchmarks/run_gpu.sh`` runs them on the GPU machine.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.environments import BY_DESIGN

from refit_core.kit.models import PRESETS

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                       reason=f"{BY_DESIGN}needs 2 CUDA GPUs"),
]

MiB = 1 << 20


def _configs(tmp_path) -> str:
    dense = dict(PRESETS["tiny-llama"], hidden_size=512, intermediate_size=1024, num_hidden_layers=3,
                 num_attention_heads=8, num_key_value_heads=4, head_dim=64, vocab_size=4096, dtype="bfloat16")
    moe = dict(PRESETS["tiny-qwen3-moe"], hidden_size=256, moe_intermediate_size=128, num_hidden_layers=3,
               num_experts=16, vocab_size=2048, dtype="bfloat16")
    paths = []
    for name, config in (("dense", dense), ("moe", moe)):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(config))
        paths.append(str(path))
    return ",".join(paths)


def _run(tmp_path, *args: str) -> dict:
    from refit_core.tools.bench import main

    prefix = str(tmp_path / "result")
    rc = main(["--device", "cuda", "--models", _configs(tmp_path), "--warmup", "1", "--iters", "2",
               "--min-iters", "1", "--out", prefix, *args])
    report = json.loads(open(prefix + ".json").read())
    assert rc == 0, json.dumps([m["rows"] for m in report["models"]], default=str)[:4000]
    return report


def test_two_process_nccl_refit_is_bitwise(tmp_path, monkeypatch):
    """Megatron-style on GPU 0 -> vLLM-style on GPU 1: wire, both baselines, refit (zero-copy and
    staged) all land every byte; refit's staging stays within buckets x buffers and is freed."""
    monkeypatch.setenv("REFIT_DIRECT_MIN_BYTES", str(64 * 1024))  # own messages at toy sizes
    report = _run(tmp_path, "--methods", "wire,per-tensor,packed,refit,refit@zero_copy=0", "--bucket-mib", "1",
                  "--buffers", "3", "--train-gpus", "0", "--gen-gpus", "1")
    for model in report["models"]:
        rows = {r["method"]: r for r in model["rows"]}
        for name in ("per-tensor", "packed", "refit", "refit@zero_copy=0"):
            assert rows[name]["checks"] == ["bitwise ok"], (model["model"], name, rows[name]["checks"])
        for name in ("refit", "refit@zero_copy=0"):
            row = rows[name]
            assert row["info"]["transport"] == "nccl4py" or row["info"]["transport"] == "torch"
            for side in ("sender", "receiver"):
                assert row[f"{side}_after_extra_bytes"] == 0, (name, side, row)
                assert row[f"{side}_peak_extra_bytes"] <= 3 * MiB + 64 * 1024, (name, side, row)
        assert rows["refit"]["info"]["recv_direct_bytes"] > 0  # zero-copy receives happened


def test_several_ranks_per_gpu_use_pairwise_communicators(tmp_path, monkeypatch):
    """TP2 Megatron-style (both ranks on GPU 0) -> TP2 vLLM-style (both on GPU 1): NCCL refuses two
    ranks of one communicator on a GPU, so every cross-GPU pair gets its own; still bitwise."""
    monkeypatch.setenv("REFIT_DIRECT_MIN_BYTES", str(64 * 1024))
    report = _run(tmp_path, "--methods", "refit", "--train-tp", "2", "--gen-tp", "2",
                  "--train-gpus", "0,0", "--gen-gpus", "1,1", "--bucket-mib", "1")
    for model in report["models"]:
        (row,) = model["rows"]
        assert row["checks"] == ["bitwise ok"]
        assert row["info"]["transport_mode"] == "pairwise"


def _toy_rank(rank: int, world: int, address: str, gpus: tuple[int, int], options: dict | None = None):
    from refit_toy.demo import reference
    from refit_toy.models import ToyEngine, ToyTrainer

    from refit_core import RefitOptions, RefitReceiver, RefitSender
    from refit_core.kit.verify import mismatches

    device = f"cuda:{gpus[rank]}"
    torch.cuda.set_device(device)
    opts = RefitOptions(**{"timeout_s": 60, **(options or {})})
    try:
        if rank == 0:
            model = ToyTrainer(0, 1, device=device)
            sender = RefitSender(model, rendezvous=address, rank=0, world_size=1, options=opts)
            sender.setup()
            for step in range(2):
                model.load({k: v.to(device) for k, v in reference(0, step).items()})
                sender.send(version=step)
            return "sent"
        engine = ToyEngine(0, 1, device=device)
        receiver = RefitReceiver(engine, rendezvous=address, rank=0, world_size=1, options=opts)
        receiver.setup()
        pieces = receiver.plugins.destination_map(engine).pieces
        checks = []
        for step in range(2):
            stats = receiver.receive()
            checks.append((stats.version, mismatches(pieces, reference(0, step))))
        return checks
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return type(exc).__name__, str(exc)


def test_nccl_refit_casts_fp32_to_bf16_and_lands_bitwise():
    """The toy plugin over NCCL (cuda:0 -> cuda:1): fused qkv, grouped experts, a bf16 destination
    cast on the sender."""
    from refit_core.kit.launch import free_port, spawn

    sent, received = spawn(_toy_rank, 2, f"127.0.0.1:{free_port()}", (0, 1), timeout_s=300)
    assert sent == "sent"
    assert received == [(0, []), (1, [])]


def test_two_ranks_on_one_gpu_are_refused_at_setup_when_colocation_is_off():
    from refit_core.kit.launch import free_port, spawn

    results = spawn(_toy_rank, 2, f"127.0.0.1:{free_port()}", (0, 0), {"colocate": "off"}, timeout_s=300)
    for kind, message in results:
        assert kind == "PlanError" and "would connect two ranks on the same GPU (train 0 -> gen 0)" in message
