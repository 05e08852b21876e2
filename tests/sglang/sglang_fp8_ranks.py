"""Rank programs of the SGLang block-FP8 test: FSDP2 trainer ranks (refit's DTensor plugin, BF16)
first, then one SGLang TP worker whose real model class is built with SGLang's block-FP8 config
(``Fp8Config(weight_block_size=[128, 128])``) and refitted through SGLang's real weight-update session.

Ground truth never comes from refit: a second SGLang FP8 model loads, through SGLang's own
``load_weights``, the checkpoint that refit's *reference* quantizer (plain torch, block by block)
makes of the same BF16 weights: float8 weights and fp32 ``weight_scale_inv`` scales, the rest BF16.
Every parameter must equal it bit for bit.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from refit_core import ParallelLayout
from refit_core.apps import same_bytes
from refit_core.kit.models import PRESETS, reference_state_dict

torch.set_num_threads(1)

SEED = 11
STEPS = (1, 2)
BLOCK = [128, 128]
SHAPE = {"hidden_size": 256, "head_dim": 64, "intermediate_size": 256, "moe_intermediate_size": 128,
         "dtype": "bfloat16"}
"""Tiny models whose every fused row range holds whole 128 x 128 blocks (SGLang refuses others)."""


def config_of(preset: str) -> dict[str, Any]:
    return dict(PRESETS[preset], **SHAPE)


def build_fp8_model(preset: str) -> torch.nn.Module:
    """SGLang's model class for ``preset`` with its block-FP8 quantization config (random init)."""
    from sglang.srt.layers.quantization.fp8 import Fp8Config
    from sglang.srt.models.registry import ModelRegistry
    from sglang_cpu import hf_config

    config = hf_config(preset, **SHAPE)
    quant = Fp8Config(is_checkpoint_fp8_serialized=True, activation_scheme="dynamic", weight_block_size=BLOCK)
    cls, _ = ModelRegistry.resolve_model_cls(config.architectures)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.no_grad():
            return cls(config=config, quant_config=quant).eval()
    finally:
        torch.set_default_dtype(previous)


def quantized_checkpoint(preset: str, specs: list, step: int) -> dict[str, torch.Tensor]:
    """The HF checkpoint of ``step`` as a block-FP8 checkpoint: the reference quantizer's values and
    scales for every quantized spec, BF16 for the rest."""
    from refit_core.run.quant.reference import reference_quantize

    weights = reference_state_dict(config_of(preset), SEED, step, dtype=torch.bfloat16)
    out: dict[str, torch.Tensor] = {}
    for spec in specs:
        if spec.quant is not None:
            out[spec.name], out[spec.quant.scale_name] = reference_quantize(weights[spec.name], spec.quant)
        elif spec.name in weights:
            out[spec.name] = weights[spec.name]
    return out


def _mismatches(model: torch.nn.Module, reference: torch.nn.Module) -> list[str]:
    mine, theirs = dict(model.named_parameters()), dict(reference.named_parameters())
    return sorted(n for n in set(mine) | set(theirs) if n not in mine or n not in theirs
                  or not same_bytes(mine[n], theirs[n]))


def gen_rank(rank: int, world: int, dist_port: int, ports: list[int], presets: list[str]) -> dict[str, Any]:
    from refit_sglang import worker
    from refit_sglang.state import state_of
    from refit_sglang.ticket import RefitTicket
    from sglang_cpu import init_sglang
    from sglang_ranks import SglangSession

    from refit_core import get_plugin_manager

    init_sglang(rank, world, dist_port)
    out: dict[str, Any] = {}
    for preset, port in zip(presets, ports):
        model, reference = build_fp8_model(preset), build_fp8_model(preset)
        state = state_of(model)
        assert state is not None
        specs = state.specs
        checks: dict[str, Any] = {
            "quantized": sorted(s.name for s in specs if s.quant is not None),
            "fp8_params": sorted(n for n, p in model.named_parameters() if p.element_size() == 1),
        }
        live = get_plugin_manager().destination_map(model)
        checks["loader_path"] = sorted(s.name for s in live.loader)
        checks["loader_quantized"] = sorted(s.name for s in live.loader if s.quant is not None)
        session = SglangSession(model, rank)
        for step in STEPS:
            ticket = RefitTicket(rendezvous=f"127.0.0.1:{port}", world_size=world, version=step, timeout_s=120)
            checks[f"session_{step}"] = session.update(ticket.serialized(), str(step))
            checks[f"error_{step}"] = worker.last_error(model)
            with torch.no_grad():
                reference.load_weights(iter(quantized_checkpoint(preset, specs, step).items()))
            checks[f"mismatch_{step}"] = _mismatches(model, reference)
            checks[f"fp8_changed_{step}"] = sorted(
                n for n, p in model.named_parameters() if p.element_size() == 1 and step > 1
                and not same_bytes(p, checks.get("_previous", {}).get(n, p)))
            checks["_previous"] = {n: p.detach().clone() for n, p in model.named_parameters() if p.element_size() == 1}
        del checks["_previous"]
        out[preset] = checks
        worker.close(model)
    return out


def train_rank(rank: int, world: int, dist_port: int, ports: list[int], presets: list[str]) -> dict[str, Any]:
    """One FSDP2 trainer rank holding BF16 weights; refit quantizes them into the engine's FP8."""
    from refit_dtensor import build_model, init_mesh, load_hf_weights, shard_model

    from refit_core import RefitOptions, RefitSender

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{dist_port}", rank=rank, world_size=world)
    layout = ParallelLayout(fsdp=world)
    mesh = init_mesh(layout)
    out: dict[str, Any] = {}
    for preset, port in zip(presets, ports):
        config = config_of(preset)
        model = shard_model(build_model(config, seed=3, dtype=torch.bfloat16), layout, mesh)
        sender = RefitSender(model, rendezvous=f"127.0.0.1:{port}", rank=rank, world_size=world,
                             options=RefitOptions(timeout_s=120, bucket_bytes=1 << 20))
        schedule = sender.setup()
        sent = {}
        for step in STEPS:
            load_hf_weights(model, reference_state_dict(config, SEED, step, dtype=torch.bfloat16))
            sent[step] = sender.send(version=step).bytes
        sender.close()
        out[preset] = {"sent": sent, "bytes": schedule.summary.bytes}
    dist.destroy_process_group()
    return out


def fp8_ranks(rank: int, world: int, train_world: int, dist_ports: list[int], ports: list[int],
              presets: list[str]) -> dict[str, Any]:
    if rank < train_world:
        return train_rank(rank, train_world, dist_ports[0], ports, presets)
    return gen_rank(rank - train_world, world - train_world, dist_ports[1], ports, presets)
