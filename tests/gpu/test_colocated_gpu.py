"""GPU tests of colocated refit: two processes on ONE GPU, the same-GPU pair through CUDA IPC.

Skipped without CUDA (CI has none); ``benchmarks/run_gpu.sh`` runs them on the GPU machine.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.environments import BY_DESIGN
from refit_core.apps import same_bytes

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason=f"{BY_DESIGN}needs a CUDA GPU")]


def _toy_rank(rank: int, world: int, address: str, fault: bool):
    from refit_toy.demo import reference
    from refit_toy.models import ToyEngine, ToyTrainer

    from refit_core import RefitOptions, RefitReceiver, RefitSender
    from refit_core.kit.verify import mismatches

    device = "cuda:0"
    torch.cuda.set_device(device)
    options = RefitOptions(timeout_s=60)
    try:
        if rank == 0:
            model = ToyTrainer(0, 1, device=device)
            sender = RefitSender(model, rendezvous=address, rank=0, world_size=1, options=options)
            sender.setup()
            links = sorted({link.value for link in sender.links.values()})
            for step in range(3):
                model.load({k: v.to(device) for k, v in reference(0, step).items()})
                if fault and step == 1:  # the trainer replaces a parameter (``param.data = ...``)
                    name, (offsets, shard) = next(iter(model.shards.items()))
                    model.shards[name] = (offsets, torch.randn_like(shard))
                sender.send(version=step)
            return links
        engine = ToyEngine(0, 1, device=device)
        receiver = RefitReceiver(engine, rendezvous=address, rank=0, world_size=1, options=options)
        receiver.setup()
        pieces = receiver.plugins.destination_map(engine).pieces
        checks = []
        for step in range(3):
            stats = receiver.receive()
            checks.append((stats.version, mismatches(pieces, reference(0, step))))
        return checks
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        import time
        time.sleep(2 if rank == 0 else 0)  # the store's host: let the peer read the error first
        return type(exc).__name__, str(exc)


def test_two_processes_on_one_gpu_refit_through_cuda_ipc_bitwise():
    """Trainer and engine share cuda:0 (NCCL cannot connect them): fused qkv, grouped experts and a
    bf16 destination cast, copied straight out of the trainer's memory, three steps."""
    from refit_core.kit.launch import free_port, spawn

    links, checks = spawn(_toy_rank, 2, f"127.0.0.1:{free_port()}", False, timeout_s=300)
    assert links == ["cuda-ipc"]
    assert checks == [(0, []), (1, []), (2, [])]


def test_a_replaced_trainer_parameter_fails_the_step_on_both_processes():
    from refit_core.kit.launch import free_port, spawn

    sent, received = spawn(_toy_rank, 2, f"127.0.0.1:{free_port()}", True, timeout_s=300)
    for kind, message in (sent, received):
        # the gen rank's StepFailedError is the TransferError that also names what the step touched
        assert kind in ("TransferError", "StepFailedError"), (kind, message)
        assert "now lives at a different address than at setup" in message, (kind, message)


def test_colocated_benchmark_is_bitwise_on_one_gpu(tmp_path):
    from refit_core.tools.bench.colocated import main

    prefix = str(tmp_path / "colocated")
    rc = main(["--device", "cuda", "--models", "tiny-llama,tiny-qwen3-moe", "--iters", "2", "--warmup", "1",
               "--timeout-s", "120", "--bound-gib", "0.25", "--out", prefix])
    report = json.loads(open(prefix + ".json").read())
    assert rc == 0, report["rows"]
    for row in report["rows"]:
        if row["method"] == "refit":
            assert row["info"]["links"] == ["cuda-ipc"]
            assert row["engine_extra_bytes"] == 0 and row["shared_bytes"] == 0
            assert row["trainer_extra_bytes"] == 0  # nothing staged: the engine reads the parameters
            assert row["staging_bytes"] == {"trainer": 0, "engine": 0}
        if row["method"] == "ping-pong":  # its two 1 GiB buffers, counted once (the trainer allocates them)
            assert 2 << 30 <= row["trainer_extra_bytes"] < (2 << 30) + (64 << 20)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason=f"{BY_DESIGN}needs 2 CUDA GPUs")
def test_colocated_tp2_trainer_and_engine_mix_cuda_ipc_and_nccl_in_one_step(tmp_path):
    """TP2 Megatron-style on GPUs 0,1 -> vLLM-style TP1 x DP2 on the same GPUs 0,1: the same-GPU pairs
    go through CUDA IPC, the cross pairs through NCCL, in every step; bitwise."""
    from refit_core.tools.bench import main

    config = tmp_path / "dense.json"
    from refit_core.kit.models import PRESETS

    config.write_text(json.dumps(dict(PRESETS["tiny-llama"], hidden_size=512, intermediate_size=1024,
                                      num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                                      vocab_size=4096, dtype="bfloat16")))
    prefix = str(tmp_path / "result")
    rc = main(["--device", "cuda", "--models", str(config), "--methods", "refit", "--warmup", "1", "--iters", "2",
               "--min-iters", "1", "--train-tp", "2", "--gen-tp", "1", "--gen-dp", "2",
               "--train-gpus", "0,1", "--gen-gpus", "0,1", "--bucket-mib", "1", "--out", prefix])
    report = json.loads(open(prefix + ".json").read())
    assert rc == 0, report
    (row,) = report["models"][0]["rows"]
    assert row["checks"] == ["bitwise ok"]
    assert row["info"]["links"] == ["cuda-ipc", "network"]


@pytest.mark.parametrize("strided", ["kernel", "blocks", "foreach", "memcpy2d", "triton"])
def test_every_strided_variant_is_bitwise_on_the_gpu(strided):
    """The copy program's strided variants on CUDA (``memcpy2d`` is ``cudaMemcpy2DAsync`` only here):
    Megatron's per-group ``[q; k; v]`` rows into ``[Q; K; V]``, every bit pattern, NaNs included."""
    from refit_core.contract.options import StridedCopy
    from refit_core.run.copies import CopyProgram

    groups, q, kv, hidden = 8, 512, 128, 4096
    gen = torch.Generator(device="cuda").manual_seed(3)
    numel = groups * (q + 2 * kv) * hidden
    qkv = torch.randint(0, 1 << 15, (numel,), dtype=torch.int16, device="cuda", generator=gen)
    qkv = qkv.view(torch.bfloat16).view(groups, q + 2 * kv, hidden)
    out = torch.zeros(groups * (q + 2 * kv), hidden, dtype=torch.bfloat16, device="cuda")
    Q, K = groups * q, groups * kv
    pairs = []
    for g in range(groups):
        pairs += [(out[g * q:(g + 1) * q], qkv[g, :q]), (out[Q + g * kv:Q + (g + 1) * kv], qkv[g, q:q + kv]),
                  (out[Q + K + g * kv:Q + K + (g + 1) * kv], qkv[g, q + kv:])]
    expected = torch.cat([qkv[:, :q].reshape(-1, hidden), qkv[:, q:q + kv].reshape(-1, hidden),
                          qkv[:, q + kv:].reshape(-1, hidden)])
    program = CopyProgram(pairs, strided=StridedCopy(strided))
    program.run()
    torch.cuda.synchronize()
    assert same_bytes(out, expected)
    assert program.counts.strided == 3
    if strided == "triton":  # every strided copy in one launch; q, k and v all start on 16-byte rows
        assert program.counts.launches == 1
