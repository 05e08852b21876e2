"""Rank programs of the SGLang adapter-mode test (spawned, so importable at top level).

Rank 0 trains: it holds a PEFT adapter's tensors whole (``refit bench --lora``'s plain holder) and sends
two versions of them. Ranks 1.. are the TP workers of one SGLang engine: SGLang's parallel state over gloo,
its model class, its real ``LoRAManager`` and
``LoRAMemoryPool`` (``torch_native`` backend, built as a model runner builds them: ``sglang_cpu.py``), and
refit's :class:`refit_sglang.lora.AdapterTarget` receiving into the pool's slots. Ground truth never comes
from refit: after each step the same adapter is loaded into another slot by SGLang's own
``load_lora_adapter_from_tensors`` + ``fetch_new_loras``, and every slot byte must equal it; and SGLang's
own LoRA forward with refit's adapter (``prepare_lora_batch``, its torch_native LoRA backend) must give
the next-token logits of HF transformers running the PEFT model.
"""

from __future__ import annotations

from typing import Any

import torch

from refit_core import Box, LoraSpec, RefitOptions, RefitReceiver, RefitSender, SourcePiece, TensorSpec
from refit_core.apps import same_bytes
from refit_core.kit.models import PRESETS, reference_state_dict

torch.set_num_threads(1)

PRESET = "tiny-llama"
SEED = 11
STEPS = (1, 2)
MAX_RANK, SLOTS = 8, 3
SPEC = LoraSpec(rank=8, alpha=20, targets=("q", "v", "o", "gate", "up", "down"), name="policy")
"""No k_proj: SGLang stacks zeros in its place in the fused qkv slot (PEFT's default q/v adapters do so)."""
OPTIONS = RefitOptions(timeout_s=30)


def adapter_specs() -> list[TensorSpec]:
    """The trainer's view of the adapter: A ``[r, in]`` / B ``[out, r]`` of every targeted HF weight."""
    from refit_core.kit import checkpoint_specs

    specs = []
    for weight in checkpoint_specs(dict(PRESETS[PRESET]), grouped=False):
        module = weight.name.removesuffix(".weight")
        if len(weight.shape) == 2 and ".layers." in module and SPEC.targets_module(module):
            out_features, in_features = weight.shape
            specs += [TensorSpec(f"{module}.lora_A.weight", (SPEC.rank, in_features), torch.float32),
                      TensorSpec(f"{module}.lora_B.weight", (out_features, SPEC.rank), torch.float32)]
    return specs


