"""refit_core.kit.ray on a real local Ray cluster (CPU): FSDP2 train actors into DTensor receiver actors
and into a vLLM engine actor, errors named by actor, and the RL loop of ``refit demo --loop``."""

from __future__ import annotations

import os
import struct
import time
from typing import Any

import pytest

from tests.environments import require

ray = require("ray")
require("refit_dtensor")

from tests.docs.docs_snippets import ROOT, harness_snippets, run_snippet

from refit_core import RefitError, RefitOptions
from refit_core.kit.models import load_config
from refit_core.kit.ray import RayRefit, RefitReceiveActor, gather

pytestmark = [pytest.mark.timeout(900), pytest.mark.ray]
SEED = 0
TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def local_ray():
    from refit_core.tools.demo.rl_loop import start_local_ray

    here = os.path.dirname(os.path.abspath(__file__))  # actor classes defined here must import there
    start_local_ray(6, env={"PYTHONPATH": os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))})
    yield
    ray.shutdown()


class PolicyCopy(RefitReceiveActor):
    """A DTensor tensor-parallel copy of the policy, one gen rank per actor."""

    def __init__(self, rank: int, world_size: int, config: dict[str, Any]) -> None:
        self.rank, self.world_size, self.config = rank, world_size, config
        self.model = None

    def build(self, dist_address: str) -> None:
        import torch
        import torch.distributed as dist
        from refit_dtensor.parallel import build_model, init_mesh, shard_model

        from refit_core import ParallelLayout

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://{dist_address}", rank=self.rank,
                                world_size=self.world_size)
        layout = ParallelLayout(tp=self.world_size)
        self.model = shard_model(build_model(self.config, seed=123), layout, init_mesh(layout))

    def refit_model(self) -> Any:
        return self.model

    def mismatches(self, step: int) -> list[str]:
        from refit_core import get_plugin_manager
        from refit_core.kit.models import reference_state_dict
        from refit_core.kit.verify import mismatches

        pieces = get_plugin_manager().destination_map(self.model).pieces
        return mismatches(pieces, reference_state_dict(self.config, SEED, step))

    def perturb(self) -> None:
        """Move every weight away from what the last refit wrote (a later refit must write it again)."""
        import torch

        with torch.no_grad():
            for param in self.model.parameters():
                param.add_(1.0)


class FleetCopy:
    """A replica of a fleet: a ``transformers`` copy of the policy (other weights until refit) that joins the
    fleet and receives its steps, the gen-actor side of ``RayFleet``."""

    def __init__(self, config: dict[str, Any]) -> None:
        from refit_dtensor.parallel import build_model

        self.config, self.model, self.receiver = config, build_model(config, seed=123), None

    def refit_join_fleet(self, fleet: str, replica: str, options: RefitOptions, join_timeout_s: float) -> int:
        from refit_core.apps import join_fleet

        self.receiver = join_fleet(self.model, fleet=fleet, replica=replica, rank=0, world_size=1, options=options,
                                   join_timeout_s=join_timeout_s)
        return self.refit_fleet_receive()

    def refit_fleet_receive(self) -> int:
        return self.receiver.receive().version

    def pid(self) -> int:
        return os.getpid()

    def bitwise(self, step: int) -> bool:
        """Whether every weight is, bit for bit, the reference weights of ``step`` (the trainers' start)."""
        from refit_core.apps import reference_state_dict, same_bytes

        state, reference = self.model.state_dict(), reference_state_dict(self.config, SEED, step)
        return state.keys() == reference.keys() and all(same_bytes(state[n], t) for n, t in reference.items())


