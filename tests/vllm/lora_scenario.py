"""The adapter-mode scenario (``python tests/vllm/scenarios.py lora '{...}'``): one vLLM engine with LoRA.

The train side is one rank holding a PEFT model's adapter tensors (``refit_vllm.held.HeldWeights``, the
one-rank source the vLLM plugin already has for a ``WeightSource``; the dtensor plugin's PEFT source is
another helper's), refilled with new random values each step. The ground truth is HF transformers
running ``peft.get_peft_model`` on the same base weights with the same adapter values, and vLLM's own
adapter loader (``add_lora`` of the PEFT adapter saved to a folder) in the engine's second slot.
The refits go through vLLM's weight-transfer API (``init_info["lora"]``, ``finish_weight_update``, whose
``reset_lora_state`` refit's adapter survives); the refused sessions through ``refit_init(lora=...)``.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import scenarios  # noqa: F401 - the engine environment, before vLLM is imported
import torch
from scenarios import NEW_TOKENS, SEED, Trainers, count_calls, scratch_dir, tiny_config

SPEC = {"rank": 8, "alpha": 20.0, "name": "policy"}
"""alpha / r = 2.5: folding it into B rounds, so equal slot bytes show the same transform as vLLM's."""
REFERENCE_ID = 4242


def peft_model(cfg: dict[str, Any], base_dir: str | None, spec: dict[str, Any]) -> Any:
    """``peft.get_peft_model`` on an HF model of ``cfg`` (base weights from ``base_dir``, else random)."""
    import peft
    import transformers
    from refit_vllm.reference import hf_config

    from refit_core import LoraSpec

    lora = LoraSpec(**spec)
    if base_dir is None:
        model = transformers.AutoModelForCausalLM.from_config(hf_config(cfg), dtype=torch.float32)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = peft.LoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=list(lora.targets), lora_dropout=0.0)
    return peft.get_peft_model(model, config)


def adapter_values(model: Any, step: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Random adapter tensors of step ``step`` under refit's names (PEFT's, minus ``base_model.model.``)."""
    import peft
    from refit_vllm.lora import PEFT_PREFIX

    generator = torch.Generator().manual_seed(1000 + step)
    state = peft.get_peft_model_state_dict(model)
    return {name.removeprefix(PEFT_PREFIX): (torch.randn(t.shape, generator=generator) * 0.2).to(dtype)
            for name, t in sorted(state.items())}


def set_adapter(model: Any, values: dict[str, torch.Tensor]) -> None:
    import peft
    from refit_vllm.lora import PEFT_PREFIX

    result = peft.set_peft_model_state_dict(model, {PEFT_PREFIX + k: v for k, v in values.items()})
    assert not [k for k in result.unexpected_keys if "lora_" in k], result.unexpected_keys


def train_adapter(rank: int, world: int, cfg: dict[str, Any], spec: dict[str, Any], rendezvous: str,
                  steps: list[int], options: dict[str, Any], dtype: str = "float32") -> None:
    """One train rank holding the PEFT model's adapter tensors (``HeldWeights``); one send per step."""
    from refit_vllm.held import Declared, HeldWeights

    from refit_core import RefitOptions, RefitSender

    model = peft_model(cfg, None, spec)
    first = adapter_values(model, 0, getattr(torch, dtype))
    held = HeldWeights([Declared(n, t.dtype, tuple(t.shape)) for n, t in first.items()], torch.device("cpu"))
    sender = RefitSender(held, rendezvous=rendezvous, rank=0, world_size=1, options=RefitOptions(**options))
    try:
        sender.setup()
        for step in steps:
            held.fill(list(adapter_values(model, step, getattr(torch, dtype)).items()))
            sender.send(version=step)
    finally:
        sender.close()


def _slots(worker: Any, names: list[str]) -> dict[str, Any]:
    """Every LoRA slot tensor of the adapters ``names`` (refit's or vLLM's), compared slot by slot."""
    from refit_vllm.lora import lora_int_id

    from refit_core.apps import same_bytes

    manager = worker.model_runner.get_model().lora_manager
    ids = {name: (lora_int_id(name) if name != "reference" else REFERENCE_ID) for name in names}
    slots = {name: manager.lora_index_to_id.index(i) for name, i in ids.items()}
    refit, reference = slots["policy"], slots["reference"]
    differ, nonzero = [], 0
    for layer_name, layer in manager.modules.items():
        for attr in ("lora_a_stacked", "lora_b_stacked"):
            stacked = getattr(layer, attr)  # a tuple per fused slice; one tensor in embedding layers
            for i, t in enumerate(stacked if isinstance(stacked, (tuple, list)) else (stacked,)):
                if not same_bytes(t[refit], t[reference]):
                    differ.append(f"{layer_name}.{attr}.{i}")
                nonzero += int(t[refit].count_nonzero())
    return {"slots": slots, "differ": differ, "nonzero": nonzero, "tensors": len(manager.modules)}


