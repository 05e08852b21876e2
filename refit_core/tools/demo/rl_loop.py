"""``refit demo --loop``: a real RL loop on a local Ray cluster, refit after every step.

A tiny causal LM is trained by a train backend's policy actors (e.g. FSDP2 over 2 ranks, AdamW) on a
GRPO objective with a synthetic, checkable reward (:class:`~refit_core.kit.rl.TargetSetReward`), while a
gen backend's engine actor (e.g. a vLLM ``AsyncLLM``) samples the rollouts. Every step:

1. the engine samples ``group_size`` completions of each prompt, with their log-probabilities;
2. the trainers score them under the weights the engine used (the "generation KL": ~0 when refit
   delivered exactly the trainer's weights), then take one optimizer step;
3. :class:`~refit_core.kit.ray.RayRefit` moves the new weights into the engine, while evaluation requests
   are kept in flight across the update (paused with ``keep``, resumed on the new version).

A per-step table (reward, refit ms, generation tokens/s, KL, requests carried across the update),
under a progress bar on a terminal and as plain rows in a log file or pipe, and a PNG plot of reward and
KL per step are the output.

Backends opt in by registering ``rl_train_actor`` / ``rl_gen_actor`` (``"module:Class"`` paths of Ray
actor classes) in their :class:`~refit_core.kit.demo.DemoPrograms`:

- train actor: ``Class(rank, world_size, config, *, seed, lr, device)``, ``init_training(dist_address)``
  (collective over the trainers), ``train_step(rollouts, advantages) -> {"indices", "logprobs",
  "loss"}`` (log-probabilities of this rank's rollouts before the update), ``shutdown()``, and the
  :class:`~refit_core.kit.ray.RefitTrainActor` methods (e.g. ``refit_dtensor.policy.FSDPPolicyActor``);
- gen actor: ``Class(model_dir_or_None, *, config, seed, device)``, ``sample(prompts, *, group_size,
  max_tokens, temperature, seed) -> list[Rollout]``, ``wait_in_flight(min_tokens)``,
  ``weight_version()``, ``shutdown()``, and the gen-actor protocol of :mod:`refit_core.kit.ray`
  (e.g. ``refit_vllm.ray.VLLMEngineActor``).

With ``--lora r=8[,mode=merged]`` the trainers train a PEFT LoRA adapter on the frozen policy (their
actor takes ``lora=LoraSpec``). Merged mode (the loop's default for LoRA) sends ``W + scale * B @ A`` into
any engine; adapter mode needs a gen actor class with ``supports_lora = True``, built with
``lora=LoraSpec``, that serves the adapter from its LoRA slots on the trainers' frozen base weights
(refit never moves them: ``reference_state_dict(config, seed, 0)``, the train actors' initial weights,
e.g. ``refit_vllm.ray.VLLMEngineActor``). The loop prints the bytes refit moved per
step beside the full model's and the adapter's.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import random
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

from refit_core.contract.backend import GEN, TRAIN, Backend
from refit_core.contract.errors import RefitError
from refit_core.contract.lora import LoraMode, LoraSpec
from refit_core.contract.plugins import get_plugin_manager
from refit_core.contract.side import Side
from refit_core.kit.demo import installed_demos
from refit_core.kit.models import load_config
from refit_core.kit.rl import LogprobMismatch, Rollout, TargetSetReward, group_advantages, logprob_mismatch

EVAL_TOKENS = 48


@dataclass(frozen=True)
class LoopSettings:
    """What the loop trains and how. ``kl_bound``: the largest generation KL accepted as "weights right"."""

    model: str = "tiny-qwen3"
    steps: int = 20
    prompts: int = 8
    group_size: int = 8
    prompt_tokens: int = 8
    completion_tokens: int = 16
    lr: float = 3e-3
    train_ranks: int = 2
    seed: int = 0
    kl_bound: float = 1e-3
    device: str = "cpu"
    timeout_s: float = 300.0
    plot: str | None = "refit-rl-loop.png"
    lora: LoraSpec | None = None
    """Train a LoRA adapter instead of the whole policy (None: full fine-tuning; ``lr`` then applies
    unless it was left at the default, where :data:`LORA_LR` does)."""
    replicas: int = 1
    """Engine replicas: more than one runs the loop on a fleet (:mod:`refit_core.tools.demo.fleet_loop`)."""
    chaos_step: int | None = None
    """With ``replicas`` > 1: the step at which the last replica's actor is killed and restarted (None: never)."""

    @property
    def learning_rate(self) -> float:
        return LORA_LR if self.lora is not None and self.lr == LoopSettings.lr else self.lr


