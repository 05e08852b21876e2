"""refit as verl's checkpoint engine for a Megatron actor, end to end with verl's own engine (``.venv-verl``).

verl's ``CheckpointEngineManager`` syncs verl's ``MegatronEngineWithLMHead`` (``strategy=megatron``, mbridge, tensor
parallel over 2 Ray workers, gloo, bf16) into a rollout worker with the ``refit`` backend of the guide's "after"
block. refit reads each rank's tensor-parallel shards in place through refit-plugin-megatron's mapping; verl's
generator (mbridge's export, which all-gathers every tensor-parallel weight) is closed unread. The reference is
that very export, taken outside the sync: the rollout's bf16 parameters equal it bit for bit after each of 3
steps. Then the offload story with verl's own Megatron offload round trip (parameter buffers freed and allocated
again): refused by name, then planned per step with ``param_offload``. ``megatron_workers.py`` says what lets
verl's CUDA-only Megatron engine build on the host.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.environments import require

require("verl")

import torch
from verl_job import differing, tiny_checkpoint, verl_job

STEPS = (1, 2, 3)


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """verl's Megatron actor (TP=2 over 2 workers), rollout worker and manager, in one Ray session."""
    from megatron_workers import MegatronActor
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import HFModelConfig, McoreEngineConfig, McoreOptimizerConfig
    from verl.workers.engine_workers import TrainingWorkerConfig

    path = tiny_checkpoint(tmp_path_factory.mktemp("tiny-qwen3"))
    model = HFModelConfig(path=str(path), load_tokenizer=False, override_config={"attn_implementation": "eager"})
    training = TrainingWorkerConfig(
        model_type="language_model", model_config=model, checkpoint_config=CheckpointConfig(),
        engine_config=McoreEngineConfig(tensor_model_parallel_size=2, vanilla_mbridge=True, dtype="bfloat16",
                                        sequence_parallel=False,
                                        override_transformer_config={"sequence_parallel": False}),
        optimizer_config=McoreOptimizerConfig(lr=1e-3, total_training_steps=len(STEPS)))
    with verl_job(MegatronActor, training, model, rollout_dtype=torch.bfloat16) as running:
        yield running


def test_the_actor_is_verls_megatron_engine_split_over_tensor_parallel_ranks(job: Any) -> None:
    shapes = job.actor.local_shapes()
    assert shapes[0].keys() == shapes[1].keys()
    qkv = "module.module.decoder.layers.0.self_attention.linear_qkv.weight"
    assert shapes[0][qkv] == (128, 128)  # tiny-qwen3: 4 heads of 32 and 2 KV heads, q/k/v rows split over TP 2


def test_three_steps_land_bitwise_planned_once_nothing_gathered(job: Any) -> None:
    actor, rollout, manager = job.actor, job.rollout, job.manager
    assert differing(job), "the rollout started with other weights"
    for step in STEPS:
        actor.train_step(step)
        before = actor.gathers()
        manager.update_weights(global_steps=step)
        assert actor.gathers() == before, "the sync all-gathered a tensor"
        assert differing(job) == [], f"step {step}"
    assert actor.setups() == [1, 1] and rollout.setups() == [1]
    assert rollout.updates() == [[(step, 0) for step in STEPS]]  # verl's global_steps; nothing yielded


def test_offload_moved_parameters_refused_then_planned_per_step(job: Any) -> None:
    """verl's own Megatron offload round trip moves every parameter: refused by name unless ``param_offload``
    tells refit's engine to plan each step where the parameters are."""
    actor, rollout, manager = job.actor, job.rollout, job.manager
    actor.train_step(4)
    assert actor.offload_round_trip() == [True, True]
    with pytest.raises(Exception, match=r"source tensor 0\.\S+ now lives at a different address"):
        manager.update_weights(global_steps=4)
    actor.offload_parameters(True)  # param_offload: set up after the load, close after the offload
    for step in (5, 6):
        actor.train_step(step)
        assert actor.offload_round_trip() == [True, True]
        manager.update_weights(global_steps=step)
        assert differing(job) == [], f"step {step}"
    assert actor.setups() == [3, 3] and rollout.setups() == [3]


def test_verls_own_export_gathers_what_refit_leaves_in_place(job: Any) -> None:
    """The counter sees gathers: verl's own sync (its generator, iterated) all-gathers every tensor-parallel
    weight of the tiny model (embedding, output layer and per layer qkv, o_proj, fc1, fc2: 2 + 4 x 2)."""
    before = job.actor.gathers()
    job.actor.full_weights()
    assert [after - was for after, was in zip(job.actor.gathers(), before)] == [10, 10]