def _abort_restores(worker: Any) -> dict[str, Any]:
    """The begin / abort hooks a failed step calls, on the adapter's live slots, around garbage written into
    every byte of it: the slots come back byte for byte (the core's own hooks answer for an adapter target)."""
    from refit_vllm.lora import AdapterTarget, lora_spec

    from refit_core import get_plugin_manager
    from refit_core.apps import same_bytes

    plugins = get_plugin_manager()
    target = AdapterTarget(worker.model_runner.get_model(), lora_spec(SPEC))
    before = [v.clone() for v in target.views()]
    moved = plugins.begin_update(target)
    for view in target.views():
        view.fill_(7.0)
    torn = not all(same_bytes(v, b) for v, b in zip(target.views(), before))
    restored = plugins.abort_update(target, [p.spec.name for p in plugins.destination_map(target).pieces])
    return {"torn": torn, "restored": restored is True and moved is False
            and all(same_bytes(v, b) for v, b in zip(target.views(), before)), "pieces": len(before)}


def _rows(mapping: Any) -> list[str]:
    """A destination map as plain text rows (name, shape, dtype, offsets, sizes), sorted."""
    return sorted(f"{p.spec.name} {p.spec.shape} {p.spec.dtype} {p.box.offsets} {p.box.sizes}" for p in mapping.pieces)


def _adapter_rows(worker: Any) -> list[str]:
    """The live adapter destination map of this worker."""
    from refit_vllm.lora import AdapterTarget, lora_spec

    return _rows(AdapterTarget(worker.model_runner.get_model(), lora_spec(SPEC)).destination_map())


def _register(worker: Any, spec: dict[str, Any]) -> str | None:
    """Register a refit adapter without a session (the slot-count check); its error text, or None."""
    from refit_vllm.lora import AdapterTarget, lora_spec

    try:
        AdapterTarget(worker.model_runner.get_model(), lora_spec(spec))
    except Exception as exc:  # noqa: BLE001 - the test reads it
        return f"{type(exc).__name__}: {exc}"
    return None


def _refused_session(llm: Any, cfg: dict[str, Any], engine_spec: dict[str, Any], train_spec: dict[str, Any],
                     options: dict[str, Any] | None = None, dtype: str = "float32") -> dict[str, Any]:
    """A session that must fail at setup (its trainer on a thread: no byte is to move): the engine's error,
    the trainer's, and the seconds the whole attempt took."""
    from refit_core.kit.launch import free_port

    options = {"timeout_s": 30, **(options or {})}
    rendezvous = f"127.0.0.1:{free_port()}"
    began = time.perf_counter()
    errors: list[BaseException] = []

    def train() -> None:
        try:
            train_adapter(0, 1, cfg, train_spec, rendezvous, [9], options, dtype)
        except BaseException as exc:  # noqa: BLE001 - read below
            errors.append(exc)

    thread = threading.Thread(target=train, daemon=True)
    thread.start()
    engine_errors = llm.collective_rpc(_try_init, args=(rendezvous, engine_spec, options))
    thread.join(60)
    return {"engine": engine_errors, "trainer": f"{type(errors[0]).__name__}: {errors[0]}" if errors else None,
            "seconds": time.perf_counter() - began}


def _try_init(worker: Any, rendezvous: str, spec: dict[str, Any], options: dict[str, Any]) -> str | None:
    """``refit_init`` on this worker; its error text, or None. (Every worker raises a refused setup; vLLM's
    multiprocess executor would read the first error only and leave the others' replies for its next call.)"""
    try:
        worker.refit_init(rendezvous, lora=spec, options=options)
    except Exception as exc:  # noqa: BLE001 - the test reads it
        return f"{type(exc).__name__}: {exc}"
    return None


def _count_adapter_loads(worker: Any) -> None:
    """Count the calls of vLLM's adapter loader (``add_lora`` reads an adapter folder through it)."""
    count_calls(worker.model_runner.lora_manager, "_load_adapter")


def _adapter_loads(worker: Any) -> int:
    return worker.model_runner.lora_manager._refit_test_calls