@dataclass(frozen=True)
class StepRow:
    """One line of the per-step table."""

    step: int
    reward: float
    mismatch: LogprobMismatch
    loss: float
    refit_ms: float
    gen_tokens_per_s: float
    carried_requests: int
    version: str


@dataclass
class LoopResult:
    """Everything the loop measured; ``ok`` when every step's KL stayed within the bound."""

    rows: list[StepRow] = field(default_factory=list)
    setup_s: float = 0.0
    chance_reward: float = 0.0
    kl_bound: float = 0.0
    plot: str | None = None

    @property
    def ok(self) -> bool:
        return bool(self.rows) and all(r.version == str(r.step) for r in self.rows)


R = TypeVar("R", bound=LoopResult)


def loop_actor_class(backend: Backend, side: Side) -> type:
    """The Ray actor class ``backend`` registered for the loop's ``side`` (see the module doc)."""
    path = installed_demos(get_plugin_manager()).of(backend.name).rl_actor(side)
    if not path:
        raise RefitError(f"backend {backend.name!r} has no RL-loop {side} actor "
                         f"({'rl_train_actor' if side == TRAIN else 'rl_gen_actor'} is not registered)")
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def loop_prompts(settings: LoopSettings, vocab: int) -> list[list[int]]:
    """The loop's prompts: ``settings.prompts`` of ``settings.prompt_tokens`` random tokens, the same every run."""
    rng = random.Random(settings.seed)
    return [[rng.randrange(vocab) for _ in range(settings.prompt_tokens)] for _ in range(settings.prompts)]


