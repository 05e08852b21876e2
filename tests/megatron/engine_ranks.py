"""Rank programs that refit a megatron-core model (2 gloo train ranks) into the kit's reference engine (1 rank).

For checkpoints no HF model on this machine can hold whole: hybrid Mamba (NemotronH, a
``MambaModel``) and DeepSeek-V3 with its MTP layer (transformers' DeepSeek-V3 drops MTP weights);
and a tied-embedding model under PP 2 (the last stage's copy of the embedding is not sent).
The engine holds every tensor of the plugin's HF inventory as a plain tensor. The reference is
independent of refit_megatron: megatron's own ``sharded_state_dict()`` assembled across ranks and
converted to HF names by the tests' routines (``nemotronh_build.nemotron_to_hf``,
``megatron_ranks.to_hf``). Step 1 sends megatron's initial weights, step 2 changes every parameter.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from megatron_ranks import (
    MODELS,
    _layout_keys,
    _rendezvous,
    _views_are_parameter_memory,
    assemble,
    local_shards,
    next_step,
    to_hf,
)
from nemotronh_build import CONFIG as NEMOTRONH
from nemotronh_build import build_mamba, nemotron_to_hf

from refit_core import ParallelLayout
from refit_core.kit.models import PRESETS

TRAIN_WORLD = 2
GEN_WORLD = 1
STEPS = (1, 2)


def _build_gpt(config: dict[str, Any], layout: ParallelLayout) -> list[Any]:
    from refit_megatron import build_gpt

    return build_gpt(config, layout)


@dataclass(frozen=True)
class Model:
    """A HF config, how its megatron model is built (chunks) and how megatron-global tensors become HF."""

    config: dict[str, Any]
    build: Callable[[dict[str, Any], ParallelLayout], list[Any]]
    convert: Callable[[dict[str, torch.Tensor], dict[str, Any]], dict[str, torch.Tensor]]


ENGINE_MODELS = {
    "nemotronh": Model(NEMOTRONH, lambda c, layout: [build_mamba(c, layout)], nemotron_to_hf),
    "mla-mtp": Model(dict(MODELS["mla"], num_nextn_predict_layers=1), _build_gpt, to_hf),
    "dense-tied": Model(dict(PRESETS["tiny-qwen3-tied"], num_hidden_layers=4, vocab_size=500), _build_gpt, to_hf),
}
LAYOUTS = {"tp1": "dp=2", "tp2": "tp=2", "pp2": "pp=2", "ep2": "dp=2,ep=2", "pp2-uneven": "pp=2,pp_first=1,pp_last=3"}
"""Layouts of the 2 train ranks (TP 1 with two data-parallel replicas, TP 2, PP 2, EP 2)."""


def engine_ranks(rank: int, world: int, ports: tuple[int, int], tmp: str,
                 cases: list[tuple[str, str]]) -> dict[str, dict[str, Any]]:
    """Train ranks ``0..1`` (megatron) or gen rank 2 (the reference engine), every ``(model, layout)``
    case in turn; results by model, then layout."""
    train = rank < TRAIN_WORLD
    side_rank, side_world = (rank, TRAIN_WORLD) if train else (rank - TRAIN_WORLD, GEN_WORLD)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[0 if train else 1]}",
                            rank=side_rank, world_size=side_world)
    results: dict[str, dict[str, Any]] = {}
    for model, name in cases:
        address = _rendezvous(train, side_rank, os.path.join(tmp, f"{model}-{name}.address"))
        results.setdefault(model, {})[name] = (_train if train else _gen)(
            side_rank, ENGINE_MODELS[model], name, address, os.path.join(tmp, f"{model}-{name}"))
    dist.destroy_process_group()
    return results


def run_engine_ranks(tmp: str, cases: list[tuple[str, str]]) -> tuple[list[Any], list[Any]]:
    """:func:`engine_ranks` on ``TRAIN_WORLD + GEN_WORLD`` fresh processes: (train results, gen results)."""
    from refit_core.kit.launch import free_port, spawn

    out = spawn(engine_ranks, TRAIN_WORLD + GEN_WORLD, (free_port(), free_port()), tmp, cases,
                timeout_s=240)  # every case (10): 20 s here; under pytest's 900 s per test, so the ranks' own
    return out[:TRAIN_WORLD], out[TRAIN_WORLD:]  # errors come first


def assert_two_refits_landed(gen: list[Any], layout: str) -> None:
    """Gen rank 0 saw versions 1 and 2 land bitwise on the reference, naming the same tensors."""
    for step in (1, 2):
        checks = gen[0][layout]
        assert checks[f"version_{step}"] == step
        assert checks[f"reference_names_{step}"] == [], "engine and reference list different tensors"
        assert checks[f"differences_{step}"] == [], f"step {step}"


def _plugins(config: dict[str, Any]) -> Any:
    from refit_megatron.checkpoint import hf_specs

    from refit_core.contract.plugins import PluginManager
    from refit_core.testing.reference import ReferencePlugin
    from refit_core.testing.reference import REFERENCE_PLUGIN

    pm = PluginManager()
    pm.register(ReferencePlugin(list(hf_specs(config).values())), name=REFERENCE_PLUGIN)
    return pm


def _train(rank: int, model: Model, name: str, address: str, stem: str) -> dict[str, Any]:
    from refit_megatron import MegatronSource, destroy_parallel, init_parallel, live_pieces
    from refit_megatron.layout import layout_pieces

    from refit_core import RefitOptions, RefitSender
    from refit_core.plan.offline import plan_from_metadata
    from refit_core.testing.reference import REFERENCE_BACKEND

    layout = ParallelLayout.parse(LAYOUTS[name])
    init_parallel(layout)
    chunks = model.build(model.config, layout)
    source = MegatronSource(chunks, model.config)
    live = live_pieces(source)
    checks: dict[str, Any] = {
        "views_share_parameter_memory": _views_are_parameter_memory(live, chunks),
        "metadata_layout_equal": _layout_keys(live) == _layout_keys(layout_pieces(model.config, layout, rank)),
        "names": sorted({p.spec.name for p in live}),
        "in_proj_pieces": sum(".mixer.in_proj." in p.spec.name for p in live),
    }
    pm, options = _plugins(model.config), RefitOptions(timeout_s=90, bucket_bytes=1 << 20)
    sender = RefitSender(source, rendezvous=address, rank=rank, world_size=TRAIN_WORLD, plugins=pm, options=options)
    live_plan = sender.setup().fingerprint
    planned = plan_from_metadata(pm, model.config, "megatron", layout, REFERENCE_BACKEND, ParallelLayout(),
                                 options=options).schedule.fingerprint
    checks["plan_equals_refit_plan"] = live_plan == planned
    for step in STEPS:
        if step > 1:
            next_step(chunks)
        everyone: list[Any] = [None] * TRAIN_WORLD
        dist.all_gather_object(everyone, local_shards(chunks))
        if rank == 0:
            torch.save(model.convert(assemble(everyone), model.config), f"{stem}-{step}.pt")
        dist.barrier()
        checks[f"sent_bytes_{step}"] = sender.send(version=step).bytes
    sender.close()
    destroy_parallel()
    return checks


def _gen(rank: int, model: Model, name: str, address: str, stem: str) -> dict[str, Any]:
    from refit_megatron.checkpoint import hf_specs

    from refit_core import RefitOptions, RefitReceiver
    from refit_core.testing.reference import ReferenceEngine

    engine = ReferenceEngine(list(hf_specs(model.config).values()), rank, GEN_WORLD)
    receiver = RefitReceiver(engine, rendezvous=address, rank=rank, world_size=GEN_WORLD,
                             plugins=_plugins(model.config), options=RefitOptions(timeout_s=90))
    receiver.setup()
    checks: dict[str, Any] = {}
    for step in STEPS:
        checks[f"version_{step}"] = receiver.receive().version
        reference = torch.load(f"{stem}-{step}.pt")
        checks[f"reference_names_{step}"] = sorted(set(engine.tensors) ^ set(reference))
        checks[f"differences_{step}"] = engine.differences(reference) if set(engine.tensors) <= set(reference) \
            else ["the reference lacks tensors"]
    receiver.close()
    return checks
