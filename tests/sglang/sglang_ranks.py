"""Rank programs of the SGLang plugin's multi-process tests (spawned, so importable at top level).

Train ranks ``0..S-1`` hold an FSDP2-sharded transformers model (refit's DTensor plugin) in their own
gloo group; gen ranks ``S..S+D-1`` are the TP workers of one SGLang "engine": SGLang's parallel state
over gloo (TP ``D``), SGLang's real model class, and SGLang's real weight-update session code
(``SchedulerWeightUpdaterManager`` over the model runner's ``WeightUpdater``) driving refit's custom
loader, exactly as a scheduler does for ``begin_weight_update`` / ``update_weights_from_tensor`` /
``end_weight_update``. Stand-ins: the TP worker shell around them (its ``deserialize_own_rank`` is
SGLang's own), the scheduler's weight-version record and cache flush (no engine runs here).

Ground truth never comes from refit: a second SGLang model on every gen rank loads the same HF
weights through SGLang's own ``load_weights``, and every parameter must equal it bit for bit; then
SGLang's own forward of the refitted model (``sglang_forward.py``) is compared with HF transformers'.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.distributed as dist

from refit_core import ParallelLayout
from refit_core.apps import same_bytes
from refit_core.kit.models import PRESETS, reference_state_dict

torch.set_num_threads(1)

SEED = 11
STEPS = (1, 2)
LOAD_FORMAT = "refit_sglang.worker.receive"
LOADER_SUFFIX = "+loader"
"""A preset name ending so forces its experts and q_proj (with k, v: one fused qkv_proj) onto the
loader path: refit receives them whole and hands them to SGLang's own ``load_weights``."""
FORCED_LOADER = (r"\.experts\.", r"q_proj")


class SglangSession:
    """SGLang's scheduler-side weight-update manager and model-runner ``WeightUpdater`` for one model."""

    def __init__(self, model: torch.nn.Module, tp_rank: int) -> None:
        from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager
        from sglang.srt.managers.tp_worker import TpModelWorker
        from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater

        updater = WeightUpdater(
            tp_rank=tp_rank, device="cpu", gpu_id=0, model_config=None,
            custom_weight_loaders={LOAD_FORMAT: True}, get_model=lambda: model,
            update_model_fields=lambda *a, **k: None, recapture_cuda_graph=lambda: None,
            get_model_runner=lambda: None)
        runner = types.SimpleNamespace(weight_updater=updater)
        worker = types.SimpleNamespace(model_runner=runner, weight_update_runners=lambda: [("target", runner)])
        worker.deserialize_own_rank = types.MethodType(TpModelWorker.deserialize_own_rank, worker)
        self.versions: list[str | None] = []
        self.flushes = 0
        scheduler = types.SimpleNamespace(
            record_weight_version_change=lambda new_version: self.versions.append(new_version))
        self.manager = SchedulerWeightUpdaterManager(
            tp_worker=worker, draft_worker=None, memory_saver_adapter=None, flush_cache=self._flush,
            is_fully_idle=lambda **k: True, scheduler=scheduler)

    def _flush(self, **kwargs: Any) -> bool:
        self.flushes += 1
        return True

    def update(self, serialized: bytes, version: str) -> list[tuple[str, bool, str]]:
        """What a scheduler runs for a trainer's begin / update_weights_from_tensor / end."""
        from sglang.srt.managers.io_struct import (
            BeginWeightUpdateReqInput,
            EndWeightUpdateReqInput,
            UpdateWeightsFromTensorReqInput,
        )
        from sglang.srt.runtime_context import get_parallel

        payload = [serialized] * get_parallel().tp_size
        out = []
        for what, call in (
            ("begin", lambda: self.manager.begin_weight_update(BeginWeightUpdateReqInput())),
            ("update", lambda: self.manager.update_weights_from_tensor(UpdateWeightsFromTensorReqInput(
                serialized_named_tensors=payload, load_format=LOAD_FORMAT, flush_cache=True,
                weight_version=version))),
            ("end", lambda: self.manager.end_weight_update(EndWeightUpdateReqInput())),
        ):
            answer = call()
            out.append((what, bool(answer.success), str(answer.message)))
        return out


POST_LOAD_TENSORS = ("w_kc", "w_vc")
"""Tensors SGLang's ``post_load_weights`` derives as plain attributes (DeepSeek's MLA absorbs
``kv_b_proj`` into them): compared too."""


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    tensors = {n: p.detach() for n, p in model.named_parameters()}
    for name, module in model.named_modules():
        for attr in POST_LOAD_TENSORS:
            value = getattr(module, attr, None)
            if isinstance(value, torch.Tensor):
                tensors[f"{name}.{attr}"] = value.detach()
    return tensors


def mismatches(model: torch.nn.Module, reference: torch.nn.Module) -> list[str]:
    mine, theirs = _params(model), _params(reference)
    return sorted(n for n in set(mine) | set(theirs)
                  if n not in mine or n not in theirs or not same_bytes(mine[n], theirs[n]))