def scenario_lora(model: str = "tiny-llama", tp: int = 1) -> dict[str, Any]:
    """Two refits of a PEFT adapter into the engine's LoRA slots, each checked against HF + PEFT and against
    vLLM's own loader; then the refusals at setup."""
    from scenarios import _engine_env

    _engine_env(tp)
    from refit_vllm.demo import engine_kwargs, prompts_for
    from refit_vllm.extension import EXTENSION
    from refit_vllm.lora import lora_request
    from refit_vllm.reference import hf_greedy_model, reference_dir
    from vllm import LLM, SamplingParams
    from vllm.config import WeightTransferConfig
    from vllm.lora.request import LoRARequest

    from refit_core.kit.launch import free_port

    cfg = tiny_config(model)
    prompts = prompts_for(cfg)
    tmp = scratch_dir()
    base_dir = str(reference_dir(cfg, SEED, 0, os.path.join(tmp, "base")))
    result: dict[str, Any] = {"steps": []}
    began = time.perf_counter()
    llm = LLM(model=base_dir, **engine_kwargs(cfg, tp, worker_extension_cls=EXTENSION, enable_lora=True,
                                             max_lora_rank=8, max_loras=2,
                                             weight_transfer_config=WeightTransferConfig(backend="refit")))
    result["build_s"] = time.perf_counter() - began
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)

    def generate(lora: Any = None) -> tuple[list[list[int]], list[str]]:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=lora)
        versions = sorted({s.version for o in outs for s in o.outputs[0].weight_versions or []})
        return [list(o.outputs[0].token_ids) for o in outs], versions

    hf = peft_model(cfg, base_dir, SPEC)
    base_tokens = generate()[0]
    steps = [1, 2]
    rendezvous = f"127.0.0.1:{free_port()}"
    trainers = Trainers(train_adapter, 1, cfg, SPEC, rendezvous, steps, {})
    began = time.perf_counter()
    llm.collective_rpc(_count_adapter_loads)
    llm.init_weight_transfer_engine({"init_info": {"rendezvous": rendezvous, "lora": SPEC}})
    result["setup_s"] = time.perf_counter() - began
    for step in steps:
        began = time.perf_counter()
        llm.start_weight_update()
        llm.update_weights({"update_info": {"version": step}})
        llm.finish_weight_update(weight_version=str(step))
        llm.reset_prefix_cache()
        seconds = time.perf_counter() - began
        versions = [s["version"] for s in llm.collective_rpc("refit_step_stats")]
        got, output_versions = generate(lora_request("policy"))
        set_adapter(hf, adapter_values(hf, step))
        want = hf_greedy_model(hf, prompts, NEW_TOKENS)
        adapter_dir = os.path.join(tmp, f"adapter{step}")
        hf.save_pretrained(adapter_dir)
        llm.llm_engine.add_lora(LoRARequest("reference", REFERENCE_ID, adapter_dir))
        slots = llm.collective_rpc(_slots, args=(["policy", "reference"],))
        llm.llm_engine.remove_lora(REFERENCE_ID)
        result["steps"].append({
            "step": step, "seconds": seconds, "equal": got == want, "got": got, "want": want,
            "received_versions": versions, "output_versions": output_versions,
            "adapter_versions": llm.collective_rpc("refit_adapter_versions"), "slots": slots,
            "stats": llm.collective_rpc("refit_step_stats"),
            "differs_from_base": got != base_tokens,
        })
    error = trainers.join()
    result["trainer_error"] = None if error is None else str(error)
    result["base_unchanged"] = generate()[0] == base_tokens

    result["adapter_loads"] = llm.collective_rpc(_adapter_loads)  # the two reference adapters only

    # refused at setup, before any byte moves, on the engine and the trainer
    wide = {**SPEC, "rank": 16, "alpha": 32.0, "name": "wide"}
    result["rank"] = _refused_session(llm, cfg, wide, wide)
    alien = {**SPEC, "targets": ["q_proj", "w_pack"], "name": "alien"}
    result["targets"] = _refused_session(llm, cfg, alien, SPEC)
    result["dtype"] = _refused_session(llm, cfg, SPEC, SPEC, {"cast": "strict"}, "bfloat16")
    result["after_refusals_equal"] = generate(lora_request("policy"))[0] == result["steps"][-1]["got"]
    from refit_vllm.lora_layout import adapter_destination_layout

    from refit_core import LoraSpec, ParallelLayout

    live = llm.collective_rpc(_adapter_rows)
    planned = [_rows(adapter_destination_layout(cfg, LoraSpec(**SPEC), ParallelLayout(tp=tp), rank)) for rank in
               range(tp)]
    result["layout_equal"] = [a == b for a, b in zip(live, planned)]
    result["layout_diff"] = [sorted(set(a) ^ set(b))[:4] for a, b in zip(live, planned)]
    result["abort"] = llm.collective_rpc(_abort_restores)
    result["after_abort_equal"] = generate(lora_request("policy"))[0] == result["steps"][-1]["got"]
    result["second"] = llm.collective_rpc(_register, args=({**SPEC, "name": "second"},))
    result["third"] = llm.collective_rpc(_register, args=({**SPEC, "name": "third"},))
    llm.llm_engine.engine_core.shutdown()
    return result
