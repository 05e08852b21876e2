"""A verl job with refit as its checkpoint engine, for tests/verl (run in the test's process, ``.venv-verl``).

:func:`verl_job` starts one Ray session holding verl's actor (2 workers of a :class:`verl_workers.Actor` class),
a rollout worker (verl's ``CheckpointEngineWorker``) and verl's ``CheckpointEngineManager``, configured by the
overrides of docs/migration/verl.md's "after" block composed into verl's own ``ppo_trainer`` config.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import torch

from tests.docs.docs_snippets import ROOT, page_snippets

GUIDE = ROOT / "docs" / "migration" / "verl.md"


def guide_overrides() -> list[str]:
    """The overrides of the guide's "after" block, run as the page runs it."""
    (block,) = [s for s in page_snippets(GUIDE) if s.code.startswith("# after") and "overrides = " in s.code]
    namespace: dict[str, Any] = {}
    exec(compile(block.code, block.where, "exec"), namespace)
    return namespace["overrides"]


def checkpoint_engine_config(overrides: list[str]) -> Any:
    """verl's checkpoint-engine config from its own ``ppo_trainer`` defaults and ``overrides``; the test adds
    the loopback address (Ray's node address here is not one this sandbox may use)."""
    import verl
    from hydra import compose, initialize_config_dir
    from verl.utils.config import omega_conf_to_dataclass

    with initialize_config_dir(config_dir=str(Path(verl.__file__).parent / "trainer" / "config"), version_base=None):
        config = compose(config_name="ppo_trainer", overrides=[
            *overrides, "+actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.refit.host=127.0.0.1",
            "+actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.refit.timeout_s=120"])
    return omega_conf_to_dataclass(config.actor_rollout_ref.rollout.checkpoint_engine)


def tiny_checkpoint(path: Path) -> Path:
    """A tiny Qwen3 HF checkpoint (refit's ``tiny-qwen3`` preset, seed 0) at ``path``."""
    from refit_dtensor import build_model

    from refit_core.apps import load_config

    build_model(load_config("tiny-qwen3"), seed=0).save_pretrained(path)
    return path


@dataclass(frozen=True)
class Job:
    """verl's checkpoint-engine config, actor and rollout worker groups, and its manager."""

    config: Any
    actor: Any
    rollout: Any
    manager: Any


@contextmanager
def verl_job(actor_class: type, training: Any, model: Any, rollout_dtype: torch.dtype | None = None) -> Iterator[Job]:
    """verl's actor (2 workers of ``actor_class`` with ``training``), its rollout worker (``model``'s HF config,
    other weights, in ``rollout_dtype``) and checkpoint-engine manager, in one Ray session."""
    from cpu_platform import RUNTIME_ENV
    from verl.checkpoint_engine import CheckpointEngineManager
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from verl.workers.config import RolloutConfig
    from verl_workers import Replica, Rollout

    config = checkpoint_engine_config(guide_overrides())
    ray.init(num_cpus=8, include_dashboard=False, runtime_env=RUNTIME_ENV, log_to_driver=False)
    try:
        actor = RayWorkerGroup(resource_pool=RayResourcePool([2], use_gpu=False, max_colocate_count=1),
                               ray_cls_with_init=RayClassWithInitArgs(ray.remote(actor_class), config=training,
                                                                      checkpoint_engine=config),
                               device_name="cpu")
        actor.reset()
        rollout = RayWorkerGroup(
            resource_pool=RayResourcePool([1], use_gpu=False, max_colocate_count=1, name_prefix="rollout"),
            ray_cls_with_init=RayClassWithInitArgs(ray.remote(Rollout), rollout_config=RolloutConfig(
                name="vllm", checkpoint_engine=config), model_config=model, dtype=rollout_dtype), device_name="cpu")
        manager = CheckpointEngineManager(config=config, actor_wg=actor, replicas=[Replica(rollout.workers)])
        yield Job(config, actor, rollout, manager)
    finally:
        ray.shutdown()


def differing(job: Job) -> list[str]:
    """The rollout's parameters that differ, in any bit, from the actor's weights."""
    want, got = job.actor.full_weights()[0], job.rollout.weights()[0]
    assert want.keys() == got.keys()
    return [name for name in want if not torch.equal(want[name], got[name])]
