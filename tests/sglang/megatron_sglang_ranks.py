"""Rank programs of the Megatron -> SGLang tests (spawned, so importable at top level).

Train ranks ``0..S-1`` are megatron-core ``GPTModel`` ranks (refit's Megatron plugin, gloo,
megatron's own random initialisation); gen ranks ``S..`` are the TP workers of one SGLang "engine"
driven through SGLang's real weight-update session (:class:`sglang_ranks.SglangSession`).

Ground truth never comes from refit: train rank 0 assembles megatron's own ``sharded_state_dict()``
(global shapes and offsets of every local tensor) into HF tensors with the Megatron tests' own
converter (``tests/megatron/megatron_ranks.py``: ``local_shards``, ``assemble``, ``to_hf``), and a
second SGLang model on every gen rank loads them through SGLang's own ``load_weights``; every
parameter of the refitted model must equal it bit for bit, and SGLang's own forward of it
(``sglang_forward.py``) must give HF transformers' logits. Step 2 changes every megatron parameter.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "megatron"))

from megatron_ranks import MODELS as MEGATRON_MODELS
from megatron_ranks import assemble, local_shards, next_step, to_hf
from sglang_ranks import STEPS, SglangSession, mismatches

from refit_core import ParallelLayout
from refit_core.kit.models import PRESETS

torch.set_num_threads(1)

# vocabulary 500: megatron pads it to 256 x tp, SGLang to 64 x tp; only real rows travel
MODELS: dict[str, dict[str, Any]] = {
    preset: dict(PRESETS[preset], vocab_size=500) for preset in ("tiny-llama", "tiny-qwen3", "tiny-qwen3-moe")
}
# DeepSeek-V3 as the Megatron tests build it (MLA, q-LoRA, a dense first layer, 4 routed experts +
# a shared one, sigmoid router with expert bias), with what SGLang and transformers also read:
# the router method of the real checkpoints' config.json, head_dim = the rope part (transformers'
# rotary size), non-interleaved rope (megatron's).
DEEPSEEK = dict(MEGATRON_MODELS["mla"], head_dim=32, topk_method="noaux_tc", scoring_func="sigmoid")
MODELS["tiny-deepseek-v3"] = DEEPSEEK
MODELS["tiny-deepseek-v3-no-q-lora"] = dict(DEEPSEEK, q_lora_rank=None)
TRAIN_LAYOUTS = {"tiny-llama": "tp=2", "tiny-qwen3": "tp=2", "tiny-qwen3-moe": "tp=2,ep=2",
                 "tiny-deepseek-v3": "tp=2,ep=2", "tiny-deepseek-v3-no-q-lora": "tp=2,ep=2"}
"""The megatron layout of the 2 train ranks per model (MoE: experts split over 2 EP ranks too)."""


def _reference_file(tmp: str, model: str, step: int) -> str:
    return os.path.join(tmp, f"{model}-{step}.pt")


def train_rank(rank: int, world: int, dist_port: int, ports: list[int], models: list[str], tmp: str
               ) -> dict[str, Any]:
    """One megatron rank: per model, build, set up, and send two versions; rank 0 writes the
    reference HF tensors of each version (from megatron's own sharded state dict) before sending."""
    from refit_megatron import BuildOptions, MegatronSource, build_gpt, destroy_parallel, init_parallel

    from refit_core import RefitOptions, RefitSender

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{dist_port}", rank=rank, world_size=world)
    out: dict[str, Any] = {}
    for model, port in zip(models, ports):
        config = MODELS[model]
        layout = ParallelLayout.parse(TRAIN_LAYOUTS[model])
        init_parallel(layout)
        chunks = build_gpt(config, layout, BuildOptions())
        sender = RefitSender(MegatronSource(chunks, config), rendezvous=f"127.0.0.1:{port}", rank=rank,
                             world_size=world, options=RefitOptions(timeout_s=240, bucket_bytes=1 << 20))
        sender.setup()
        sent = {}
        for step in STEPS:
            if step > 1:
                next_step(chunks)
            everyone: list[Any] = [None] * world
            dist.all_gather_object(everyone, local_shards(chunks))
            if rank == 0:
                path = _reference_file(tmp, model, step)
                torch.save(to_hf(assemble(everyone), config), path + ".tmp")
                os.replace(path + ".tmp", path)
            sent[step] = sender.send(version=step).bytes
        sender.close()
        destroy_parallel()
        out[model] = sent
    dist.destroy_process_group()
    return out


def _wait_for(path: str, timeout_s: float = 240.0) -> str:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"train rank 0 never wrote {path}")
        time.sleep(0.05)
    return path


def gen_rank(rank: int, world: int, dist_port: int, ports: list[int], models: list[str], tmp: str
             ) -> dict[str, Any]:
    """One SGLang TP worker: per model, a fresh SGLang model refitted twice through SGLang's session,
    compared after each step with a second one loaded by SGLang's ``load_weights``."""
    from refit_sglang import worker
    from refit_sglang.layout import destination_layout
    from refit_sglang.ticket import RefitTicket
    from sglang_cpu import build_model, hf_config, init_sglang
    from sglang_forward import compare_logits

    from refit_core import get_plugin_manager

    init_sglang(rank, world, dist_port)
    out: dict[str, Any] = {}
    for model, port in zip(models, ports):
        config = MODELS[model]
        live, reference = build_model(config), build_model(config)
        session = SglangSession(live, rank)
        checks: dict[str, Any] = {"differs_before": bool(mismatches(live, reference))}
        traced = get_plugin_manager().destination_map(live)
        predicted = destination_layout(config, ParallelLayout(tp=world), rank)
        checks["loader_path"] = [s.name for s in traced.loader]
        boxes = [sorted((p.spec.name, p.spec.shape, p.box) for p in m.pieces) for m in (traced, predicted)]
        checks["live_equals_metadata_layout"] = boxes[0] == boxes[1]
        for step in STEPS:
            ticket = RefitTicket(rendezvous=f"127.0.0.1:{port}", world_size=world, version=step, timeout_s=240)
            checks[f"session_{step}"] = session.update(ticket.serialized(), str(step))
            checks[f"error_{step}"] = worker.last_error(live)
            hf = torch.load(_wait_for(_reference_file(tmp, model, step)))
            with torch.no_grad():
                reference.load_weights(iter(hf.items()))
            checks[f"mismatch_{step}"] = mismatches(live, reference)
            checks[f"logits_{step}"] = compare_logits(live, hf_config(config), hf)
        checks["versions"] = session.versions
        out[model] = checks
        worker.close(live)
    return out


def refit_ranks(rank: int, world: int, train_world: int, dist_ports: list[int], ports: list[int],
                models: list[str], tmp: str) -> dict[str, Any]:
    """Megatron ranks ``0..train_world-1``, then the SGLang TP workers (see the module docstring)."""
    if rank < train_world:
        return train_rank(rank, train_world, dist_ports[0], ports, models, tmp)
    return gen_rank(rank - train_world, world - train_world, dist_ports[1], ports, models, tmp)
