"""Real-engine scenarios of the vLLM plugin tests, each run in a fresh process.

``python tests/vllm/scenarios.py NAME '{"json": "args"}'`` prints ``RESULT {...}`` as its last line.
A fresh process per scenario keeps vLLM's process-global state (environment cache, plugin and
distributed state) from leaking between engines. The train side is always the dtensor plugin:
FSDP2 over 2 spawned CPU ranks (gloo), fp32 master weights, ``reference_state_dict(config, 0, step)``.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

ENV = {"VLLM_HOST_IP": "127.0.0.1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
       "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false",
       "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}  # test-only worker probes go through collective_rpc
for _k, _v in ENV.items():
    os.environ.setdefault(_k, _v)

import torch  # noqa: E402

NEW_TOKENS = 12
SEED = 0


_SCRATCH_DIRS: list[str] = []


def scratch_dir() -> str:
    """A new temporary folder (checkpoints, addresses); the scenario's process removes it before it exits."""
    path = tempfile.mkdtemp(prefix="refit-vllm-test-")
    _SCRATCH_DIRS.append(path)
    return path


# -- configs ----------------------------------------------------------------------------------


def tiny_config(name: str) -> dict[str, Any]:
    """A preset, or a variant: ``tiny-qwen2`` (q/k/v biases), ``tiny-llama-mqa`` (one KV head and a
    vocabulary of 500, which vLLM pads to 512), ``tiny-qwen3-tied-v500`` (tied, padded vocabulary)."""
    from refit_core.kit.models import PRESETS

    if name == "tiny-qwen2":
        cfg = dict(PRESETS["tiny-qwen3"], architectures=["Qwen2ForCausalLM"], model_type="qwen2")
    elif name == "tiny-llama-mqa":
        cfg = dict(PRESETS["tiny-llama"], num_key_value_heads=1, vocab_size=500)
    elif name == "tiny-qwen3-tied-v500":
        cfg = dict(PRESETS["tiny-qwen3-tied"], vocab_size=500)
    else:
        cfg = dict(PRESETS[name])
    return cfg


# -- the train side ---------------------------------------------------------------------------


def _train_model(cfg: dict[str, Any], world: int, rank: int, port: int) -> torch.nn.Module:
    import torch.distributed as dist
    from refit_dtensor import build_model, init_mesh, shard_model

    from refit_core import ParallelLayout

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    layout = ParallelLayout(fsdp=world)
    model = build_model(cfg, dtype=torch.float32, device=torch.device("cpu"))
    shard_model(model, layout, init_mesh(layout, "cpu"))
    return model


def train_sender(rank: int, world: int, cfg: dict[str, Any], rendezvous: str, port: int, steps: list[int],
                 options: dict[str, Any], subsets: dict[int, list[str]] | None = None) -> None:
    """FSDP2 trainer rank with refit's own API: setup, then one send per step (of ``subsets[step]``
    only, where given)."""
    import torch.distributed as dist
    from refit_dtensor import load_hf_weights

    from refit_core import RefitOptions, RefitSender
    from refit_core.kit.models import reference_state_dict

    model = _train_model(cfg, world, rank, port)
    sender = RefitSender(model, rendezvous=rendezvous, rank=rank, world_size=world, options=RefitOptions(**options))
    try:
        sender.setup()
        for step in steps:
            load_hf_weights(model, reference_state_dict(cfg, SEED, step))
            sender.send(version=step, only=(subsets or {}).get(step))
    finally:
        sender.close()
        dist.destroy_process_group()


def train_then_die(rank: int, world: int, cfg: dict[str, Any], rendezvous: str, port: int) -> None:
    """Set up, then die in the middle of the first step (before sending a byte)."""
    from refit_core import RefitSender

    model = _train_model(cfg, world, rank, port)
    sender = RefitSender(model, rendezvous=rendezvous, rank=rank, world_size=world)
    sender.setup()
    time.sleep(1.0)
    os._exit(3)


def train_engine(rank: int, world: int, cfg: dict[str, Any], rendezvous: str, port: int, steps: list[int],
                 conn: Any, gate: Any, subsets: dict[int, list[str]] | None = None) -> None:
    """FSDP2 trainer rank through vLLM's trainer-side API, registered as backend ``refit`` (sending
    ``subsets[step]`` only, where given)."""
    import torch.distributed as dist
    from refit_dtensor import load_hf_weights
    from refit_vllm.transfer import RefitSource, RefitTrainerInitInfo
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    from refit_core.kit.models import reference_state_dict

    model = _train_model(cfg, world, rank, port)
    client = ProxyClient(conn)
    engine = WeightTransferTrainerFactory.trainer_init(
        RefitTrainerInitInfo(rank=rank, rendezvous=rendezvous, world_size=world), client=client,
        source=RefitSource(model))
    for step in steps:
        if not gate.wait(timeout=300):
            raise TimeoutError("the test never opened the gate")
        load_hf_weights(model, reference_state_dict(cfg, SEED, step))
        engine.send_weights(version=step, names=(subsets or {}).get(step))
    engine.shutdown()
    dist.destroy_process_group()


