"""``refit demo`` program of the vllm backend: a real vLLM engine, refit through vLLM's own API.

The engine starts from a tiny HF model directory written from ``ctx.config`` (weights of a step
the trainer never sends), with ``WeightTransferConfig(backend="refit")`` and tensor parallelism
``ctx.layout.tp``. It joins the refit with ``init_weight_transfer_engine``, then for every step
``start_weight_update`` / ``update_weights`` / ``finish_weight_update(weight_version=...)`` and a
prefix-cache reset, and checks the result the way a user would: greedy generation equals HF
transformers' generation with ``reference_state_dict(config, seed, step)``, token for token, and
request outputs carry the new weight version. The reference weights follow the model's checkpoint
inventory (``ctx.specs``), so any architecture vLLM and transformers both build works; the build and
every step are reported to ``ctx.progress``.
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any

from refit_core import PluginError
from refit_core.apps import DemoContext, DemoReport

NEW_TOKENS = 16
INITIAL_STEP = -1  # the engine's starting weights: a step the trainer never sends

CPU_ENV = {"VLLM_HOST_IP": "127.0.0.1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
           "VLLM_CPU_KVCACHE_SPACE": "1"}


def engine_env(tp: int, device: str) -> None:
    """Environment a vLLM engine needs on this machine (set before vLLM is imported)."""
    for key, value in CPU_ENV.items():
        os.environ.setdefault(key, value)
    if device != "cpu":
        return
    if tp == 1:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    else:
        cores = sorted(os.sched_getaffinity(0))
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(cores[i % len(cores)]) for i in range(tp)))


def engine_kwargs(config: dict[str, Any], tp: int, **extra: Any) -> dict[str, Any]:
    """``LLM`` / ``AsyncEngineArgs`` arguments for a tiny checkpoint: eager, no tokenizer, small cache.

    An MLA model (DeepSeek-style, ``kv_lora_rank``) in float32 on a CPU runs vLLM's reference CPU MLA
    backend: on a CPU with AMX tiles vLLM would pick its AMX backend, which packs only 16-bit weights."""
    import torch

    from refit_core.kit import config_dtype

    dtype = config_dtype(config)
    kwargs: dict[str, Any] = {
        "skip_tokenizer_init": True, "enforce_eager": True, "dtype": str(dtype).removeprefix("torch."),
        "max_model_len": min(256, int(config.get("max_position_embeddings", 256))), "max_num_seqs": 8,
        "tensor_parallel_size": tp, "distributed_executor_backend": "uni" if tp == 1 else "mp"}
    if config.get("kv_lora_rank") and dtype == torch.float32 and not torch.cuda.is_available():
        kwargs["attention_config"] = {"backend": "CPU_MLA"}
    return {**kwargs, **extra}


def prompts_for(config: dict[str, Any]) -> list[list[int]]:
    from .reference import DEFAULT_PROMPTS

    return [[t % config["vocab_size"] for t in p] for p in DEFAULT_PROMPTS]


def demo_gen(ctx: DemoContext) -> DemoReport:
    """Receive ``ctx.steps`` versions into a vLLM engine and verify each by generation."""
    layout = ctx.layout
    if layout.world_size != layout.tp or layout.ep != 1:
        raise PluginError(f"the vllm demo runs one engine with tensor parallelism only; got {layout}")
    tp = layout.tp
    from .reference import hf_greedy, reference_dir

    prompts = prompts_for(ctx.config)
    specs = list(ctx.specs) or None
    problems, seconds, received = [], [], 0
    workers = f"tp={tp}, {tp} workers" if tp > 1 else "one worker"
    with tempfile.TemporaryDirectory(prefix="refit-vllm-demo-") as tmp:
        start = time.perf_counter()
        # HF's generations first, before vLLM is imported: vLLM patches some transformers model
        # classes (OLMo2's, for one) in the process that builds an engine.
        wanted = [hf_greedy(reference_dir(ctx.config, ctx.seed, step, os.path.join(tmp, f"step{step}"), specs),
                            prompts, NEW_TOKENS) for step in range(ctx.steps)]
        ctx.progress.built(f"HF transformers reference generations for {ctx.steps} steps", time.perf_counter() - start)
        engine_env(tp, ctx.device)
        from vllm import LLM, SamplingParams
        from vllm.config import WeightTransferConfig

        from .extension import EXTENSION

        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        model_dir = reference_dir(ctx.config, ctx.seed, INITIAL_STEP, os.path.join(tmp, "initial"), specs)
        llm = LLM(model=str(model_dir), **engine_kwargs(ctx.config, tp, worker_extension_cls=EXTENSION,
                                                         weight_transfer_config=WeightTransferConfig(backend="refit")))
        ctx.progress.built(f"vllm engine, {workers}, {ctx.device}, WeightTransferConfig(backend='refit')",
                           time.perf_counter() - start)
        llm.init_weight_transfer_engine({"init_info": {"rendezvous": ctx.rendezvous, "options": dict(ctx.options)}})
        for step in range(ctx.steps):
            began = time.perf_counter()
            llm.start_weight_update()
            llm.update_weights({"update_info": {"version": step}})
            llm.finish_weight_update(weight_version=str(step))
            llm.reset_prefix_cache()
            seconds.append(time.perf_counter() - began)
            received = sum(s.get("bytes", 0) for s in llm.collective_rpc("refit_step_stats"))
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            got = [list(o.outputs[0].token_ids) for o in outputs]
            want = wanted[step]
            step_problems = []
            if got != want:
                step_problems.append(f"step {step}: vLLM generated {got[0]}..., HF transformers {want[0]}...")
            versions = {span.version for o in outputs for span in (o.outputs[0].weight_versions or [])}
            if versions != {str(step)}:
                step_problems.append(f"step {step}: outputs carry weight versions {sorted(versions)}")
            ctx.progress.step(step, received, seconds[-1], "generation == HF transformers, weight version "
                              f"{step}" if not step_problems else "MISMATCH")
            problems += step_problems
        llm.collective_rpc("shutdown_weight_transfer_engine")
        llm.llm_engine.engine_core.shutdown()
    lines = [(f"vLLM's greedy generation equals HF transformers' token for token after each of {ctx.steps} "
              "steps, and outputs carry the new weight version" if not problems
              else f"{len(problems)} MISMATCHES")]
    lines += problems
    return DemoReport(not problems, lines, bytes_per_step=received, seconds_per_step=seconds)


__all__ = ["demo_gen", "engine_env", "engine_kwargs", "prompts_for"]