def gen_rank(rank: int, world: int, dist_port: int, ports: list[int], presets: list[str],
             mismatch_port: int | None) -> dict[str, Any]:
    """One SGLang TP worker: per preset, a fresh model refitted twice through SGLang's session;
    then (``mismatch_port``) a session whose trainer holds another model, which must fail cleanly."""
    from refit_sglang import attach, worker
    from refit_sglang.layout import destination_layout
    from refit_sglang.ticket import RefitTicket
    from sglang_cpu import build_model, hf_config, init_sglang
    from sglang_forward import compare_logits

    from refit_core import get_plugin_manager

    init_sglang(rank, world, dist_port)
    out: dict[str, Any] = {}
    for case, port in zip(presets, ports):
        preset = case.removesuffix(LOADER_SUFFIX)
        config = dict(PRESETS[preset])
        model, reference = build_model(preset), build_model(preset)
        if case.endswith(LOADER_SUFFIX):
            attach(model, loader=FORCED_LOADER)
        session = SglangSession(model, rank)
        checks: dict[str, Any] = {}
        live = get_plugin_manager().destination_map(model)
        predicted = destination_layout(config, ParallelLayout(tp=world), rank)
        live_boxes = sorted((p.spec.name, p.spec.shape, p.box) for p in live.pieces)
        loader_names = {s.name for s in live.loader}
        checks["live_equals_metadata_layout"] = live_boxes == sorted(
            (p.spec.name, p.spec.shape, p.box) for p in predicted.pieces if p.spec.name not in loader_names)
        checks["loader_path"] = [s.name for s in live.loader]
        checks["differs_before"] = bool(mismatches(model, reference))
        for step in STEPS:
            ticket = RefitTicket(rendezvous=f"127.0.0.1:{port}", world_size=world, version=step, timeout_s=120)
            checks[f"session_{step}"] = session.update(ticket.serialized(), str(step))
            checks[f"error_{step}"] = worker.last_error(model)
            with torch.no_grad():
                reference.load_weights(iter(reference_state_dict(config, SEED, step).items()))
            checks[f"mismatch_{step}"] = mismatches(model, reference)
            weights = reference_state_dict(config, SEED, step)
            checks[f"logits_{step}"] = compare_logits(model, hf_config(preset), weights)
        checks["versions"] = session.versions
        checks["flushes"] = session.flushes
        out[case] = checks
        worker.close(model)
    if mismatch_port is not None:
        model = build_model("tiny-llama")
        with torch.no_grad():  # what it serves (SGLang allocates parameters uninitialized)
            model.load_weights(iter(reference_state_dict(dict(PRESETS["tiny-llama"]), SEED, 0).items()))
        before = {n: p.clone() for n, p in _params(model).items()}
        session = SglangSession(model, rank)
        ticket = RefitTicket(rendezvous=f"127.0.0.1:{mismatch_port}", world_size=world, version=1, timeout_s=60)
        out["mismatch"] = {"session": session.update(ticket.serialized(), "1"),
                           "error": worker.last_error(model),
                           "unchanged": all(same_bytes(p, before[n]) for n, p in _params(model).items())}
    return out


def train_rank(rank: int, world: int, dist_port: int, ports: list[int], presets: list[str],
               mismatch_port: int | None) -> dict[str, Any]:
    """One FSDP2 trainer rank: per preset, set step weights and send them; then (``mismatch_port``)
    a trainer whose Llama has a wider MLP than the engine's, whose setup must fail."""
    from refit_dtensor import build_model, init_mesh, load_hf_weights, shard_model

    from refit_core import RefitOptions, RefitSender

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{dist_port}", rank=rank, world_size=world)
    layout = ParallelLayout(fsdp=world)
    mesh = init_mesh(layout)
    out: dict[str, Any] = {}
    for case, port in zip(presets, ports):
        preset = case.removesuffix(LOADER_SUFFIX)
        config = dict(PRESETS[preset])
        model = shard_model(build_model(config, seed=3), layout, mesh)
        sender = RefitSender(model, rendezvous=f"127.0.0.1:{port}", rank=rank, world_size=world,
                             options=RefitOptions(timeout_s=120, bucket_bytes=1 << 20))
        sender.setup()
        sent = {}
        for step in STEPS:
            load_hf_weights(model, reference_state_dict(config, SEED, step))
            sent[step] = sender.send(version=step).bytes
        sender.close()
        out[case] = sent
    if mismatch_port is not None:
        config = dict(PRESETS["tiny-llama"], intermediate_size=384)
        model = shard_model(build_model(config, seed=3), layout, mesh)
        sender = RefitSender(model, rendezvous=f"127.0.0.1:{mismatch_port}", rank=rank, world_size=world,
                             options=RefitOptions(timeout_s=60))
        try:
            sender.setup()
            out["mismatch"] = ("none", "setup succeeded")
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            out["mismatch"] = (type(exc).__name__, str(exc))
    dist.destroy_process_group()
    return out


def refit_ranks(rank: int, world: int, train_world: int, dist_ports: list[int], ports: list[int],
                presets: list[str], mismatch_port: int | None = None) -> dict[str, Any]:
    """Train ranks ``0..train_world-1``, then the SGLang TP workers (see the module docstring)."""
    if rank < train_world:
        return train_rank(rank, train_world, dist_ports[0], ports, presets, mismatch_port)
    return gen_rank(rank - train_world, world - train_world, dist_ports[1], ports, presets, mismatch_port)