def _await_exit(pid: int, timeout_s: float = 30.0) -> None:
    """Wait until process ``pid`` (on this host) has exited: Ray marks a killed actor dead before its process is."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        assert time.monotonic() < deadline, f"process {pid} still runs {timeout_s:.0f} s after ray.kill"
        time.sleep(0.05)


def _trainers(config: dict[str, Any], ranks: int = 2, fleet: bool = False) -> list[Any]:
    from refit_dtensor.policy import FSDPPolicyActor

    from refit_core.apps.ray_fleet import fleet_train_actor

    Trainer = ray.remote(num_cpus=1)(fleet_train_actor(FSDPPolicyActor) if fleet else FSDPPolicyActor)
    trainers = [Trainer.remote(r, ranks, config, seed=SEED, lr=1e-3) for r in range(ranks)]
    (address,) = gather({trainers[0].refit_address.remote(): "train actor 0"}, "address", TIMEOUT_S)
    gather({t.init_training.remote(address): f"train actor {r}" for r, t in enumerate(trainers)}, "build", TIMEOUT_S)
    return trainers


def _copies(config: dict[str, Any], ranks: int = 2) -> list[Any]:
    Copy = ray.remote(num_cpus=1)(PolicyCopy)
    copies = [Copy.remote(r, ranks, config) for r in range(ranks)]
    (address,) = gather({copies[0].refit_address.remote(): "copy 0"}, "address", TIMEOUT_S)  # any free port
    gather({c.build.remote(address): f"copy {r}" for r, c in enumerate(copies)}, "build", TIMEOUT_S)
    return copies


def _kill(*actors: Any) -> None:
    for actor in actors:
        ray.kill(actor)


def _run_nemo_rl_after_block(trainers: list[Any], copies: list[Any]) -> None:
    """docs/migration/nemo-rl.md's after block (harness ``ray-controller``), run by this controller with
    ``policy_workers`` (FSDP2 train actors at reference step 0), ``vllm_workers`` (DTensor TP policy
    copies standing in for the vLLM workers: gen actors of the same protocol), ``step`` 0 and
    ``colocated_inference`` False (its other branch wakes NeMo-RL's own generation object)."""
    (block,) = harness_snippets(ROOT / "docs" / "migration" / "nemo-rl.md", "ray-controller")
    run_snippet(block, {"__name__": "__docs__", "policy_workers": trainers, "vllm_workers": copies, "step": 0,
                        "colocated_inference": False})


def test_ray_refit_fsdp_trainers_into_tp_copies_bitwise(local_ray) -> None:
    """The NeMo-RL migration guide's after block, then a session of this test's own (its copies moved
    off the weights first); after each, every destination view equals the trainers' bit for bit."""
    config = load_config("tiny-qwen3")
    trainers, copies = _trainers(config), _copies(config)

    def mismatches() -> list[list[str]]:
        return gather({c.mismatches.remote(0): f"copy {r}" for r, c in enumerate(copies)}, "verify", TIMEOUT_S)

    try:
        assert all(mismatches()), "the copies held the trainers' weights before any refit"
        _run_nemo_rl_after_block(trainers, copies)
        assert mismatches() == [[], []], "the migration guide's block did not land bitwise"
        gather({c.perturb.remote(): f"copy {r}" for r, c in enumerate(copies)}, "perturb", TIMEOUT_S)
        assert all(mismatches())
        refit = RayRefit(trainers, copies, timeout_s=TIMEOUT_S, options=RefitOptions(timeout_s=TIMEOUT_S))
        fingerprint = refit.setup()
        assert len(fingerprint) == 16 and refit.setup_seconds > 0
        report = refit.sync(version=0)
        assert report.version == 0 and report.bytes > 0
        # the trainers start from reference step 0: every destination view equals it, bit for bit
        assert mismatches() == [[], []]
        with pytest.raises(RefitError, match="expected 7"):  # the receivers check the version
            bad = {c.refit_receive.remote(7): f"copy {r}" for r, c in enumerate(copies)}
            bad.update({t.refit_send.remote(1): f"train actor {r}" for r, t in enumerate(trainers)})
            gather(bad, "a refit with the wrong version", TIMEOUT_S)
    finally:
        _kill(*trainers, *copies)


def test_ray_refit_names_the_failing_actor(local_ray) -> None:
    trainers = _trainers(load_config("tiny-qwen3"))
    copies = _copies(load_config("tiny-llama"))  # another model: planning fails on every rank
    try:
        refit = RayRefit(trainers, copies, timeout_s=TIMEOUT_S, options=RefitOptions(timeout_s=TIMEOUT_S),
                         engine_names=["policy copy A", "policy copy B"])
        with pytest.raises(RefitError, match="sync"):
            refit.sync(version=0)
        with pytest.raises(RefitError, match=r"refit setup failed on (train actor \d|policy copy [AB]): PlanError"):
            refit.setup()
    finally:
        _kill(*trainers, *copies)


def test_ray_refit_reports_actors_that_do_not_answer(local_ray) -> None:
    @ray.remote(num_cpus=0)
    class Silent:
        def refit_gen_ranks(self) -> int:
            import time

            time.sleep(30)
            return 1

    trainers, silent = _trainers(load_config("tiny-qwen3"), ranks=1), Silent.remote()
    try:
        refit = RayRefit(trainers, [silent], timeout_s=2.0, engine_names=["the silent engine"])
        with pytest.raises(RefitError, match="no answer within 2 s from the silent engine"):
            refit.setup()
    finally:
        _kill(*trainers, silent)


def test_ray_fleet_admits_a_replica_and_its_restart_under_its_name_bitwise(local_ray) -> None:
    """RayFleet over an FSDP2 train actor: a replica joins and holds version 0 bitwise; its actor is killed, another
    joins under its name, and the next step admits it whole, bitwise; the trainer opened the fleet once."""
    from refit_core.apps.ray_fleet import RayFleet

    config = load_config("tiny-qwen3")
    Copy = ray.remote(num_cpus=0)(FleetCopy)
    copies = [Copy.remote(config), Copy.remote(config)]  # the second starts now, as the first's restart
    trainers = _trainers(config, ranks=1, fleet=True)
    try:
        fleet = RayFleet(trainers, timeout_s=TIMEOUT_S)
        fleet.open()
        for version, copy in enumerate(copies):
            joined = copy.refit_join_fleet.remote(fleet.address, "a", fleet.options, TIMEOUT_S)
            fleet.await_joins(version + 1)
            step = fleet.send(version)
            assert (step.landed, step.joined, step.failed) == (("a",), ("a",), ()), step
            assert ray.get(joined, timeout=TIMEOUT_S) == version
            assert ray.get(copy.bitwise.remote(0), timeout=TIMEOUT_S)  # the trainer holds step 0's weights
            pid = ray.get(copy.pid.remote(), timeout=TIMEOUT_S)
            ray.kill(copy)
            with pytest.raises(ray.exceptions.RayActorError):
                ray.get(copy.refit_fleet_receive.remote(), timeout=TIMEOUT_S)
            _await_exit(pid)  # its process gone, its connections to the fleet closed: the next step drops it
        fleet.close()
    finally:
        _kill(*trainers, *copies)


@pytest.mark.vllm
@pytest.mark.slow
def test_rl_loop_learns_with_the_engine_refit_every_step(local_ray, tmp_path) -> None:
    require("vllm")
    from refit_core import get_plugin_manager
    from refit_core.contract.backend import GEN, TRAIN
    from refit_core.tools.demo.rl_loop import LoopSettings, run_loop, summarize

    pm = get_plugin_manager()
    settings = LoopSettings(steps=6, lr=1e-2, plot=str(tmp_path / "loop.png"), timeout_s=300.0)
    lines: list[str] = []
    result = run_loop(settings, pm.backend("dtensor", TRAIN), pm.backend("vllm", GEN), report=lines.append)
    rows = result.rows
    assert [r.version for r in rows] == [str(s) for s in range(1, 7)]  # the engine serves every new version
    assert all(r.mismatch.tokens == settings.prompts * settings.group_size * settings.completion_tokens
               for r in rows)
    assert max(r.mismatch.kl for r in rows) < settings.kl_bound  # engine log-probs == trainer's
    assert all(r.carried_requests >= 1 for r in rows)  # requests in flight continued on the new version
    assert sum(r.reward for r in rows[-2:]) / 2 > sum(r.reward for r in rows[:2]) / 2 + 0.1
    assert summarize(result, settings, report=lines.append)
    png = (tmp_path / "loop.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", png[16:24])
    assert width >= 400 and height >= 300
