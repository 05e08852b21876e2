"""Rank programs of the LoRA tests (spawned, so importable at top level).

Train ranks hold a PEFT-wrapped tiny Llama sharded with FSDP2 over gloo; gen ranks a plain (merged
mode) or PEFT-wrapped (adapter mode) copy with other weights. Ground truth comes from PEFT alone:
``get_peft_model_state_dict`` and ``merge_and_unload()`` of an unsharded twin holding the same weights.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from refit_dtensor import build_model, init_mesh, shard_model
from refit_dtensor.lora import merged

from refit_core import ParallelLayout, RefitOptions, RefitReceiver, RefitSender
from refit_core.apps import same_bytes
from refit_core.kit.models import PRESETS

torch.set_num_threads(1)

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK, ALPHA = 8, 16
STEPS = (1, 2)
SUBSET_STEP = 3
SUBSET = ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight")
"""Merged mode's last step moves only these merged weights (a subset step's executor merges as the whole one)."""
PEFT_PREFIX = "base_model.model."


def tiny_config() -> dict[str, Any]:
    return dict(PRESETS["tiny-llama"])


def peft_model(seed: int, *, targets: list[str] = TARGETS, dtype: torch.dtype = torch.float32, **extra: Any) -> Any:
    """A PEFT-wrapped tiny Llama, base and adapter weights drawn from ``seed`` (lora_B non-zero)."""
    from peft import LoraConfig, get_peft_model

    model = build_model(tiny_config(), dtype=dtype, seed=seed)
    config = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=targets, lora_dropout=0.05, **extra)
    wrapped = get_peft_model(model, config)
    set_adapter_weights(wrapped, seed, 0)
    return wrapped


@torch.no_grad()
def set_adapter_weights(model: Any, seed: int, step: int) -> None:
    """Every LoRA weight from ``(seed, step)`` (a training step's update), written in place (sharded too)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    generator = torch.Generator().manual_seed(seed * 1000 + step)
    for name, param in sorted(model.named_parameters()):
        if ".lora_" not in name:
            continue
        value = torch.randn(tuple(param.shape), generator=generator).to(param.dtype) * 0.1
        if isinstance(param, DTensor):
            param.to_local().copy_(distribute_tensor(value, param.device_mesh, param.placements).to_local())
        else:
            param.copy_(value)


def adapter_state(model: Any) -> dict[str, torch.Tensor]:
    """PEFT's own adapter checkpoint of ``model`` (names without ``base_model.model.``), gathered."""
    from peft import get_peft_model_state_dict
    from torch.distributed.tensor import DTensor

    state = get_peft_model_state_dict(model)
    return {k.removeprefix(PEFT_PREFIX): (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in state.items()}


def merged_reference(seed: int, step: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``merge_and_unload()`` of an unsharded twin of the train model at ``step``: its state dict."""
    twin = peft_model(seed, dtype=dtype)
    set_adapter_weights(twin, seed, step)
    plain = twin.merge_and_unload()
    return {k: v.detach().clone() for k, v in plain.state_dict().items()}


def _pieces_vs(pieces: list[Any], reference: dict[str, torch.Tensor]) -> list[str]:
    """Names of pieces whose view differs from the reference's box (or that it lacks)."""
    bad = []
    for piece in pieces:
        want = reference.get(piece.spec.name)
        if want is None or not same_bytes(piece.box.slice_of(want), piece.view):
            bad.append(f"{piece.spec.name}{piece.box}")
    return bad


def lora_ranks(rank: int, world: int, train_world: int, ports: list[int], cases: list[dict[str, str]]
               ) -> dict[str, dict[str, Any]]:
    """One rank running every case in turn: FSDP2 train ranks (a PEFT model, ``mode`` adapter or
    merged) refit two steps into gen ranks (unsharded); every rank reports what it checked, per case."""
    train = rank < train_world
    side_rank, side_world = (rank, train_world) if train else (rank - train_world, world - train_world)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[0 if train else 1]}",
                            rank=side_rank, world_size=side_world)
    out = {}
    for index, case in enumerate(cases):
        address = f"127.0.0.1:{ports[2 + index]}"
        run = _train_case if train else _gen_case
        began = time.perf_counter()
        out[case_name(case)] = run(side_rank, side_world, address, case)
        out[case_name(case)]["seconds"] = time.perf_counter() - began
    dist.destroy_process_group()
    return out


def case_name(case: dict[str, str]) -> str:
    return ":".join(case.values())


def _options(case: dict[str, str]) -> RefitOptions:
    """Network pairs (merged mode needs them), unless the case colocates CPU ranks (shared memory)."""
    from refit_core.contract.options import Colocation

    colocate = Colocation.SHARED if case.get("colocated") else Colocation.AUTO
    return RefitOptions(timeout_s=60, bucket_bytes=1 << 18, colocate=colocate,
                        **({"cast": case["cast"]} if "cast" in case else {}))


def _train_case(rank: int, world: int, address: str, case: dict[str, str]) -> dict[str, Any]:
    from refit_core import get_plugin_manager
    from refit_core.contract.spec import dtype_from_name

    out: dict[str, Any] = {}
    layout = ParallelLayout(fsdp=world)
    model = peft_model(1, dtype=dtype_from_name(case["dtype"]))
    shard_model(model.base_model.model, layout, init_mesh(layout))
    source = merged(model) if case["mode"] == "merged" else model
    if case["mode"] == "adapter":
        out["pieces_vs_peft"] = _pieces_vs(get_plugin_manager().source_pieces(source), adapter_state(model))
    endpoint = RefitSender(source, rendezvous=address, rank=rank, world_size=world, options=_options(case))
    try:
        endpoint.setup()
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return {"error": f"{type(exc).__name__}: {exc}"}
    for step in STEPS:
        set_adapter_weights(model, 1, step)
        out[f"bytes_{step}"] = endpoint.send(version=step).bytes
    if case["mode"] == "merged":
        set_adapter_weights(model, 1, SUBSET_STEP)
        out["bytes_subset"] = endpoint.send(version=SUBSET_STEP, only=SUBSET).bytes
    endpoint.close()
    return out


def _gen_case(rank: int, world: int, address: str, case: dict[str, str]) -> dict[str, Any]:
    from refit_core.contract.spec import dtype_from_name

    out: dict[str, Any] = {}
    dtype, gen_dtype = dtype_from_name(case["dtype"]), dtype_from_name(case["gen_dtype"])
    if case["mode"] == "merged":
        model = build_model(tiny_config(), dtype=gen_dtype, seed=50)
    else:
        model = peft_model(50, dtype=gen_dtype, targets=case.get("gen_targets", ",".join(TARGETS)).split(","))
        for name, param in model.named_parameters():  # PEFT keeps adapters in fp32: the engine's slots may not
            if ".lora_" in name:
                param.data = param.data.to(gen_dtype)
    endpoint = RefitReceiver(model, rendezvous=address, rank=rank, world_size=world, options=_options(case))
    try:
        endpoint.setup()
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return {"error": f"{type(exc).__name__}: {exc}"}
    for step in STEPS:
        out[f"version_{step}"] = endpoint.receive().version
        if case["mode"] == "merged":
            want = merged_reference(1, step, dtype)
            state = model.state_dict()
        else:  # the train model's adapter, rebuilt unsharded: PEFT's own checkpoint of it
            twin = peft_model(1, dtype=dtype)
            set_adapter_weights(twin, 1, step)
            state, want = adapter_state(model), adapter_state(twin)
        out[f"mismatch_{step}"] = sorted(n for n in want if n not in state or not same_bytes(state[n], want[n]))
        out[f"checked_{step}"] = len(want)
    if case["mode"] == "merged":  # the named weights merged with step 3's adapters, the others still step 2's
        out["version_subset"] = endpoint.receive(only=SUBSET).version
        before, after, state = merged_reference(1, STEPS[-1], dtype), merged_reference(1, SUBSET_STEP, dtype), \
            model.state_dict()
        want = {n: after[n] if n in SUBSET else t for n, t in before.items()}
        out["mismatch_subset"] = sorted(n for n in want if n not in state or not same_bytes(state[n], want[n]))
        out["subset_changes"] = [n for n in SUBSET if not same_bytes(before[n], after[n])]
    endpoint.close()
    return out
