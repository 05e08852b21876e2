"""Rank programs that run docs/migration/sglang.md's "after" blocks (``sglang-trainer``), spawned.

Train ranks ``0..S-1`` (FSDP2, refit's DTensor plugin) run the page's blocks in order, in one
namespace: ``model``, ``rank``, ``train_world``, ``rendezvous`` (a fresh one per block), ``tp``,
``steps``, ``train_step`` (puts the next step's weights into the model, as an optimizer step would)
and, on train rank 0, ``engine``: an offline ``sglang.Engine`` as :class:`EngineClient` drives it,
whose TP workers are the gen ranks. Gen ranks ``S..`` run what an SGLang scheduler runs for those
calls: SGLang's real model class and weight-update session (``sglang_ranks.SglangSession``) with
refit's custom loader. After each block the gen ranks compare every parameter, bit for bit, with
what SGLang's own ``load_weights`` makes of the last step's HF weights.
"""

from __future__ import annotations

import asyncio
import types
from typing import Any

import torch
import torch.distributed as dist
from sglang_ranks import SEED, SglangSession, mismatches

from refit_core import ParallelLayout
from refit_core.kit.models import PRESETS, reference_state_dict

PRESET = "tiny-qwen3"
STEPS_PER_BLOCK = 2


class WorkerEngine:
    """An offline ``sglang.Engine`` as refit's ``EngineClient`` drives it; the requests its tokenizer
    manager would send to the TP schedulers go to the gen ranks (``conns``), as plain fields."""

    def __init__(self, conns: list[Any]) -> None:
        self.conns = conns
        self.server_args = types.SimpleNamespace(tp_size=len(conns))
        self.loop = asyncio.new_event_loop()
        self.tokenizer_manager = types.SimpleNamespace(update_weights_from_tensor=self._update)

    def _ask(self, *request: Any) -> tuple[bool, str]:
        for conn in self.conns:
            conn.send(request)
        answers = [conn.recv() for conn in self.conns]
        failed = [message for ok, message in answers if not ok]
        return (not failed, "; ".join(failed) or answers[0][1])

    def begin_weight_update(self) -> tuple[bool, str]:
        return self._ask("begin")

    def end_weight_update(self) -> tuple[bool, str]:
        return self._ask("end")

    async def _update(self, request: Any, _http_request: Any) -> tuple[bool, str]:
        return self._ask("update", list(request.serialized_named_tensors), request.load_format,
                         bool(request.flush_cache), request.weight_version)

    def check(self, step: int) -> list[list[str]]:
        """Every gen rank's parameters that differ from SGLang's own load of ``step``'s weights."""
        for conn in self.conns:
            conn.send(("check", step))
        return [conn.recv() for conn in self.conns]

    def close(self) -> None:
        for conn in self.conns:
            conn.send(("close",))


def _record_sends(sent: list[tuple[int, int]]) -> None:
    """Every ``RefitSender.send`` of this process appends its step's (staged, direct) bytes to ``sent``."""
    from refit_core import RefitSender

    original = RefitSender.send

    def send(self: RefitSender, *args: Any, **kwargs: Any) -> Any:
        stats = original(self, *args, **kwargs)
        sent.append((stats.staging_bytes, stats.direct_bytes))
        return stats

    RefitSender.send = send  # type: ignore[method-assign]


def train_rank(rank: int, world: int, dist_port: int, ports: list[int], blocks: list[dict[str, str]],
               tp: int, conns: list[Any]) -> dict[str, Any]:
    """Run the blocks on one FSDP2 train rank; train rank 0 reports the gen ranks' checks."""
    from refit_dtensor import build_model, init_mesh, load_hf_weights, shard_model

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{dist_port}", rank=rank, world_size=world)
    layout = ParallelLayout(fsdp=world)
    config = dict(PRESETS[PRESET])
    model = shard_model(build_model(config, seed=3), layout, init_mesh(layout))
    trained: list[int] = []

    def train_step(module: Any) -> None:
        trained.append(len(trained) + 1)
        load_hf_weights(module, reference_state_dict(config, SEED, trained[-1]))

    sent: list[tuple[int, int]] = []
    _record_sends(sent)
    engine = WorkerEngine(conns) if rank == 0 else None
    namespace: dict[str, Any] = {"__name__": "__docs__", "model": model, "rank": rank, "train_world": world,
                                 "tp": tp, "steps": STEPS_PER_BLOCK, "train_step": train_step}
    if engine is not None:
        namespace["engine"] = engine
    out: dict[str, Any] = {"checks": [], "sent": []}
    try:
        if engine is not None:
            out["before"] = engine.check(1)
        for block, port in zip(blocks, ports):
            namespace["rendezvous"] = f"127.0.0.1:{port}"
            exec(compile(block["code"], block["where"], "exec"), namespace)
            out["sent"].append(list(sent))
            sent.clear()
            if engine is not None:
                out["checks"].append((trained[-1], engine.check(trained[-1])))
    finally:  # the gen ranks stop at once, whatever a block raised
        if engine is not None:
            engine.close()
    out["trained"] = trained
    dist.destroy_process_group()
    return out


def gen_rank(rank: int, world: int, dist_port: int, conn: Any) -> dict[str, Any]:
    """One SGLang TP worker: runs the session calls it is sent until ``close``."""
    from refit_sglang import worker
    from sglang.srt.managers.io_struct import (
        BeginWeightUpdateReqInput,
        EndWeightUpdateReqInput,
        UpdateWeightsFromTensorReqInput,
    )
    from sglang_cpu import build_model, init_sglang

    init_sglang(rank, world, dist_port)
    config = dict(PRESETS[PRESET])
    model, reference = build_model(PRESET), build_model(PRESET)
    session = SglangSession(model, rank)
    errors: list[str | None] = []
    while True:
        what, *args = conn.recv()
        if what == "close":
            break
        if what == "check":
            with torch.no_grad():
                reference.load_weights(iter(reference_state_dict(config, SEED, args[0]).items()))
            conn.send(mismatches(model, reference))
            continue
        if what == "begin":
            answer = session.manager.begin_weight_update(BeginWeightUpdateReqInput())
        elif what == "end":
            answer = session.manager.end_weight_update(EndWeightUpdateReqInput())
        else:
            tensors, load_format, flush_cache, version = args
            answer = session.manager.update_weights_from_tensor(UpdateWeightsFromTensorReqInput(
                serialized_named_tensors=tensors, load_format=load_format, flush_cache=flush_cache,
                weight_version=version))
            errors.append(worker.last_error(model))
        conn.send((bool(answer.success), str(answer.message)))
    worker.close(model)
    return {"versions": session.versions, "flushes": session.flushes, "errors": errors}


def docs_ranks(rank: int, world: int, train_world: int, dist_ports: list[int], ports: list[int],
               blocks: list[dict[str, str]], pipes: list[tuple[Any, Any]]) -> dict[str, Any]:
    """Train ranks ``0..train_world-1``, then the SGLang TP workers (see the module docstring)."""
    tp = world - train_world
    if rank < train_world:
        return train_rank(rank, train_world, dist_ports[0], ports, blocks, tp, [ours for ours, _ in pipes])
    return gen_rank(rank - train_world, tp, dist_ports[1], pipes[rank - train_world][1])