def run_loop(settings: LoopSettings, train: Backend, gen: Backend,
             report: Callable[[str], None] = print) -> LoopResult:
    """Run the loop on a local Ray cluster; ``report`` receives the console lines."""
    import ray

    from refit_core.kit.ray import RayRefit, gather
    from refit_core.tools.demo.console import StepConsole

    config = load_config(settings.model)
    reward = TargetSetReward()
    result = LoopResult(chance_reward=reward.chance, kl_bound=settings.kl_bound)
    with local_ray(settings.train_ranks + 2, report):
        start = time.perf_counter()
        engine_class = loop_actor_class(gen, GEN)
        lora = settings.lora
        adapter_mode = lora is not None and lora.mode is LoraMode.ADAPTER
        if adapter_mode and not getattr(engine_class, "supports_lora", False):
            raise RefitError(f"--lora mode=adapter needs a {gen.name} engine actor with LoRA slots "
                             f"({engine_class.__qualname__} has none): use mode=merged")
        extra: dict[str, Any] = {} if lora is None else {"lora": lora}
        trainers = train_actors(loop_actor_class(train, TRAIN), settings, config, **extra)
        Engine: Any = ray.remote(num_cpus=1)(engine_class)
        engine = Engine.remote(None, config=config, seed=settings.seed, device=settings.device,
                               **(extra if adapter_mode else {}))
        report(f"refit loop: starting {settings.train_ranks} {train.name} train actor(s) and a {gen.name} "
               f"engine actor ({settings.model})")
        build_policy(trainers, settings, start, report)
        report(f"refit loop: policy built after {time.perf_counter() - start:.1f} s; setting up refit")
        refit = RayRefit(trainers, [engine], timeout_s=settings.timeout_s)
        refit.setup()
        report(f"refit loop: refit set up after {time.perf_counter() - start:.1f} s; first refit (version 0)")
        first = refit.sync(version=0)
        if lora is not None:
            adapter = ray.get(trainers[0].adapter_bytes.remote(), timeout=settings.timeout_s)
            report(lora_bytes_line(lora, first.bytes, adapter, _model_bytes(config)))
        result.setup_s = time.perf_counter() - start
        report(f"refit loop: {settings.model}, {train.name} trainer x{settings.train_ranks} -> {gen.name} engine, "
               f"ready in {result.setup_s:.1f} s (plan {refit.fingerprint}); reward = fraction of tokens "
               f"in the target set (chance {reward.chance:.3f})")
        report(_header())
        prompts = loop_prompts(settings, int(config["vocab_size"]))
        console = StepConsole(settings.steps)
        for step in range(1, settings.steps + 1):
            began = time.perf_counter()
            rollouts: list[Rollout] = ray.get(engine.sample.remote(
                prompts, group_size=settings.group_size, max_tokens=settings.completion_tokens,
                temperature=1.0, seed=settings.seed * 1000 + step), timeout=settings.timeout_s)
            gen_s = time.perf_counter() - began
            trained = train_on(trainers, rollouts, reward, settings, step)
            # evaluation requests stay in flight across the update: paused with keep, resumed on step
            in_flight = engine.sample.remote(prompts[:2], max_tokens=EVAL_TOKENS, temperature=0.0, seed=step)
            ray.get(engine.wait_in_flight.remote(min_tokens=2), timeout=settings.timeout_s)
            sync = refit.sync(version=step)
            carried = ray.get(in_flight, timeout=settings.timeout_s)
            version = ray.get(engine.weight_version.remote(), timeout=settings.timeout_s)
            row = StepRow(step, trained.reward, trained.mismatch, trained.loss, sync.seconds * 1e3,
                          sum(len(r.tokens) for r in rollouts) / gen_s,
                          sum(1 for r in carried if len(set(r.versions)) > 1), version)
            result.rows.append(row)
            console.row(_line(row), reward=f"{row.reward:.3f}", kl=f"{row.mismatch.kl:.1e}")
        console.close()
        refit.close()
        gather({t.shutdown.remote(): f"train actor {r}" for r, t in enumerate(trainers)}, "shutting down",
               settings.timeout_s)
        ray.get(engine.shutdown.remote(), timeout=settings.timeout_s)
    return plotted(result, settings, report)


def train_actors(actor_class: type, settings: LoopSettings, config: dict[str, Any], **extra: Any) -> list[Any]:
    """One train actor of ``actor_class`` per train rank (one CPU each), started; ``extra`` goes to each."""
    import ray

    Trainer: Any = ray.remote(num_cpus=1)(actor_class)
    return [Trainer.remote(r, settings.train_ranks, config, seed=settings.seed, lr=settings.learning_rate,
                           device=settings.device, **extra) for r in range(settings.train_ranks)]


def build_policy(trainers: list[Any], settings: LoopSettings, start: float, report: Callable[[str], None]) -> None:
    """The trainers' process group on train actor 0's node, and the sharded policy (collective)."""
    from refit_core.kit.ray import gather

    (address,) = gather({trainers[0].refit_address.remote(): "train actor 0"}, "picking an address",
                        settings.timeout_s)
    report(f"refit loop: actors up after {time.perf_counter() - start:.1f} s; building the policy")
    gather({t.init_training.remote(address): f"train actor {r}" for r, t in enumerate(trainers)},
           "building the policy", settings.timeout_s)


@dataclass(frozen=True)
class Trained:
    """One optimizer step of the trainers: the rollouts' mean reward, the generation KL of the weights they
    were sampled with, and the mean loss."""

    reward: float
    mismatch: LogprobMismatch
    loss: float


