"""Rank programs of ``test_vllm_fleet.py``, forked by ``vllm_fleet_scenario.py``: FSDP2 trainers that refit a
fleet step by step, a real vLLM engine replica that joins it through its worker, and cheap replicas (a
``transformers`` copy of the model each, the dtensor plugin's gen side). Every replica checks each version it
receives bitwise, in the weights it computes with. Each program takes ``report(event, payload)`` first."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Sequence
from typing import Any

import torch
from scenarios import SEED, _engine_tensors, _refit_engine, _train_model, hf_tokens, tiny_config

from refit_core import RefitOptions
from refit_core.apps import RefitFleet, join_fleet, same_bytes
from refit_core.kit.models import reference_state_dict

Report = Callable[..., None]

MODEL = "tiny-llama"
FIRST_VERSION = 100
WEIGHTS = 3
"""Version ``v`` carries the reference weights of step ``weights_of(v)``: 1, 2, 3, 1, ... (never step 0, the
engine's checkpoint), so that a replica one step behind holds other bytes."""
TIMEOUT_S = 30.0
"""Every rank's ``RefitOptions.timeout_s``: the deadline of a replica's step."""
JOIN_TIMEOUT_S = 300.0


def weights_of(version: int) -> int:
    """The reference step whose weights version ``version`` carries."""
    return 1 + (version - FIRST_VERSION) % WEIGHTS


def options() -> RefitOptions:
    return RefitOptions(timeout_s=TIMEOUT_S)


def trainer_rank(report: Report, rank: int, world: int, port: int, address: str, gates: Sequence[Any]) -> dict:
    """FSDP2 train rank ``rank`` of ``world``: open the fleet once, then one step per gate, each once the
    driver sets it, sending the version's reference weights; reports each step's ``FleetStep``."""
    import torch.distributed as dist
    from refit_dtensor import load_hf_weights

    cfg = tiny_config(MODEL)
    model = _train_model(cfg, world, rank, port)
    fleet = RefitFleet(model, rendezvous=address, rank=rank, world_size=world, options=options())
    fleet.open()
    for step, gate in enumerate(gates):
        if not gate.wait(timeout=600):
            raise TimeoutError(f"the driver never opened step {step}'s gate")
        version = FIRST_VERSION + step
        load_hf_weights(model, reference_state_dict(cfg, SEED, weights_of(version)))
        result = fleet.send(version)
        report("step", {"step": step, "landed": list(result.landed), "joined": list(result.joined),
                        "failed": {f.replica: f.reason[:500] for f in result.failed}, "seconds": result.seconds})
    view = [(s.replica, s.version, s.gen_ranks, s.layout, s.last_error) for s in fleet.fleet()]
    fleet.close()
    dist.destroy_process_group()
    return {"opened": 1, "fleet": view}


def model_replica(report: Report, address: str, name: str, last: int) -> dict:
    """Replica ``name``: a ``transformers`` model (other weights so far) joins the fleet, then receives until
    version ``last``, reporting each version it holds and whether its state dict is bitwise that version's."""
    from refit_dtensor import build_model

    torch.set_num_threads(1)
    cfg = tiny_config(MODEL)
    engine = build_model(cfg, dtype=torch.float32, seed=1)
    report("joining")
    receiver = join_fleet(engine, fleet=address, replica=name, rank=0, world_size=1, options=options(),
                          join_timeout_s=JOIN_TIMEOUT_S)
    held = []
    while not held or held[-1][0] != last:
        version = receiver.receive().version
        state = engine.state_dict()
        reference = reference_state_dict(cfg, SEED, weights_of(version))
        bitwise = state.keys() == reference.keys() and all(same_bytes(state[n], t) for n, t in reference.items())
        held.append((version, bitwise))
        report("held", held[-1])
    receiver.close()
    return {"held": held}


# -- the vLLM replica: its worker's side, run through collective_rpc (in process: one worker, uniproc) ------


def engine_tensors(worker: Any) -> dict[str, torch.Tensor]:
    """Every weight the worker's model computes with (``scenarios._engine_tensors``)."""
    return _engine_tensors(worker.model_runner.get_model())


def reloaded_tensors(worker: Any, step: int) -> dict[str, torch.Tensor]:
    """What vLLM's own reload makes of the reference weights of ``step`` (the engine keeps them)."""
    cfg = tiny_config(MODEL)
    worker.model_runner.reload_weights(weights_iterator=iter(reference_state_dict(cfg, SEED, step).items()))
    return engine_tensors(worker)


def vllm_replica(report: Report, address: str, name: str, last: int) -> dict:
    """Replica ``name``: a vLLM engine (one CPU worker, refit's worker extension) joins the fleet, then
    receives until version ``last``. After each version every weight it computes with must equal, bitwise,
    what vLLM's own reload makes of that version's weights (read once per weight set, before joining);
    at the end its greedy tokens must equal HF transformers' with the last version's weights."""
    engine = _refit_engine(tiny_config(MODEL))
    llm = engine.llm
    try:
        expected = {step: llm.collective_rpc(reloaded_tensors, args=(step,))[0] for step in range(1, WEIGHTS + 1)}
        constant = [n for n in expected[1] if any(same_bytes(expected[1][n], expected[s][n]) for s in (2, 3))]
        report("joining")
        ranks = llm.collective_rpc("refit_join_fleet", args=(address, name),
                                   kwargs={"options": {"timeout_s": TIMEOUT_S}, "join_timeout_s": JOIN_TIMEOUT_S})
        held = []
        while not held or held[-1][0] != last:
            (version,) = llm.collective_rpc("refit_receive")
            llm.reset_prefix_cache()
            (tensors,) = llm.collective_rpc(engine_tensors)
            want = expected[weights_of(version)]
            bitwise = tensors.keys() == want.keys() and all(same_bytes(t, want[n]) for n, t in tensors.items())
            held.append((version, bitwise, llm.collective_rpc("refit_weight_version")))
            report("held", held[-1])
        tokens = engine.tokens()
        reference = hf_tokens(engine.cfg, weights_of(last), engine.prompts, engine.tmp)
        llm.collective_rpc("refit_close")
        llm.llm_engine.engine_core.shutdown()
    finally:
        shutil.rmtree(engine.tmp, ignore_errors=True)
    return {"held": held, "ranks": ranks, "tokens": tokens, "hf_tokens": reference, "tensors": sorted(expected[1]),
            "constant": constant}
