"""LoRA-only steps: verl's FSDP2 engine with a LoRA actor (``model.lora_rank``) as refit's source moves only its
adapters (refit's adapter mode) into a PEFT destination, bit for bit, leaving the base weights alone
(``.venv-verl``). One rank, in this process: verl's ``TrainingWorker`` builds the engine as its Ray worker would."""

from __future__ import annotations

import copy
import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from tests.environments import require

require("verl")

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def _port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture
def lora_engine(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """verl's FSDP2 training engine of a tiny Qwen3 with LoRA rank 8 on all linear layers, world size 1."""
    from refit_dtensor import build_model
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine_workers import TrainingWorker, TrainingWorkerConfig

    from refit_core.apps import load_config

    build_model(load_config("tiny-qwen3"), seed=0).save_pretrained(tmp_path)
    port = _port()
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(key, value)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        model = HFModelConfig(path=str(tmp_path), load_tokenizer=False, lora_rank=8, lora_alpha=16,
                              override_config={"attn_implementation": "eager"})
        worker = TrainingWorker(TrainingWorkerConfig(
            model_type="language_model", model_config=model, engine_config=FSDPEngineConfig(fsdp_size=1,
                                                                                             strategy="fsdp2"),
            optimizer_config=FSDPOptimizerConfig(lr=1e-3, total_training_steps=1)))
        worker.reset()
        yield worker.engine
    finally:
        dist.destroy_process_group()


def weights(model: Any) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}


def test_lora_step_moves_only_the_adapters_bitwise(lora_engine: Any) -> None:
    from peft import get_peft_model
    from refit_dtensor import build_model

    from refit_core import RefitOptions, RefitReceiver, RefitSender
    from refit_verl import source_model

    assert source_model(lora_engine) is lora_engine.module  # a PEFT module, not merged: adapter mode
    with torch.no_grad():  # stands in for a training step: LoRA's B starts at zero
        for name, p in lora_engine.module.named_parameters():
            if "lora_" in name:
                (p.to_local() if isinstance(p, DTensor) else p).add_(0.25)
    rollout = get_peft_model(build_model(lora_engine.model_config.hf_config, seed=1),
                             copy.deepcopy(lora_engine.module.peft_config["default"]))
    before = weights(rollout)
    options, rendezvous = RefitOptions(secret="verl-lora", timeout_s=60), f"127.0.0.1:{_port()}"
    sender = RefitSender(lora_engine, rendezvous=rendezvous, rank=0, world_size=1, options=options)
    receiver = RefitReceiver(rollout, rendezvous=rendezvous, rank=0, world_size=1, options=options)
    with ThreadPoolExecutor(max_workers=1) as helper:
        received = helper.submit(receiver.setup)
        sender.setup()
        received.result()
        received = helper.submit(receiver.receive)
        sent = sender.send(version=3)
        assert received.result().version == 3
    sender.close()
    receiver.close()
    trained, after = weights(lora_engine.module), weights(rollout)
    adapters = [name for name in after if "lora_" in name]
    assert len(adapters) == 28 and all(torch.equal(after[n], trained[n]) for n in adapters)
    assert all(torch.equal(after[n], before[n]) for n in after if n not in adapters)  # base weights untouched
    assert sent.bytes == sum(trained[n].nbytes for n in adapters)
