"""A vLLM engine as a Ray actor that refit updates through vLLM's own weight-transfer API.

    Engine = ray.remote(VLLMEngineActor)
    engine = Engine.remote(model_dir, tp=1)
    refit = refit_core.apps.RayRefit(trainers, [engine])

The actor holds an ``AsyncLLM`` with ``WeightTransferConfig(backend="refit")`` and speaks the gen-actor
protocol of :mod:`refit_core.kit.ray`. Every update pauses generation with ``mode="keep"``: requests in
flight stay in the engine and continue on the new weights after ``resume_generation()`` (their
outputs' ``weight_versions`` show where the version changed); the prefix cache is reset, since
cached KV came from the old weights. :meth:`sample` serves the RL loop's rollouts.

Built with ``lora=LoraSpec`` (adapter mode), the engine serves with LoRA slots (``enable_lora``, one slot
of the smallest ``max_lora_rank`` vLLM allows at or above the adapter's rank), refit moves only the
adapter into them (:mod:`.lora`), and :meth:`sample` generates with it.

As one replica of a fleet (``refit demo --loop --replicas N``), the engine joins the trainers' running fleet
with :meth:`refit_join_fleet` (again after a restart) and receives each step with :meth:`refit_fleet_receive`,
through refit's worker extension rather than vLLM's weight-transfer API.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import tempfile
from collections.abc import AsyncIterator
from typing import Any

from refit_core import LoraSpec, PlanError, RefitError, RefitOptions
from refit_core.apps import Rollout

from .demo import engine_env, engine_kwargs
from .extension import EXTENSION
from .lora import lora_request, lora_spec
from .reference import reference_dir


class VLLMEngineActor:
    """One vLLM engine (``tp`` workers) in a Ray actor; use it with ``ray.remote(VLLMEngineActor)``."""

    supports_lora = True
    """It takes ``lora=LoraSpec`` (adapter mode): ``refit demo --loop --lora ...,mode=adapter``."""

    def __init__(self, model: str | None, *, config: dict[str, Any], seed: int = 0, tp: int = 1,
                 device: str = "cpu", lora: LoraSpec | None = None, **engine_args: Any) -> None:
        """An engine for the HF model directory ``model``, or (None) for ``config`` with random weights
        (``reference_state_dict(config, seed, -1)``: a step no trainer sends). ``lora``: refit moves this
        adapter into the engine's LoRA slots and :meth:`sample` generates with it; None: the weights.
        With ``lora`` and no ``model`` the base weights are ``reference_state_dict(config, seed, 0)``, the
        RL loop trainers' frozen base, since refit never moves them."""
        self.lora = None if lora is None else lora_spec(lora)
        if self.lora is not None:
            engine_args = {"enable_lora": True, "max_lora_rank": lora_slot_rank(self.lora.rank), "max_loras": 1,
                           **engine_args}
        engine_env(tp, device)
        if model is None:
            self._checkpoint = tempfile.TemporaryDirectory(prefix="refit-vllm-actor-")
            model = str(reference_dir(config, seed, -1 if self.lora is None else 0, self._checkpoint.name))
        from vllm.config import WeightTransferConfig
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = engine_kwargs(config, tp, worker_extension_cls=EXTENSION,
                             weight_transfer_config=WeightTransferConfig(backend="refit"), **engine_args)
        self.engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=model, **args))
        self.tp = tp
        self._request_ids = itertools.count()
        self._in_flight: dict[str, int] = {}  # request id -> tokens generated so far

    # -- the gen-actor protocol of refit_core.kit.ray ---------------------------------------------

    def refit_gen_ranks(self) -> int:
        return self.tp

    async def refit_setup(self, rendezvous: str, rank_offset: int, world_size: int,
                          options: RefitOptions) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        info: dict[str, Any] = {"rendezvous": rendezvous, "rank_offset": rank_offset, "world_size": world_size,
                                "options": options.to_wire(secrets=True)}  # to this job's own engine, through Ray
        if self.lora is not None:
            info["lora"] = {"rank": self.lora.rank, "alpha": self.lora.alpha, "targets": list(self.lora.targets),
                            "name": self.lora.name}
        await self.engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info=info))

    async def refit_receive(self, version: int) -> int:
        """Pause (keeping requests in flight), receive ``version``, publish it, resume; returns bytes."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        async with self._paused():
            await self.engine.start_weight_update()
            await self.engine.update_weights(WeightTransferUpdateRequest(update_info={"version": version}))
            await self.engine.finish_weight_update(weight_version=str(version))
        stats = await self.engine.collective_rpc("refit_step_stats")
        return sum(int(s.get("bytes", 0)) for s in stats)

    async def refit_close(self) -> None:
        await self.engine.collective_rpc("shutdown_weight_transfer_engine")

    @contextlib.asynccontextmanager
    async def _paused(self) -> AsyncIterator[None]:
        """Generation paused with ``keep`` (requests in flight stay), the prefix cache reset after the update."""
        await self.engine.pause_generation(mode="keep")
        try:
            yield
            await self.engine.reset_prefix_cache()
        finally:
            await self.engine.resume_generation()

    # -- one replica of a fleet (refit_core.apps.ray_fleet.RayFleet on the trainers) -----------------

    async def refit_join_fleet(self, fleet: str, replica: str, options: RefitOptions,
                               join_timeout_s: float = 600.0) -> int:
        """Join the running fleet whose store is at ``fleet`` as replica ``replica`` (its workers its ranks,
        through :meth:`refit_vllm.extension.RefitWorkerExtension.refit_join_fleet`), then receive the step that
        admitted it, whole; returns that step's version. After a failed step, join again."""
        if self.lora is not None:
            raise PlanError("a fleet replica receives whole weights: build the engine without lora=")
        await self.engine.collective_rpc("refit_join_fleet", args=(fleet, replica), kwargs={
            "options": given_wire(options), "join_timeout_s": join_timeout_s})
        return await self.refit_fleet_receive()

    async def refit_fleet_receive(self) -> int:
        """Receive the fleet's next step (generation paused with ``keep``, as :meth:`refit_receive`); returns
        its version."""
        async with self._paused():
            versions = await self.engine.collective_rpc("refit_receive")
        if len(set(versions)) != 1:
            raise RefitError(f"the engine's workers hold different versions after a fleet step: {versions}")
        return int(versions[0])

    # -- generation ------------------------------------------------------------------------------

    async def weight_version(self) -> str:
        return await self.engine.get_weight_version()

    async def sample(self, prompts: list[list[int]], *, group_size: int = 1, max_tokens: int = 16,
                     temperature: float = 1.0, seed: int = 0) -> list[Rollout]:
        """``group_size`` completions of every prompt (consecutive), with the sampled tokens' log-probs."""
        from vllm import SamplingParams

        adapter = None if self.lora is None else lora_request(self.lora.name)

        async def one(index: int, prompt: list[int], sample_seed: int) -> Rollout:
            params = SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=True,
                                    logprobs=0, seed=sample_seed)
            request_id = f"sample-{next(self._request_ids)}"
            self._in_flight[request_id] = 0
            final = None
            try:
                async for final in self.engine.generate({"prompt_token_ids": prompt}, params,
                                                        request_id=request_id, lora_request=adapter):
                    self._in_flight[request_id] = len(final.outputs[0].token_ids)
            finally:
                self._in_flight.pop(request_id, None)
            completion = final.outputs[0]
            tokens = tuple(completion.token_ids)
            logprobs = tuple(step[token].logprob for step, token in zip(completion.logprobs, tokens))
            versions = tuple(span.version for span in completion.weight_versions or ())
            return Rollout(index, tuple(prompt), tokens, logprobs, versions)

        jobs = [one(i, p, seed * 100_003 + i * group_size + g)
                for i, p in enumerate(prompts) for g in range(group_size)]
        return list(await asyncio.gather(*jobs))

    async def wait_in_flight(self, min_tokens: int, timeout_s: float = 60.0) -> int:
        """Wait until some request has generated ``min_tokens`` tokens; returns how many are in flight."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not any(n >= min_tokens for n in self._in_flight.values()):
            if loop.time() > deadline:
                raise TimeoutError(f"no request reached {min_tokens} tokens within {timeout_s:.0f} s")
            await asyncio.sleep(0.005)
        return len(self._in_flight)

    def shutdown(self) -> None:
        self.engine.shutdown()


def given_wire(options: RefitOptions) -> dict[str, Any]:
    """The settings ``options`` were given, and the secret, as plain data for a worker: a default sent as a value
    would count as chosen there, and disagree with a side that chose otherwise (a fleet's trainers confirm)."""
    given = {name.split(".")[0] for name in options.explicit} | {"secret"}
    return {name: value for name, value in options.to_wire(secrets=True).items() if name in given}


def lora_slot_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds an adapter of rank ``rank``."""
    from typing import get_args

    from vllm.config.lora import MaxLoRARanks

    allowed = sorted(get_args(MaxLoRARanks))
    fits = [r for r in allowed if r >= rank]
    if not fits:
        raise PlanError(f"LoRA rank r={rank} exceeds vLLM's largest max_lora_rank {allowed[-1]}")
    return fits[0]


__all__ = ["VLLMEngineActor", "given_wire", "lora_slot_rank"]