def adapter_values(specs: list[TensorSpec], step: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return {s.name: torch.randn(s.shape, generator=generator, dtype=s.dtype) for s in specs}


def lora_ranks(rank: int, world: int, rendezvous: int, sglang_port: int) -> dict[str, Any]:
    return _train(rendezvous) if rank == 0 else _serve(rendezvous, sglang_port, rank - 1, world - 1)


def _train(port: int) -> dict[str, Any]:
    from refit_core.tools.bench.lora import Holder, register

    register()
    specs = adapter_specs()
    held = {s.name: torch.zeros(s.shape, dtype=s.dtype) for s in specs}
    holder = Holder([SourcePiece(s, Box.full(s.shape), held[s.name]) for s in specs], source=True)
    sender = RefitSender(holder, rendezvous=f"127.0.0.1:{port}", rank=0, world_size=1, options=OPTIONS)
    sender.setup()
    for step in STEPS:
        for name, value in adapter_values(specs, step).items():
            held[name].copy_(value)
        sender.send(version=step)
    sender.close()
    return {}


def _slot_differences(manager: Any, mine: int, theirs: int) -> list[str]:
    pool = manager.memory_pool
    return [f"{buffer}[{module}][{layer}]" for buffer in ("A_buffer", "B_buffer")
            for module, tensors in getattr(pool, buffer).items() for layer, t in enumerate(tensors)
            if not same_bytes(t[mine], t[theirs])]


def _nonzero(manager: Any, slot: int) -> int:
    pool = manager.memory_pool
    return sum(int((t[slot] != 0).sum()) for buffer in ("A_buffer", "B_buffer")
               for tensors in getattr(pool, buffer).values() for t in tensors)


def _compare(ours: torch.Tensor, theirs: torch.Tensor) -> dict[str, Any]:
    return {"rel_diff": float((ours - theirs).abs().max() / theirs.abs().max()),
            "same_argmax": bool(torch.equal(ours.argmax(-1), theirs.argmax(-1)))}


def _peft_logits(base: dict[str, torch.Tensor], values: dict[str, torch.Tensor]) -> torch.Tensor:
    """HF transformers' next-token logits of the base model with the PEFT adapter ``values``."""
    import os
    import tempfile

    from peft import LoraConfig, get_peft_model
    from safetensors.torch import save_file
    from sglang_cpu import hf_config
    from sglang_forward import PROMPTS
    from transformers import AutoModelForCausalLM

    from refit_core.contract.lora import AdapterTensorName

    with tempfile.TemporaryDirectory() as folder:
        hf_config(PRESET).save_pretrained(folder)
        save_file({k: v.contiguous() for k, v in base.items()}, os.path.join(folder, "model.safetensors"))
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    config = LoraConfig(r=SPEC.rank, lora_alpha=SPEC.alpha, target_modules=list(SPEC.targets), lora_dropout=0.0)
    model = get_peft_model(hf, config).eval()
    with torch.no_grad():
        for name, value in values.items():
            parsed = AdapterTensorName.read(name)
            assert parsed is not None
            getattr(model.base_model.model.get_submodule(parsed.module), parsed.half)["default"].weight.copy_(value)
        return torch.stack([model(input_ids=torch.tensor([p])).logits[0, -1] for p in PROMPTS])


def _refusal(manager: Any, spec: LoraSpec) -> str | None:
    from refit_sglang.lora import AdapterTarget

    from refit_core import PlanError

    try:
        AdapterTarget(manager, spec)
    except PlanError as exc:
        return str(exc)
    return None


def _serve(port: int, sglang_port: int, tp_rank: int, tp: int) -> dict[str, Any]:
    from sglang.srt.lora.lora_registry import LoRARef
    from sglang_cpu import build_lora_manager, build_model, hf_config, init_sglang
    from sglang_forward import hf_logits, sglang_logits

    from refit_sglang.lora import AdapterTarget

    init_sglang(tp_rank, tp, sglang_port)
    model = build_model(PRESET)
    base = reference_state_dict(dict(PRESETS[PRESET]), SEED, 0)
    model.load_weights(iter(base.items()))  # the engine's base weights, loaded before LoRA wraps its layers
    manager = build_lora_manager(model, max_lora_rank=MAX_RANK, slots=SLOTS)
    base_logits = hf_logits(hf_config(PRESET), base)
    target = AdapterTarget(manager, SPEC)
    receiver = RefitReceiver(target, rendezvous=f"127.0.0.1:{port}", rank=tp_rank, world_size=tp, options=OPTIONS)
    receiver.setup()
    specs = adapter_specs()
    out: dict[str, Any] = {"steps": []}
    for step in STEPS:
        stats = receiver.receive()
        values = adapter_values(specs, step)

        def with_adapter(batch: Any) -> None:
            batch.lora_ids = [target.plan.lora_id] * batch.batch_size
            manager.prepare_lora_batch(batch)

        ours = sglang_logits(model, model.config.vocab_size, prepare=with_adapter)
        peft = _compare(ours, _peft_logits(base, values))
        peft["differs_from_base"] = _compare(ours, base_logits)["rel_diff"] > 0.1
        reference = LoRARef(lora_name=f"reference-{step}", lora_path="reference", pinned=False)
        tensors = {f"base_model.model.{n}": v for n, v in values.items()}
        config = {"peft_type": "LORA", "r": SPEC.rank, "lora_alpha": SPEC.alpha, "target_modules": list(SPEC.targets)}
        assert manager.load_lora_adapter_from_tensors(reference, tensors, config).success
        manager.fetch_new_loras({reference.lora_id})
        slot = manager.memory_pool.uid_to_buffer_id[reference.lora_id]
        out["steps"].append({"version": stats.version, "bytes": stats.bytes, "slot": target.plan.slot,
                             "reference_slot": slot, "differ": _slot_differences(manager, target.plan.slot, slot),
                             "nonzero": _nonzero(manager, target.plan.slot),
                             "reference_nonzero": _nonzero(manager, slot), "target_version": target.version,
                             "peft": peft})
        manager.unload_lora_adapter(reference)
    receiver.close()

    # a failed step's restore through the hooks refit calls (the core's own, for an adapter target): every slot
    # byte back
    before = [v.clone() for v in target.views()]
    moved = receiver.plugins.begin_update(target)
    for view in target.views():
        view.fill_(7.0)
    restored = receiver.plugins.abort_update(target, [s.name for s in target.plan.specs])
    out["restored"] = restored is True and moved is False and all(
        same_bytes(a, b) for a, b in zip(before, target.views()))

    # registration once: a later session for the same name finds its slot, nothing is loaded again
    adapters = dict(manager.loras)
    again = AdapterTarget(manager, SPEC)
    out["again"] = {"slot": again.plan.slot == target.plan.slot, "loaded": set(manager.loras) == set(adapters)}

    out["refused"] = {
        "rank": _refusal(manager, LoraSpec(rank=16, alpha=32, name="wide")),
        "targets": _refusal(manager, LoraSpec(rank=4, alpha=8, targets=("q", "v", "w_pack"), name="alien")),
        "shape": _refusal(manager, LoraSpec(rank=4, alpha=8, targets=SPEC.targets, name="policy")),
        "second": _refusal(manager, LoraSpec(rank=4, alpha=8, name="second")),
        "slots": _refusal(manager, LoraSpec(rank=4, alpha=8, name="third")),
        "stacking": _refusal(manager, LoraSpec(rank=4, alpha=8, targets=("k", "v"), name="no-q")),
    }
    return out
