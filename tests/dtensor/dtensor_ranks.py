"""Rank programs of the dtensor plugin's multi-process tests (spawned, so importable at top level).

Every spawned process is one rank of one side: train ranks ``0..S-1`` and gen ranks ``S..S+D-1``
each join their own gloo process group (their own port) and build their own device mesh, as a
trainer and an inference engine would; refit connects them through its own rendezvous.
Ground truth never comes from refit_dtensor: transformers' own checkpoint conversion
(``revert_weight_conversion``), ``from_pretrained`` of a saved checkpoint, and ``full_tensor()``.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from refit_dtensor import build_model, init_mesh, model_pieces, shard_model
from refit_dtensor.layout import layout_pieces
from refit_dtensor.names import named_parameters

from refit_core import DestinationPiece, ParallelLayout, SourcePiece
from refit_core.kit.models import PRESETS
from refit_core.apps import same_bytes

torch.set_num_threads(1)

SEED = 7
STEPS = (1, 2)
PROMPT = torch.tensor([[3, 141, 59, 265, 358, 97, 93, 238], [46, 264, 338, 327, 95, 28, 84, 197]])
REPLICATED = "replicated"  # a source layout: every rank holds the whole plain (non-DTensor) model


def model_config(name: str, **overrides: Any) -> dict[str, Any]:
    config = dict(PRESETS[name])
    config.update(overrides)
    return config


def hf_checkpoint(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What ``save_pretrained`` would write for a plain model (transformers' own conversion),
    tied copies dropped, per-expert tensors stacked into refit's grouped names."""
    from transformers.core_model_loading import revert_weight_conversion

    from refit_core.contract.experts import default_expert_name

    state = revert_weight_conversion(model, {k: v.detach().clone() for k, v in model.state_dict().items()})
    if model.config.tie_word_embeddings:
        for tied in model.all_tied_weights_keys:
            state.pop(tied, None)
    experts: dict[str, dict[int, torch.Tensor]] = {}
    out = {}
    for name, tensor in state.items():
        expert = default_expert_name(name)
        if expert is None:
            out[name] = tensor
        else:
            experts.setdefault(expert.group, {})[expert.index] = tensor
    for group, members in experts.items():
        out[group] = torch.stack([members[e] for e in range(len(members))])
    return out


def assemble(per_rank: list[list[tuple[str, tuple, Any, torch.Tensor]]],
             reference: dict[str, torch.Tensor]) -> list[str]:
    """Put every rank's ``(name, shape, box, values)`` into full tensors; compare with ``reference``.
    Replicas must agree; every element must be covered; nothing extra may appear."""
    problems: list[str] = []
    full: dict[str, torch.Tensor] = {}
    covered: dict[str, torch.Tensor] = {}
    for pieces in per_rank:
        for name, shape, box, values in pieces:
            if name not in full:
                full[name] = torch.zeros(shape, dtype=values.dtype)
                covered[name] = torch.zeros(shape, dtype=torch.bool)
            region, mask = box.slice_of(full[name]), box.slice_of(covered[name])
            if mask.any() and not same_bytes(region[mask], values[mask]):
                problems.append(f"{name}{box}: replicas differ")
            region.copy_(values)
            mask.fill_(True)
    for name, tensor in reference.items():
        if name not in full:
            problems.append(f"{name}: held by no rank")
        elif not covered[name].all():
            problems.append(f"{name}: {int((~covered[name]).sum())} elements held by no rank")
        elif not same_bytes(full[name], tensor):
            problems.append(f"{name}: differs from the reference")
    problems += [f"{name}: unexpected" for name in full if name not in reference]
    return problems


def _gather(local: Any, world: int) -> list[Any]:
    out: list[Any] = [None] * world
    dist.all_gather_object(out, local)
    return out