class Trainers:
    """``spawn`` of the train ranks on a background thread; ``join`` re-raises their failure."""

    def __init__(self, fn: Any, world: int, *args: Any) -> None:
        from refit_core.kit.launch import spawn

        self.error: BaseException | None = None

        def run() -> None:
            try:
                spawn(fn, world, *args, timeout_s=400)
            except BaseException as exc:  # noqa: BLE001 - reported by join
                self.error = exc

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def join(self, timeout: float = 400) -> BaseException | None:
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise TimeoutError("train ranks did not finish")
        return self.error


class ProxyClient:
    """A ``VLLMWeightSyncClient`` in a trainer process: calls run in the engine's process (``serve``)."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        self.conn.send((method, args, kwargs))
        ok, value = self.conn.recv()
        if not ok:
            raise RuntimeError(f"engine side {method} failed: {value}")
        return value

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._call("init_weight_transfer_engine", init_info)

    def start_weight_update(self) -> None:
        self._call("start_weight_update")

    def update_weights(self, update_info: Any) -> None:
        self._call("update_weights", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._call("finish_weight_update", weight_version=weight_version)


def serve(client: Any, conn: Any, log: list[str], done: threading.Event) -> None:
    """Run a trainer's proxied client calls on ``client`` until the trainer hangs up."""
    while True:
        try:
            method, args, kwargs = conn.recv()
        except EOFError:
            return
        try:
            value = getattr(client, method)(*args, **kwargs)
            conn.send((True, value))
        except BaseException as exc:  # noqa: BLE001 - sent back to the trainer
            conn.send((False, f"{type(exc).__name__}: {exc}"))
        log.append(method)
        if method == "finish_weight_update":
            done.set()


# -- the gen side -----------------------------------------------------------------------------


def _engine_env(tp: int) -> None:
    if tp == 1:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    else:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i % os.cpu_count()) for i in range(tp))


def hf_tokens(cfg: dict[str, Any], step: int, prompts: list[list[int]], tmp: str) -> list[list[int]]:
    from refit_vllm.reference import hf_greedy, reference_dir

    return hf_greedy(reference_dir(cfg, SEED, step, os.path.join(tmp, f"hf{step}")), prompts, NEW_TOKENS)


def count_calls(owner: Any, method: str) -> None:
    """Wrap ``owner``'s ``method`` so that ``owner._refit_test_calls`` counts its calls."""
    original = getattr(owner, method)
    owner._refit_test_calls = 0

    def counted(*args: Any, **kwargs: Any) -> Any:
        owner._refit_test_calls += 1
        return original(*args, **kwargs)

    setattr(owner, method, counted)


def _count_load_weights(worker: Any) -> None:
    count_calls(worker.model_runner.get_model(), "load_weights")


def _load_weights_calls(worker: Any) -> int:
    return worker.model_runner.get_model()._refit_test_calls


def _replanned_metas(worker: Any) -> list[Any]:
    """The destination map a new refit session would plan now, after the engine took refit steps."""
    from refit_vllm.state import attach, state_of

    model = worker.model_runner.get_model()
    plan = state_of(model).plan
    attach(model, worker.vllm_config, loader=state_of(model).loader_patterns)
    rows = worker.refit_destination_metas()
    state_of(model).plan = plan
    return rows


def _plan_summary(worker: Any) -> dict[str, Any]:
    from refit_vllm.state import state_of

    state = state_of(worker.model_runner.get_model())
    plan = state.plan
    return {"loader": [s.name for s in plan.loader], "pieces": len(plan.pieces), "mode": state.mode,
            "loader_modules": sorted(plan.loader_reasons)}


def _split_then_recover(llm: Any, cfg: dict[str, Any], torn_rank: int, tokens: Callable[[], list[list[int]]],
                        want: Callable[[int], list[list[int]]]) -> dict[str, Any]:
    """A step (version 3) that lands on every worker but ``torn_rank``, whose loader fails: the engine
    must refuse on every worker, naming both versions; then a new session's step (4) must lift it."""
    from refit_core.kit.launch import free_port

    out: dict[str, Any] = {}
    options = {"timeout_s": 60}
    rendezvous = f"127.0.0.1:{free_port()}"
    trainers = Trainers(train_sender, 2, cfg, rendezvous, free_port(), [3], options)
    llm.init_weight_transfer_engine({"init_info": {"rendezvous": rendezvous, "options": options,
                                                   "loader": [r"layers\.1\.self_attn\.q_proj"]}})
    llm.collective_rpc(_fail_next_load_weights, kwargs={"rank": torn_rank})
    llm.start_weight_update()
    out["step_error"] = _error_text(lambda: llm.update_weights({"update_info": {"version": 3}}))
    trainers.join()
    out["states"] = llm.collective_rpc("refit_rank_state")
    out["refusals"] = llm.collective_rpc("refit_refusal")
    from refit_vllm.serving import check_serving

    out["check_serving_error"] = _error_text(lambda: check_serving(llm))
    out["generate_error"] = _error_text(tokens)
    out["alive_after_refusal"] = _error_text(lambda: llm.collective_rpc("refit_rank_state")) is None
    if not out["alive_after_refusal"]:
        return out
    _abort_requests(llm)
    rendezvous = f"127.0.0.1:{free_port()}"
    trainers = Trainers(train_sender, 2, cfg, rendezvous, free_port(), [4], options)
    llm.init_weight_transfer_engine({"init_info": {"rendezvous": rendezvous, "options": options}})
    llm.start_weight_update()
    llm.update_weights({"update_info": {"version": 4}})
    llm.finish_weight_update(weight_version="4")
    llm.reset_prefix_cache()
    error = trainers.join()
    out["recovery_trainer_error"] = None if error is None else str(error)
    out["states_after_recovery"] = llm.collective_rpc("refit_rank_state")
    out["recovered_equal_hf"] = tokens() == want(4)
    return out