def train_on(trainers: list[Any], rollouts: list[Rollout], reward: TargetSetReward, settings: LoopSettings,
             step: int) -> Trained:
    """Score ``rollouts`` (consecutive groups of ``settings.group_size``), take a GRPO step on every train actor
    and measure the engines' log-probabilities against the trainers' before the update."""
    from refit_core.kit.ray import gather

    rewards = [reward(r.tokens) for r in rollouts]
    advantages = group_advantages(rewards, settings.group_size)
    outcomes = gather({t.train_step.remote(rollouts, advantages): f"train actor {r}"
                       for r, t in enumerate(trainers)}, f"training step {step}", settings.timeout_s)
    trainer_lp: dict[int, list[float]] = {}
    for out in outcomes:
        trainer_lp.update(zip(out["indices"], out["logprobs"]))
    mismatch = logprob_mismatch([lp for r in rollouts for lp in r.logprobs],
                                [lp for i in range(len(rollouts)) for lp in trainer_lp[i]])
    return Trained(sum(rewards) / len(rewards), mismatch, sum(o["loss"] for o in outcomes) / len(outcomes))


def _model_bytes(config: dict[str, Any]) -> int:
    """The bytes of the model's checkpoint (what a full refit moves per step)."""
    from refit_core.kit.models import checkpoint_specs

    return sum(s.nbytes for s in checkpoint_specs(config))


def lora_bytes_line(lora: LoraSpec, sent: int, adapter: int, full: int) -> str:
    """What the loop's refit moves per step, beside the full model's and the adapter's."""
    from refit_core.units import format_bytes

    share = sent / full if full else 0.0
    return (f"refit loop: LoRA r={lora.rank} ({lora.mode.value} mode): refit moves {format_bytes(sent)} per step, "
            f"{share:.1%} of the full model's {format_bytes(full)} (the adapter alone: {format_bytes(adapter)})")


@contextmanager
def local_ray(actors: int, report: Callable[[str], None]) -> Iterator[None]:
    """A loop's Ray cluster: the one this process joined already, or a local one for ``actors`` one-CPU actors,
    started here and shut down on the way out."""
    import ray

    owns_ray = not ray.is_initialized()
    if owns_ray:
        start_local_ray(actors)
        report("refit loop: local Ray cluster up (actor logs under /tmp/ray/session_latest/logs)")
    try:
        yield
    finally:
        if owns_ray:
            ray.shutdown()


def plotted(result: R, settings: LoopSettings, report: Callable[[str], None]) -> R:
    """``result``, with the plot of its steps written where ``settings.plot`` says (if it does)."""
    if settings.plot:
        result.plot = write_plot(result, settings.plot)
        report(f"refit loop: plot written to {result.plot}")
    return result


def start_local_ray(actors: int, env: dict[str, str] | None = None) -> None:
    """A quiet local Ray cluster with room for ``actors`` one-CPU actors (logs stay in Ray's log dir);
    ``env`` adds environment variables for every actor."""
    import ray

    env_vars = {"TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", **(env or {})}
    ray.init(num_cpus=max(4, actors), include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING,
             runtime_env={"env_vars": env_vars})


STEP_COLUMNS = (f"{'step':>4}  {'reward':>7}  {'gen KL':>8}  {'max|dlp|':>8}  {'loss':>8}  {'refit ms':>8}  "
                f"{'gen tok/s':>9}")
"""The per-step table's first columns, in every loop (:func:`step_cells` fills them)."""


def step_cells(row: StepRow) -> str:
    """``row``'s cells under :data:`STEP_COLUMNS`."""
    return (f"{row.step:>4}  {row.reward:>7.3f}  {row.mismatch.kl:>8.1e}  {row.mismatch.max_abs:>8.1e}  "
            f"{row.loss:>8.4f}  {row.refit_ms:>8.1f}  {row.gen_tokens_per_s:>9.0f}")


