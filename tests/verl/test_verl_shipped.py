"""verl's own CPU checkpoint-engine tests (its wheel's ``tests/checkpoint_engine``), with the backend set to
``refit`` wherever they are backend-generic (``.venv-verl``).

Backend-generic, run here with ``backend="refit"``:

- ``test_global_steps_on_cpu.py`` (both tests): verl's actor worker hands ``global_steps`` to the checkpoint
  engine's ``send_weights`` for any backend but ``naive`` / ``delta_sharded``, and its checkpoint-engine
  worker hands it to ``receive_weights`` and the server adapter: the path the ``refit`` backend takes.
  Run from verl's file with its backend name replaced; refit's real engine then runs the same worker
  methods (the end-to-end test, ``test_verl_checkpoint_engine.py``, runs them across processes).

Not backend-generic (no checkpoint engine in them, or another backend's internals), so not run here:
``test_fsdp_lora_only_checkpoint_on_cpu.py`` (the FSDP checkpoint manager's LoRA save/load to disk),
``test_sglang_fusion_bucketing_on_cpu.py`` (SGLang's server-adapter bucketing), ``test_block_placement.py``
and ``test_sharded_delta.py`` (the ``delta_sharded`` engine's shard math), ``test_sglang_loader.py``
(SGLang's delta loader), ``test_special_server_adapter.py`` (GPUs, NCCL and a real checkpoint),
``test_correctness_on_gpu.py`` (3+ GPUs, a Qwen3-8B checkpoint, and a check of the tensors
``receive_weights`` yields: refit yields none, it writes the rollout's parameters in place; its refit
counterpart on CPU is the end-to-end test), ``test_correctness_on_npu.py`` (Ascend NPUs).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import ModuleType

import pytest

from tests.environments import require

verl = require("verl")

SHIPPED = Path(verl.__file__).parent.parent / "tests" / "checkpoint_engine"
GENERIC = {"test_global_steps_on_cpu.py": ('backend="modelexpress"', 'backend="refit"')}
"""verl's backend-generic test files, and the backend setting each names, switched to refit."""


def shipped(name: str) -> ModuleType:
    """verl's test file ``name``, its backend switched to ``refit`` (as a module of its own name: the
    repository's ``tests`` package shadows verl's)."""
    old, new = GENERIC[name]
    source = (SHIPPED / name).read_text()
    assert source.count(old) == 1, f"verl's {name} no longer sets {old}"
    module = ModuleType(f"verl_shipped_{name.removesuffix('.py')}")
    module.__file__ = str(SHIPPED / name)
    exec(compile(source.replace(old, new), str(SHIPPED / name), "exec"), module.__dict__)
    return module


GLOBAL_STEPS = shipped("test_global_steps_on_cpu.py")
TESTS = sorted(name for name in vars(GLOBAL_STEPS) if name.startswith("test_"))


def test_verl_ships_the_files_listed() -> None:
    on_cpu = sorted(p.name for p in SHIPPED.glob("test_*_on_cpu.py"))
    assert on_cpu == ["test_fsdp_lora_only_checkpoint_on_cpu.py", "test_global_steps_on_cpu.py",
                      "test_sglang_fusion_bucketing_on_cpu.py"], on_cpu
    assert TESTS == ["test_actor_worker_passes_global_steps_to_checkpoint_engine_send",
                     "test_checkpoint_worker_passes_global_steps_to_receive_and_rollout_update"]


@pytest.mark.parametrize("name", TESTS)
def test_verl_global_steps_with_backend_refit(name: str) -> None:
    getattr(GLOBAL_STEPS, name)()


def test_refit_engine_takes_verl_s_send_path() -> None:
    """verl's actor worker, ``backend=refit``: the refit engine's ``send_weights`` gets ``global_steps`` and
    closes verl's (gathering) generator unread; without a set-up sender it says what is missing."""
    from types import SimpleNamespace

    from verl.workers.engine_workers import ActorRolloutRefWorker

    from refit_core import RefitError
    from refit_verl.engine import RefitCheckpointEngine

    read = []

    def weights():  # verl's FSDP2 generator: each item a full_tensor() gather
        read.append(1)
        yield "w", None

    engine = RefitCheckpointEngine(bucket_size=1 << 20, is_master=True)
    generator = weights()
    worker = SimpleNamespace(config=SimpleNamespace(rollout=SimpleNamespace(
        checkpoint_engine=SimpleNamespace(backend="refit"))), checkpoint_engine=engine,
        actor=SimpleNamespace(engine=SimpleNamespace(get_per_tensor_param=lambda: (generator, None))))
    with pytest.raises(RefitError, match="no RefitSender set up"):
        asyncio.run(ActorRolloutRefWorker.update_weights.__wrapped__(worker, global_steps=17, mode="auto"))
    assert read == [] and generator.gi_frame is None  # closed, never read