def _full(param: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor
    return param.full_tensor() if isinstance(param, DTensor) else param.detach()


def _shape_and_boxes(pieces: list[Any]) -> list[tuple[str, tuple, Any]]:
    return [(p.spec.name, p.spec.shape, p.box) for p in pieces]


# -- placements of raw DTensors -----------------------------------------------------------------

def placement_ranks(rank: int, world: int, port: int) -> dict[str, list[str]]:
    """Uneven, empty, strided and mixed placements on 4 ranks: the blocks of every rank,
    assembled, must equal ``full_tensor()`` (each element held exactly once)."""
    from refit_dtensor.placements import tensor_blocks
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Replicate, Shard, _StridedShard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    flat = init_device_mesh("cpu", (4,))
    square = init_device_mesh("cpu", (2, 2))
    torch.manual_seed(0)
    cases: dict[str, DTensor] = {}
    cases["shard0 5 rows over 4 ranks (2,2,1,0)"] = distribute_tensor(torch.randn(5, 3), flat, [Shard(0)])
    cases["shard1 uneven 3 cols over 4 ranks"] = distribute_tensor(torch.randn(2, 3), flat, [Shard(1)])
    cases["shard0 x shard0 uneven 7 rows"] = distribute_tensor(torch.randn(7, 3), square, [Shard(0), Shard(0)])
    cases["shard1 x shard0 mixed dims"] = distribute_tensor(torch.randn(5, 7), square, [Shard(1), Shard(0)])
    cases["replicate x shard1"] = distribute_tensor(torch.randn(4, 6), square, [Replicate(), Shard(1)])
    strided = torch.randn(16, 2)
    cases["strided sf=2 on 4 ranks (two row runs each)"] = DTensor.from_local(
        _StridedShard(0, split_factor=2)._split_tensor(strided, 4, with_padding=False)[0][rank].clone(),
        flat, [_StridedShard(0, split_factor=2)], shape=strided.shape, stride=strided.stride())
    cases["strided x shard (fsdp over tp) 10 rows"] = distribute_tensor(
        torch.randn(10, 3), square, [Replicate(), Shard(0)]).redistribute(square, [_StridedShard(0, split_factor=2),
                                                                                  Shard(0)])
    linear = torch.nn.Linear(4, 3)
    fully_shard(linear, mesh=flat)  # FSDP2: 3 rows over 4 ranks, rank 3 holds nothing
    cases["fsdp2 weight 3 rows over 4 ranks"] = linear.weight
    cases["fsdp2 bias 3 over 4 ranks"] = linear.bias
    results: dict[str, list[str]] = {}
    for name, tensor in cases.items():
        local, blocks = tensor_blocks(tensor, what=name)
        mine = [(name, tuple(tensor.shape), b.box, b.local.slice_of(local).detach().clone()) for b in blocks]
        everyone = _gather(mine, world)
        reference = {name: tensor.full_tensor().detach()}
        results[name] = assemble(everyone, reference)
        if name.startswith("strided sf=2") and len(blocks) != 2:
            results[name].append(f"rank {rank}: {len(blocks)} blocks, expected 2")
        if "(2,2,1,0)" in name and rank == 3 and blocks:
            results[name].append("rank 3 should hold nothing")
    dist.destroy_process_group()
    return results


# -- end-to-end refits --------------------------------------------------------------------------

def write_truth(directory: str, model: str, steps: tuple[int, ...] = STEPS) -> None:
    """Per step: the reference checkpoint saved as safetensors and loaded back by
    ``transformers.from_pretrained``; its parameters (model layout) and logits on ``PROMPT``
    are saved to ``{directory}/{model}-{step}.pt``."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from refit_core.kit.models import reference_state_dict

    hf_logging.disable_progress_bar()
    config = model_config(model)
    values = dict(config)
    hf_config = AutoConfig.for_model(values.pop("model_type"), **values)
    for step in steps:
        folder = os.path.join(directory, f"{model}-{step}")
        os.makedirs(folder, exist_ok=True)
        hf_config.save_pretrained(folder)
        state = {k: v.contiguous() for k, v in reference_state_dict(config, SEED, step).items()}
        save_file(state, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        with torch.no_grad():
            logits = loaded(input_ids=PROMPT).logits
        params = {n: p.detach().clone() for n, p in loaded.named_parameters()}
        tied = {t: params[s] for t, s in loaded.all_tied_weights_keys.items()} if config["tie_word_embeddings"] else {}
        torch.save({"params": params, "tied": tied, "logits": logits}, os.path.join(directory, f"{model}-{step}.pt"))


def case_id(case: dict[str, Any]) -> str:
    tags = [case["model"], case.get("dtype", "float32")]
    if case.get("shard_tied_embeddings"):
        tags.append("tied-embeddings-tp-sharded")
    return ":".join(tags)


def refit_ranks(rank: int, world: int, train_world: int, ports: list[int], src_layout: str, dst_layout: str,
                cases: list[dict[str, Any]], truth_dir: str, mismatch: dict[str, Any] | None = None
                ) -> dict[str, Any]:
    """One rank of a train (``rank < train_world``) or gen program running every case: a fresh
    model pair, checked, then refitted twice (steps 1 and 2) and checked again. With ``mismatch``,
    then :func:`mismatched_setup` on rendezvous port ``ports[2 + len(cases)]``, under key ``"mismatch"``."""
    from refit_dtensor import load_hf_weights
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from refit_core import RefitOptions, RefitReceiver, RefitSender
    from refit_core.contract.spec import dtype_from_name
    from refit_core.kit.models import reference_state_dict
    from refit_core.kit.verify import mismatches

    train = rank < train_world
    side_rank, side_world = (rank, train_world) if train else (rank - train_world, world - train_world)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[0 if train else 1]}",
                            rank=side_rank, world_size=side_world)
    layout_text = src_layout if train else dst_layout
    replicated = layout_text == REPLICATED
    layout = ParallelLayout() if replicated else ParallelLayout.parse(layout_text)
    mesh = None if replicated else init_mesh(layout)
    options = RefitOptions(timeout_s=60, bucket_bytes=1 << 20)
    out: dict[str, Any] = {}
    for index, case in enumerate(cases):
        config = model_config(case["model"])
        dtype = torch.float32 if train else dtype_from_name(case.get("dtype", "float32"))
        model = build_model(config, dtype=dtype, seed=1 if train else 100 + side_rank)
        if mesh is not None:
            # a bf16 destination case: the trainer computes in bf16, its sharded master weights stay fp32
            mixed = train and case.get("dtype", "float32") != "float32" and layout.fsdp * layout.dp > 1
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if mixed else None
            shard_model(model, layout, mesh, mp_policy=mp,
                        shard_tied_embeddings=case.get("shard_tied_embeddings", False) and not train)
        checks: dict[str, Any] = {}
        kind = SourcePiece if train else DestinationPiece
        live = model_pieces(model, kind)
        if not replicated:
            predicted = layout_pieces(kind, config, layout, side_rank)
            checks["metadata_layout_equal"] = _shape_and_boxes(live) == _shape_and_boxes(predicted)
        if train:
            plain = build_model(config, seed=1)
            everyone = _gather([(p.spec.name, p.spec.shape, p.box, p.view.clone()) for p in live], side_world)
            checks["pieces_vs_transformers"] = assemble(everyone, hf_checkpoint(plain)) if side_rank == 0 else []
            reference_params = dict(plain.named_parameters())
            checks["full_tensor_equal"] = all(same_bytes(_full(p), reference_params[n].detach())
                                              for n, p in named_parameters(model))
        truths = [torch.load(os.path.join(truth_dir, f"{case['model']}-{s}.pt")) for s in STEPS]
        address = f"127.0.0.1:{ports[2 + index]}"
        if train:
            endpoint = RefitSender(model, rendezvous=address, rank=side_rank, world_size=side_world, options=options)
            endpoint.setup()
            for step, truth in zip(STEPS, truths):
                load_hf_weights(model, reference_state_dict(config, SEED, step))
                checks[f"source_equal_{step}"] = all(
                    same_bytes(_full(p), truth["params"][n]) for n, p in named_parameters(model))
                checks[f"sent_bytes_{step}"] = endpoint.send(version=step).bytes
            if index == 0:
                checks["moves"] = _moves_seen(endpoint, model)
        else:
            endpoint = RefitReceiver(model, rendezvous=address, rank=side_rank, world_size=side_world,
                                     options=options)
            endpoint.setup()
            for step, truth in zip(STEPS, truths):
                stats = endpoint.receive()
                checks[f"version_{step}"] = stats.version
                full = {n: _full(p) for n, p in named_parameters(model)}
                expected = {n: t.to(dtype) for n, t in truth["params"].items()}
                if case.get("shard_tied_embeddings"):  # the split-off copy, synced by refit_finish_update
                    full["lm_head.weight"] = _full(model.lm_head.weight)
                    expected["lm_head.weight"] = truth["tied"]["lm_head.weight"].to(dtype)
                checks[f"params_mismatch_{step}"] = sorted(
                    n for n in set(expected) | set(full)
                    if n not in full or n not in expected or not same_bytes(full[n], expected[n]))
                checks[f"pieces_mismatch_{step}"] = mismatches(
                    endpoint.plugins.destination_map(model).pieces, reference_state_dict(config, SEED, step))
                checks[f"logits_{step}"] = _logits(model, config, full, truth["logits"], layout, dtype)
        endpoint.close()
        out[case_id(case)] = checks
    if mismatch is not None:
        out["mismatch"] = mismatched_setup(train, side_rank, side_world, layout, mesh,
                                           f"127.0.0.1:{ports[2 + len(cases)]}", mismatch)
    dist.destroy_process_group()
    return out


def _moves_seen(endpoint: Any, model: torch.nn.Module) -> dict[str, Any]:
    """What the bound-memory check says of the train side's model (the dtensor plugin's ``refit_model_tensors``),
    after a forward (FSDP2 keeps the root's all-gathered copies), then after a parameter is replaced."""
    memory = endpoint._memory
    with torch.no_grad():
        model(input_ids=PROMPT)
    after_forward = endpoint._memory_problem()
    name, param = next(iter(named_parameters(model)))
    owner, _, key = name.rpartition(".")
    setattr(model.get_submodule(owner), key, torch.nn.Parameter(param.detach().clone()))
    return {"lists": memory is not None and memory.lists, "after_forward": after_forward, "replaced": name,
            "after_replace": endpoint._memory_problem()}


def _logits(model: torch.nn.Module, config: dict[str, Any], full: dict[str, torch.Tensor],
            expected: torch.Tensor, layout: ParallelLayout, dtype: torch.dtype) -> dict[str, bool]:
    """Logits on ``PROMPT`` after a refit: a plain model holding the destination's gathered weights
    must match the reference bit for bit; the sharded model's own forward too under FSDP2
    (all-gather, then the same math), and to 1e-5 under tensor parallel (sums reordered).
    The standard plan's expert-parallel MoE experts have no sharded forward: gathered only."""
    result: dict[str, bool] = {}
    if dtype != torch.float32:
        return result
    plain = build_model(config, seed=0)
    with torch.no_grad():
        for name, param in named_parameters(plain):
            param.copy_(full[name])
        result["gathered_equal"] = torch.equal(plain(input_ids=PROMPT).logits, expected)
        if layout.tp == 1 or "num_experts" not in config:
            own = _full(model(input_ids=PROMPT).logits)
            if layout.tp == 1:
                result["own_forward_equal"] = torch.equal(own, expected)
            else:
                result["own_forward_close"] = torch.allclose(own, expected, rtol=0, atol=1e-5)
    return result


# -- setup errors -------------------------------------------------------------------------------

def mismatched_setup(train: bool, side_rank: int, side_world: int, layout: ParallelLayout, mesh: Any, address: str,
                     overrides: dict[str, Any]) -> tuple[str, str]:
    """A stock tiny Llama on the train side, ``overrides`` in the gen side's config, sharded as
    ``layout`` on ``mesh``: setup must fail on every rank, before any transfer. Returns ``(error type,
    message)``."""
    from refit_core import RefitOptions, RefitReceiver, RefitSender

    config = model_config("tiny-llama", **({} if train else overrides))
    model = shard_model(build_model(config), layout, mesh)
    kind = RefitSender if train else RefitReceiver
    endpoint = kind(model, rendezvous=address, rank=side_rank, world_size=side_world,
                    options=RefitOptions(timeout_s=30))
    try:
        endpoint.setup()
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return type(exc).__name__, str(exc)
    return "none", "setup succeeded"