def _header() -> str:
    return f"{STEP_COLUMNS}  {'carried':>7}  version"


def _line(row: StepRow) -> str:
    return f"{step_cells(row)}  {row.carried_requests:>7}  {row.version}"


def write_plot(result: LoopResult, path: str) -> str:
    """A PNG of reward (with the chance level) and generation KL per step; returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r.step for r in result.rows]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    top.plot(steps, [r.reward for r in result.rows], marker="o", label="mean reward")
    top.axhline(result.chance_reward, color="grey", linestyle="--", label="random policy")
    top.set_ylabel("reward")
    top.legend(loc="lower right")
    top.set_title("refit RL loop: GRPO with the engine refit after every step")
    floor = 1e-18  # an exact 0 (identical log-probabilities) still shows on the log scale
    bottom.plot(steps, [max(r.mismatch.kl, floor) for r in result.rows], marker="o", color="tab:red",
                label="engine vs trainer")
    if result.kl_bound:
        bottom.axhline(result.kl_bound, color="grey", linestyle="--", label="bound: weights wrong above")
    bottom.set_yscale("log")
    bottom.legend(loc="center right")
    bottom.set_ylabel("generation KL (engine vs trainer)")
    bottom.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return os.path.abspath(path)


def run_cli(settings: LoopSettings, train: str | None, gen: str | None) -> int:
    """``refit demo --loop``: exit status 0 when the loop kept the engine's weights right."""
    try:
        import ray  # noqa: F401
    except ImportError:
        raise RefitError("refit demo --loop needs Ray: pip install 'refit-core[ray]'") from None
    pm = get_plugin_manager()
    result = run_loop(settings, pm.backend(train or "dtensor", TRAIN), pm.backend(gen or "vllm", GEN))
    return 0 if summarize(result, settings) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m refit_core.tools.demo.rl_loop",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--train", default="dtensor")
    parser.add_argument("--gen", default="vllm")
    parser.add_argument("--model", default=LoopSettings.model)
    parser.add_argument("--steps", type=int, default=LoopSettings.steps)
    parser.add_argument("--plot", default=LoopSettings.plot)
    parser.add_argument("--lora", default=None, metavar="r=N[,alpha=A][,targets=...][,mode=adapter]",
                        help="train a LoRA adapter (merged mode unless mode=adapter is given)")
    args = parser.parse_args(argv)
    return run_cli(LoopSettings(model=args.model, steps=args.steps, plot=args.plot, lora=loop_lora(args.lora)),
                   args.train, args.gen)


def loop_lora(text: str | None) -> LoraSpec | None:
    """``--lora`` of the loop: :meth:`LoraSpec.parse`, merged mode unless ``mode=`` says otherwise (any
    engine serves merged weights), and a LoRA learning rate."""
    if not text:
        return None
    if "mode=" not in text:
        text += ",mode=merged"
    return LoraSpec.parse(text)


LORA_LR = 1e-2
"""The loop's learning rate for LoRA (B starts at zero: a larger step than full fine-tuning's)."""


def summarize(result: LoopResult, settings: LoopSettings, report: Callable[[str], None] = print) -> bool:
    """Print the one-line verdict; True when the weights were right at every step and reward rose."""
    rows = result.rows
    worst = max(r.mismatch.kl for r in rows)
    head = sum(r.reward for r in rows[:3]) / len(rows[:3])
    tail = sum(r.reward for r in rows[-3:]) / len(rows[-3:])
    ok = result.ok and worst <= settings.kl_bound
    report(f"refit loop: {'OK' if ok else 'FAILED'}: {len(rows)} steps, reward {head:.3f} -> {tail:.3f} "
           f"(chance {result.chance_reward:.3f}), worst generation KL {worst:.1e} (bound {settings.kl_bound:.0e}), "
           f"median refit {sorted(r.refit_ms for r in rows)[len(rows) // 2]:.0f} ms")
    return ok


if __name__ == "__main__":
    sys.exit(main())