def scenario_refit(model: str, tp: int = 1, route: str = "weight_transfer", loader: list[str] | None = None,
                   steps: list[int] | None = None, torn_rank: int | None = None) -> dict[str, Any]:
    """FSDP2 (2 ranks) -> vLLM (``tp`` workers): after each refit, vLLM's greedy tokens vs HF's; then,
    with ``torn_rank``, a step that lands on every worker but that one, and the recovery. The train
    ranks start before the engine does (their imports overlap its build)."""
    from refit_core.kit.launch import free_port

    cfg = tiny_config(model)
    rendezvous = f"127.0.0.1:{free_port()}"
    trainers = Trainers(train_sender, 2, cfg, rendezvous, free_port(), steps or [1, 2], {})
    start = time.perf_counter()
    engine = _refit_engine(cfg, tp)
    build_s = time.perf_counter() - start
    result = {"build_s": build_s, **refit_steps(engine, tp, route, loader, steps, torn_rank,
                                                trainers=(trainers, rendezvous))}
    engine.llm.llm_engine.engine_core.shutdown()
    return result


def refit_steps(engine: Engine, tp: int = 1, route: str = "weight_transfer", loader: list[str] | None = None,
                steps: list[int] | None = None, torn_rank: int | None = None, held: int = 0,
                trainers: tuple[Trainers, str] | None = None) -> dict[str, Any]:
    """One refit session of :func:`scenario_refit` into ``engine``, which holds step ``held``'s weights
    (``trainers``: train ranks already started for these steps, and their rendezvous)."""
    from refit_vllm.layout import destination_layout

    from refit_core import ParallelLayout
    from refit_core.kit.launch import free_port

    steps = steps or [1, 2]
    llm, cfg, prompts, tmp, generate = engine.llm, engine.cfg, engine.prompts, engine.tmp, engine.outputs
    result: dict[str, Any] = {"steps": []}
    result["initial_equal"] = engine.tokens() == hf_tokens(cfg, held, prompts, tmp)
    if trainers is None:
        rendezvous = f"127.0.0.1:{free_port()}"
        trainers = (Trainers(train_sender, 2, cfg, rendezvous, free_port(), steps, {}), rendezvous)
    ranks, rendezvous = trainers
    start = time.perf_counter()
    if route == "weight_transfer":
        llm.init_weight_transfer_engine({"init_info": {"rendezvous": rendezvous, "loader": loader or []}})
    else:
        result["ranks"] = llm.collective_rpc("refit_init", args=(rendezvous,), kwargs={"loader": loader or []})
    result["setup_s"] = time.perf_counter() - start
    live = llm.collective_rpc("refit_destination_metas")
    result["layout_equal"] = [
        {tuple(map(lambda x: tuple(x) if isinstance(x, list) else x, row)) for row in rows}
        == {(p.spec.name, p.spec.shape, str(p.spec.dtype), p.box.offsets, p.box.sizes)
            for p in destination_layout(cfg, ParallelLayout(tp=tp), rank).pieces}
        for rank, rows in enumerate(live)]
    result["plan"] = llm.collective_rpc(_plan_summary)
    llm.collective_rpc(_count_load_weights)
    for step in steps:
        began = time.perf_counter()
        if route == "weight_transfer":
            llm.start_weight_update()
            llm.update_weights({"update_info": {"version": step}})
            llm.finish_weight_update(weight_version=str(step))
            versions = [step] * tp
        else:
            versions = llm.collective_rpc("refit_receive", kwargs={"version": step})
            llm.update_weight_version(str(step))
        llm.reset_prefix_cache()
        seconds = time.perf_counter() - began
        outputs = generate()
        got = [list(o.outputs[0].token_ids) for o in outputs]
        want = hf_tokens(cfg, step, prompts, tmp)
        result["steps"].append({
            "step": step, "seconds": seconds, "equal": got == want, "got": got[0], "want": want[0],
            "received_versions": versions, "engine_version": llm.get_weight_version(),
            "worker_versions": llm.collective_rpc("refit_weight_version"),
            "output_versions": sorted({s.version for o in outputs for s in o.outputs[0].weight_versions or []}),
        })
    result["load_weights_calls_during_steps"] = llm.collective_rpc(_load_weights_calls)
    replanned = llm.collective_rpc(_replanned_metas)
    result["replanned_equal"] = [a == b for a, b in zip(replanned, llm.collective_rpc("refit_destination_metas"))]
    error = ranks.join()
    result["trainer_error"] = None if error is None else str(error)
    if torn_rank is not None:
        result["split"] = _split_then_recover(llm, cfg, torn_rank, engine.tokens,
                                              lambda step: hf_tokens(cfg, step, prompts, tmp))
    return result


@dataclass(frozen=True)
class Engine:
    """A vLLM engine with refit as its weight-transfer backend (and refit's worker extension), built on
    the step-0 reference weights of ``cfg``, with the prompts its checks generate from."""

    llm: Any
    cfg: dict[str, Any]
    prompts: list[list[int]]
    tmp: str

    def outputs(self) -> list[Any]:
        """vLLM's request outputs, greedy, one per prompt."""
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        return self.llm.generate([{"prompt_token_ids": p} for p in self.prompts], params, use_tqdm=False)

    def tokens(self) -> list[list[int]]:
        """Greedy tokens per prompt."""
        return [list(o.outputs[0].token_ids) for o in self.outputs()]


def _refit_engine(cfg: dict[str, Any], tp: int = 1) -> Engine:
    """A ``tp``-worker :class:`Engine` of ``cfg``."""
    _engine_env(tp)
    from refit_vllm.demo import engine_kwargs, prompts_for
    from refit_vllm.extension import EXTENSION
    from refit_vllm.reference import reference_dir
    from vllm import LLM
    from vllm.config import WeightTransferConfig

    tmp = scratch_dir()
    llm = LLM(model=str(reference_dir(cfg, SEED, 0, os.path.join(tmp, "initial"))),
              **engine_kwargs(cfg, tp, weight_transfer_config=WeightTransferConfig(backend="refit"),
                              worker_extension_cls=EXTENSION))
    return Engine(llm, cfg, prompts_for(cfg), tmp)


def scenario_mismatch_then_subset(engine_model: str, train_model: str) -> dict[str, Any]:
    """One engine of ``engine_model`` (one engine start for two scenarios): :func:`mismatched_setup`,
    then, on the weights that failed setup left, :func:`subset_then_whole`."""
    engine = _refit_engine(tiny_config(engine_model))
    llm, cfg, prompts, tmp, generate = engine.llm, engine.cfg, engine.prompts, engine.tmp, engine.tokens
    result = {"mismatch": mismatched_setup(llm, cfg, prompts, tmp, generate, train_model),
              "subset": subset_then_whole(llm, cfg, prompts, tmp, generate)}
    llm.llm_engine.engine_core.shutdown()
    return result


def mismatched_setup(llm: Any, cfg: dict[str, Any], prompts: list[list[int]], tmp: str,
                     generate: Callable[[], list[list[int]]], train_model: str) -> dict[str, Any]:
    """A trainer whose model does not match the engine's: setup fails, the engine keeps serving."""
    from refit_core.kit.launch import free_port

    before = generate()
    rendezvous = f"127.0.0.1:{free_port()}"
    trainers = Trainers(train_sender, 2, tiny_config(train_model), rendezvous, free_port(), [1],
                        {"timeout_s": 60})
    result: dict[str, Any] = {"engine_error": None}
    start = time.perf_counter()
    try:
        llm.init_weight_transfer_engine({"init_info": {"rendezvous": rendezvous, "options": {"timeout_s": 60}}})
    except Exception as exc:  # noqa: BLE001 - the expected outcome
        result["engine_error"] = f"{type(exc).__name__}: {exc}"
    result["fail_s"] = time.perf_counter() - start
    error = trainers.join()
    result["trainer_error"] = None if error is None else str(error)
    after = generate()
    result["still_generates"] = after == before
    result["matches_hf_initial"] = after == hf_tokens(cfg, 0, prompts, tmp)
    return result


def _fail_next_load_weights(worker: Any, rank: int | None = None) -> None:
    """The model's next ``load_weights`` call raises (vLLM's own loader refusing the loader path's
    tensors), on worker ``rank`` only if given."""
    if rank is not None and worker.rank != rank:
        return
    model = worker.model_runner.get_model()
    original = model.load_weights

    def failing(*args: Any, **kwargs: Any) -> Any:
        model.load_weights = original
        raise RuntimeError("test: vLLM's loader refused the weights")

    model.load_weights = failing


def _abort_requests(llm: Any) -> None:
    """Drop the requests a refused generate left in the engine (their scheduled step never ran)."""
    llm.llm_engine.abort_request(list(llm.llm_engine.output_processor.request_states), internal=True)


def _error_text(call: Callable[[], Any]) -> str | None:
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the test reads it
        return f"{type(exc).__name__}: {exc}"
    return None


def nccl_update_info(cfg: dict[str, Any], version: int, wrong_shape: str | None = None) -> dict[str, Any]:
    """vLLM's ``nccl``-style update info naming every HF tensor the trainers send (their fp32 masters),
    with tensor ``wrong_shape``'s first dimension one too large if given."""
    from refit_core.kit.models import reference_state_dict

    tensors = reference_state_dict(cfg, SEED, 0)
    shapes = [[n + (name == wrong_shape and i == 0) for i, n in enumerate(t.shape)] for name, t in tensors.items()]
    return {"version": version, "names": list(tensors), "dtype_names": ["float32"] * len(tensors), "shapes": shapes}


def scenario_abort_then_loader(model: str, loader: list[str]) -> dict[str, Any]:
    """One engine for two scenarios (an engine start and its process for both): :func:`failed_steps`,
    which leaves the engine serving version 2, then :func:`refit_steps` with ``loader`` (steps 3, 4)."""
    engine = _refit_engine(tiny_config(model))
    result = {"abort": _part(lambda: failed_steps(engine)),
              "loader": _part(lambda: refit_steps(engine, loader=loader, steps=[3, 4], held=2))}
    engine.llm.llm_engine.engine_core.shutdown()
    return result


def _part(run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``run()``'s result, or its traceback as ``scenario_error`` (the other parts still run)."""
    try:
        return run()
    except Exception:  # noqa: BLE001 - reported to the part's test
        return {"scenario_error": traceback.format_exc()}


def failed_steps(engine: Engine) -> dict[str, Any]:
    """On ``engine`` (step 0's weights, never refitted): a step whose nccl-style update info gives one
    tensor a wrong shape, refused before any byte lands, on every rank. The trainers die after setup:
    the step fails, and the engine keeps its previous weights. Then a step that tears weights (vLLM's
    loader fails on the loader path): the engine refuses to serve, naming its ranks' versions, until a
    new session's step (nccl-style update info naming every tensor) lands, after which it generates
    HF's tokens (version 2)."""
    from refit_core.kit.launch import free_port

    llm, cfg, prompts, tmp, generate = engine.llm, engine.cfg, engine.prompts, engine.tmp, engine.tokens
    before = generate()
    result: dict[str, Any] = {}
    rendezvous = f"127.0.0.1:{free_port()}"
    trainers = Trainers(train_sender, 2, cfg, rendezvous, free_port(), [1], {"timeout_s": 30})
    llm.init_weight_transfer_engine({"init_info": {"rendezvous": rendezvous, "options": {"timeout_s": 30}}})
    start = time.perf_counter()
    llm.start_weight_update()
    result["names_error"] = _error_text(lambda: llm.update_weights(
        {"update_info": nccl_update_info(cfg, 1, wrong_shape="model.norm.weight")}))
    result["names_engine_s"] = time.perf_counter() - start
    error = trainers.join()
    result["names_trainer_s"] = time.perf_counter() - start
    result["names_trainer_error"] = None if error is None else str(error)
    result["names_same_tokens_after"] = generate() == before

    rendezvous = f"127.0.0.1:{free_port()}"
    trainers = Trainers(train_then_die, 2, cfg, rendezvous, free_port())
    llm.init_weight_transfer_engine({"init_info": {"rendezvous": rendezvous, "options": {"timeout_s": 30}}})
    result["step_error"] = None
    start = time.perf_counter()
    llm.start_weight_update()
    try:
        llm.update_weights({"update_info": {"version": 1}})
    except Exception as exc:  # noqa: BLE001 - the expected outcome
        result["step_error"] = f"{type(exc).__name__}: {exc}"
    result["fail_s"] = time.perf_counter() - start
    trainers.join()
    llm.reset_prefix_cache()
    result["same_tokens_after"] = generate() == before
    result["engine_version"] = llm.get_weight_version()
    result["states_after_clean_failure"] = llm.collective_rpc("refit_rank_state")

    options = {"timeout_s": 60}
    rendezvous = f"127.0.0.1:{free_port()}"
    trainers = Trainers(train_sender, 2, cfg, rendezvous, free_port(), [1], options)
    llm.init_weight_transfer_engine({"init_info": {"rendezvous": rendezvous, "options": options,
                                                   "loader": [r"layers\.1\.self_attn\.q_proj"]}})
    llm.collective_rpc(_fail_next_load_weights)
    llm.start_weight_update()
    result["torn_step_error"] = _error_text(lambda: llm.update_weights({"update_info": {"version": 1}}))
    trainers.join()
    result["states_after_torn_step"] = llm.collective_rpc("refit_rank_state")
    result["refusals"] = llm.collective_rpc("refit_refusal")
    result["generate_error"] = _error_text(generate)
    _abort_requests(llm)

    rendezvous = f"127.0.0.1:{free_port()}"
    trainers = Trainers(train_sender, 2, cfg, rendezvous, free_port(), [2], options)
    llm.init_weight_transfer_engine({"init_info": {"rendezvous": rendezvous, "options": options}})
    result["states_in_new_session"] = llm.collective_rpc("refit_rank_state")
    result["still_refuses_in_new_session"] = _error_text(generate) is not None
    _abort_requests(llm)
    llm.start_weight_update()
    llm.update_weights({"update_info": nccl_update_info(cfg, 2)})
    llm.finish_weight_update(weight_version="2")
    llm.reset_prefix_cache()
    error = trainers.join()
    result["recovery_trainer_error"] = None if error is None else str(error)
    result["states_after_recovery"] = llm.collective_rpc("refit_rank_state")
    result["recovered_equal_hf"] = generate() == hf_tokens(cfg, 2, prompts, tmp)
    result["version_after_recovery"] = llm.get_weight_version()
    return result


SUBSET_READ = ("model.norm.weight", "model.layers.0.input_layernorm.weight", "model.layers.1.input_layernorm.weight",
               "model.layers.0.post_attention_layernorm.weight", "model.layers.0.self_attn.q_norm.weight")
"""Tensors vLLM keeps as loaded after post-processing on CPU (norms): the scenario reads their bytes."""


def _read_tensors(worker: Any, names: list[str]) -> dict[str, torch.Tensor]:
    """Copies of the worker's parameters ``names``."""
    params = dict(worker.model_runner.get_model().named_parameters())
    return {n: params[n].detach().cpu().clone() for n in names}


def _which_version(held: dict[str, torch.Tensor], cfg: dict[str, Any], steps: tuple[int, int]) -> dict[str, Any]:
    """Per tensor, which of the two steps' reference weights it holds bitwise (None: neither)."""
    from refit_core.apps import same_bytes
    from refit_core.kit.models import reference_state_dict

    refs = {step: reference_state_dict(cfg, SEED, step) for step in steps}
    return {n: next((step for step in steps if same_bytes(t, refs[step][n].to(t.dtype))), None)
            for n, t in held.items()}


def subset_then_whole(llm: Any, cfg: dict[str, Any], prompts: list[list[int]], tmp: str,
                      generate: Callable[[], list[list[int]]]) -> dict[str, Any]:
    """One session, two steps, into an engine holding step 0's weights: step 1 names a subset in
    vLLM's nccl-style update info (the trainers send the same with ``send(only=...)``): two fused
    groups (layer 0's q/k/v, layer 1's gate/up) and two norms. Step 2 is whole. After each: the
    norms' bytes as vLLM holds them, and greedy tokens against HF transformers with the weights the
    engine should hold (step 1: the subset's tensors from step 1, the rest from step 0)."""
    from refit_vllm.reference import hf_greedy, write_model_dir

    from refit_core.kit.launch import free_port
    from refit_core.kit.models import reference_state_dict

    subset = ["model.norm.weight", "model.layers.0.input_layernorm.weight",
              *(f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"),
              *(f"model.layers.1.mlp.{p}_proj.weight" for p in ("gate", "up"))]
    options = {"timeout_s": 60}
    rendezvous = f"127.0.0.1:{free_port()}"
    trainers = Trainers(train_sender, 2, cfg, rendezvous, free_port(), [1, 2], options, {1: subset})
    llm.init_weight_transfer_engine({"init_info": {"rendezvous": rendezvous, "options": options}})
    full = nccl_update_info(cfg, 1)
    picked = [i for i, n in enumerate(full["names"]) if n in subset]
    info = {"version": 1, **{k: [full[k][i] for i in picked] for k in ("names", "dtype_names", "shapes")}}
    result: dict[str, Any] = {}
    start = time.perf_counter()
    llm.start_weight_update()
    llm.update_weights({"update_info": info})
    llm.finish_weight_update(weight_version="1")
    llm.reset_prefix_cache()
    result["subset_step_s"] = time.perf_counter() - start
    result["read_after_subset"] = _which_version(llm.collective_rpc(_read_tensors, args=(list(SUBSET_READ),))[0],
                                                 cfg, (0, 1))
    held = {**reference_state_dict(cfg, SEED, 0), **{n: reference_state_dict(cfg, SEED, 1)[n] for n in subset}}
    want = hf_greedy(write_model_dir(cfg, held, os.path.join(tmp, "mixed")), prompts, NEW_TOKENS)
    result["subset_tokens_equal_hf"] = generate() == want
    result["subset_tokens_differ_from_step_0"] = want != hf_tokens(cfg, 0, prompts, tmp)
    result["version_after_subset"] = llm.get_weight_version()
    llm.start_weight_update()
    llm.update_weights({"update_info": {"version": 2}})
    llm.finish_weight_update(weight_version="2")
    llm.reset_prefix_cache()
    error = trainers.join()
    result["trainer_error"] = None if error is None else str(error)
    result["read_after_whole"] = _which_version(llm.collective_rpc(_read_tensors, args=(list(SUBSET_READ),))[0],
                                                cfg, (1, 2))
    result["whole_tokens_equal_hf"] = generate() == hf_tokens(cfg, 2, prompts, tmp)
    result["version_after_whole"] = llm.get_weight_version()
    result["subset"] = subset
    return result


def scenario_inflight(model: str) -> dict[str, Any]:
    """AsyncLLM: a request in flight across pause(keep) -> refit (trainer-side API) -> resume."""
    _engine_env(1)
    return asyncio.run(_inflight(model))


async def _inflight(model: str) -> dict[str, Any]:
    from refit_vllm.clients import AsyncLLMClient
    from refit_vllm.demo import engine_kwargs, prompts_for
    from refit_vllm.reference import reference_dir
    from vllm import SamplingParams
    from vllm.config import WeightTransferConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from refit_core.kit.launch import free_port

    cfg = tiny_config(model)
    tmp = scratch_dir()
    args = AsyncEngineArgs(model=str(reference_dir(cfg, SEED, 0, os.path.join(tmp, "initial"))),
                           **engine_kwargs(cfg, 1, weight_transfer_config=WeightTransferConfig(backend="refit")))
    engine = AsyncLLM.from_engine_args(args)
    result: dict[str, Any] = {}
    try:
        await engine.update_weight_version("0")
        loop = asyncio.get_running_loop()
        spawn_ctx = mp.get_context("spawn")
        ours, theirs = spawn_ctx.Pipe()
        gate = spawn_ctx.Event()
        calls: list[str] = []
        finished = threading.Event()
        server = threading.Thread(target=serve, args=(AsyncLLMClient(engine, loop), ours, calls, finished),
                                  daemon=True)
        server.start()
        rendezvous = f"127.0.0.1:{free_port()}"
        trainers = Trainers(train_engine, 2, cfg, rendezvous, free_port(), [1], theirs, gate)
        while "init_weight_transfer_engine" not in calls:  # the trainer drives setup through its client
            await asyncio.sleep(0.05)
            if trainers.error is not None:
                raise trainers.error

        long_tokens = 48
        prompt = prompts_for(cfg)[0]
        params = SamplingParams(max_tokens=long_tokens, temperature=0.0, ignore_eos=True)
        seen: list[int] = []

        async def run_request() -> Any:
            final = None
            async for out in engine.generate({"prompt_token_ids": prompt}, params, request_id="inflight"):
                seen.append(len(out.outputs[0].token_ids))
                final = out
            return final

        task = asyncio.create_task(run_request())
        while not seen or seen[-1] < 6:
            await asyncio.sleep(0.005)
        await engine.pause_generation(mode="keep")
        result["tokens_at_pause"] = seen[-1]
        result["unfinished_at_pause"] = not task.done()
        gate.set()  # the trainers send version 1 now
        await loop.run_in_executor(None, finished.wait, 300)
        result["engine_version_after_refit"] = await engine.get_weight_version()
        await engine.resume_generation()
        final = await asyncio.wait_for(task, 300)
        completion = final.outputs[0]
        result["completed_tokens"] = len(completion.token_ids)
        result["spans"] = [(s.version, s.start, s.end) for s in completion.weight_versions or []]
        after = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        fresh = []
        for i, p in enumerate(prompts_for(cfg)):
            out = None
            async for out in engine.generate({"prompt_token_ids": p}, after, request_id=f"after{i}"):
                pass
            fresh.append(list(out.outputs[0].token_ids))
        result["after_equal_hf"] = fresh == hf_tokens(cfg, 1, prompts_for(cfg), tmp)
        result["client_calls"] = calls
        error = trainers.join()
        result["trainer_error"] = None if error is None else str(error)
    finally:
        engine.shutdown()
    return result


# -- the migration guide's blocks (docs/migration/vllm.md) ------------------------------------

DOCS_MODEL = "tiny-llama"


def train_docs(rank: int, world: int, cfg: dict[str, Any], rendezvous: list[str], port: int,
               block: dict[str, str], conn: Any, gate: Any) -> None:
    """A trainer rank of both refits of :func:`scenario_docs`: version 1 with refit's own API (for the
    engine block), then, once ``gate`` opens, the guide's trainer block (``block``: its ``code`` and
    ``where``) with version 2's weights; train rank 0's client drives the engine in the scenario's process."""
    import torch.distributed as dist
    from refit_dtensor import load_hf_weights
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    from refit_core import RefitSender
    from refit_core.kit.models import reference_state_dict

    model = _train_model(cfg, world, rank, port)
    load_hf_weights(model, reference_state_dict(cfg, SEED, 1))
    sender = RefitSender(model, rendezvous=rendezvous[0], rank=rank, world_size=world)
    sender.setup()
    sender.send(version=1)
    sender.close()
    load_hf_weights(model, reference_state_dict(cfg, SEED, 2))
    if not gate.wait(timeout=300):
        raise TimeoutError("the scenario never opened the gate")
    namespace = {"__name__": "__docs__", "WeightTransferTrainerFactory": WeightTransferTrainerFactory,
                 "rank": rank, "train_world": world, "rendezvous": rendezvous[1], "client": ProxyClient(conn),
                 "model": model, "step": 2}
    exec(compile(block["code"], block["where"], "exec"), namespace)
    namespace["engine"].shutdown()
    dist.destroy_process_group()


def _engine_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every weight the engine computes with: the state dict's tensors, and each linear layer's as it
    applies them, its output for the identity (vLLM on CPU repacks linear weights for oneDNN and
    empties their ``weight``)."""
    from vllm.model_executor.layers.linear import LinearBase

    tensors = {name: t.detach().clone() for name, t in model.state_dict().items() if t.numel()}
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, LinearBase):
                out = module(torch.eye(module.input_size_per_partition, dtype=module.params_dtype))
                tensors[f"{name}(identity)"] = (out[0] if isinstance(out, tuple) else out).clone()
    return tensors


def _reload_mismatches(worker: Any, cfg: dict[str, Any], step: int) -> list[str]:
    """The engine's weights (:func:`_engine_tensors`) that differ, bit for bit, from what vLLM's own
    reload then makes of the step's HF weights (the engine keeps the reloaded ones)."""
    from refit_core.apps import same_bytes
    from refit_core.kit.models import reference_state_dict

    model = worker.model_runner.get_model()
    held = _engine_tensors(model)
    worker.model_runner.reload_weights(weights_iterator=iter(reference_state_dict(cfg, SEED, step).items()))
    loaded = _engine_tensors(model)
    return sorted(name for name in held.keys() | loaded.keys()
                  if name not in held or name not in loaded or not same_bytes(held[name], loaded[name]))


def scenario_docs(engine_block: dict[str, str], trainer_block: dict[str, str]) -> dict[str, Any]:
    """The guide's "after" blocks on one engine, with one set of 2 FSDP2 train ranks (:func:`train_docs`).
    The engine block builds the engine (``LLM`` with this test's CPU settings) from the step-0
    checkpoint and receives version 1, sent with refit's own API; then the trainer block runs on the
    train ranks, train rank 0's client driving that engine from here, and sends version 2. After each
    refit, every engine weight must equal bitwise what vLLM's own reload makes of the step's HF
    weights; between them the engine is reloaded with the step-0 weights, which must differ (the
    check can fail), so that version 2 must land whole."""
    _engine_env(1)
    from functools import partial

    from refit_vllm.clients import LLMClient
    from refit_vllm.demo import engine_kwargs
    from refit_vllm.reference import reference_dir
    from vllm import LLM
    from vllm.config import WeightTransferConfig

    from refit_core.kit.launch import free_port

    cfg = tiny_config(DOCS_MODEL)
    result: dict[str, Any] = {}
    rendezvous = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    spawn_ctx = mp.get_context("spawn")
    ours, theirs = spawn_ctx.Pipe()
    gate = spawn_ctx.Event()
    trainers = Trainers(train_docs, 2, cfg, rendezvous, free_port(), trainer_block, theirs, gate)
    namespace = {"__name__": "__docs__", "LLM": partial(LLM, **engine_kwargs(cfg, 1)),
                 "WeightTransferConfig": WeightTransferConfig, "rendezvous": rendezvous[0], "step": 1,
                 "model": str(reference_dir(cfg, SEED, 0, os.path.join(scratch_dir(), "initial")))}
    start = time.perf_counter()
    exec(compile(engine_block["code"], engine_block["where"], "exec"), namespace)
    result["engine_block_s"] = time.perf_counter() - start
    llm = namespace["llm"]
    result["engine_block_version"] = llm.get_weight_version()
    result["engine_block_mismatches"] = llm.collective_rpc(_reload_mismatches, args=(cfg, 1))
    result["step0_mismatches"] = llm.collective_rpc(_reload_mismatches, args=(cfg, 0))

    calls: list[str] = []
    threading.Thread(target=serve, args=(LLMClient(llm), ours, calls, threading.Event()), daemon=True).start()
    start = time.perf_counter()
    gate.set()
    error = trainers.join()
    result["trainer_block_s"] = time.perf_counter() - start
    result["trainer_error"] = None if error is None else str(error)
    result["trainer_block_calls"] = calls
    result["trainer_block_version"] = llm.get_weight_version()
    result["trainer_block_mismatches"] = llm.collective_rpc(_reload_mismatches, args=(cfg, 2))
    llm.llm_engine.engine_core.shutdown()
    return result


def scenario_lora(**kwargs: Any) -> dict[str, Any]:
    """Adapter mode (``lora_scenario.py``): a PEFT adapter into the engine's LoRA slots."""
    from lora_scenario import scenario_lora as run

    return run(**kwargs)


SCENARIOS = {"refit": scenario_refit, "mismatch_then_subset": scenario_mismatch_then_subset,
             "abort_then_loader": scenario_abort_then_loader, "inflight": scenario_inflight, "docs": scenario_docs,
             "lora": scenario_lora}


def run_one(name: str, arguments: dict[str, Any]) -> None:
    """Run scenario ``name``, print its ``RESULT`` line, remove its scratch folders and exit this process."""
    try:
        outcome = SCENARIOS[name](**arguments)
    except BaseException:  # noqa: BLE001 - reported to the test
        outcome = {"scenario_error": traceback.format_exc()}
    print("RESULT " + json.dumps(outcome, default=str), flush=True)
    sys.stdout.flush()
    for scratch in _SCRATCH_DIRS:
        shutil.rmtree(scratch, ignore_errors=True)
    os._exit(0)  # engine processes and threads must not keep the scenario alive


if __name__ == "__main__":
    if sys.argv[1] == "--serve":
        import scenario_server  # its serve() is not this module's serve()

        scenario_server.serve(run_one)
    else:
        run_one(sys.argv[1], json.loads(sys.argv[2] if len(sys.argv) > 2 else "{}"))
