"""``refit demo --loop --replicas N [--chaos [STEP]]``: the RL loop of :mod:`.rl_loop` on a fleet of engine replicas.

The train actors feed a fleet (:class:`~refit_core.apps.ray_fleet.RayFleet`, opened once) instead of one engine:
every replica's engine actor (``r0`` .. ``rN-1``, e.g. ``refit_vllm.ray.VLLMEngineActor``) joins it with
``refit_join_fleet`` and receives each step with ``refit_fleet_receive``. Each step:

1. the replicas that hold the last version sample the rollouts, the prompts spread over them;
2. the trainers take their GRPO step, measuring the generation KL as in :mod:`.rl_loop`;
3. with ``--chaos``, at its step the last replica's actor is killed (after its rollouts) and a new one starts
   under its name, asking to join again;
4. the fleet sends the step: the replicas in it receive, a replica that asked in an earlier step is admitted and
   receives it whole (the loop waits until the restarted engine asked: it is back the step after its death);
5. every replica that holds the version is checked: its greedy generation on the loop's first prompt, fed to the
   trainers' HF policy of that version, is the policy's own greedy choice at every token (HF's greedy generation
   is the same) and its log-probabilities match (the same generation KL, bound ``kl_bound``).

The train actor class needs ``score(rollouts) -> {"logprobs", "greedy"}`` besides the loop's protocol (e.g.
``refit_dtensor.policy.FSDPPolicyActor``). The per-step table shows which replicas hold each version.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from refit_core.contract.backend import GEN, TRAIN, Backend
from refit_core.contract.errors import RefitError
from refit_core.contract.plugins import get_plugin_manager
from refit_core.kit.models import load_config
from refit_core.kit.rl import LogprobMismatch, Rollout, TargetSetReward, logprob_mismatch
from refit_core.tools.demo.rl_loop import (
    STEP_COLUMNS,
    LoopResult,
    LoopSettings,
    StepRow,
    build_policy,
    loop_actor_class,
    loop_prompts,
    local_ray,
    plotted,
    step_cells,
    summarize,
    train_actors,
    train_on,
)

ABSENT = "--"
"""A replica's cell in the per-step table when it does not hold the step's version."""


@dataclass(frozen=True)
class ProbeCheck:
    """One replica after a step: whether its greedy generation is the trainers' HF policy's, and the KL between
    its log-probabilities of it and the policy's."""

    replica: str
    equal: bool
    mismatch: LogprobMismatch


@dataclass(frozen=True)
class FleetRow:
    """One step of the fleet loop: the loop's row, the replicas that hold its version, their checks, and what
    happened to the fleet (a kill, a restart's return, a failed step)."""

    row: StepRow
    holders: tuple[str, ...]
    checks: tuple[ProbeCheck, ...]
    events: tuple[str, ...] = ()


@dataclass
class FleetResult(LoopResult):
    """The loop's result with the fleet's rows; ``ok`` also needs every holder's check to pass."""

    replicas: tuple[str, ...] = ()
    fleet_rows: list[FleetRow] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        checks = [c for r in self.fleet_rows for c in r.checks]
        return (super().ok and all(len(r.checks) == len(r.holders) > 0 for r in self.fleet_rows)
                and all(c.equal and c.mismatch.kl <= self.kl_bound for c in checks))


@dataclass
class Replica:
    """The controller's view of one replica: its current actor, the version it holds (None: none yet), and its
    join in flight (it resolves to the version of the step that admitted it, once that step landed)."""

    name: str
    actor: Any
    holds: int | None = None
    joining: Any = None


def replica_names(count: int) -> tuple[str, ...]:
    """The replicas' names: ``r0`` .. ``r{count-1}``; ``--chaos`` strikes the last."""
    return tuple(f"r{i}" for i in range(count))


def chaos_step(steps: int, given: int | None) -> int:
    """The step at which ``--chaos`` kills a replica: ``given`` (-1: the middle of the run), checked to leave a
    step after it."""
    step = max(1, steps // 2) if given == -1 else given
    if step is None or not 1 <= step < steps:
        raise RefitError(f"--chaos {given}: the step must lie in 1..{steps - 1} (a step must follow the restart)")
    return step


class FleetLoop:
    """The controller of one run (see the module doc): the trainers' fleet, the replicas, and the checks."""

    def __init__(self, settings: LoopSettings, engine_class: type, config: dict[str, Any], trainers: list[Any]) -> None:
        import ray

        from refit_core.apps.ray_fleet import RayFleet

        self.settings, self.config, self.trainers = settings, config, trainers
        self.engine: Any = ray.remote(num_cpus=1)(engine_class)
        self.replicas = [Replica(name, self._new_engine()) for name in replica_names(settings.replicas)]
        self.fleet = RayFleet(trainers, timeout_s=settings.timeout_s)
        self.asked = 0
        """Join requests made so far (each replica has one rank)."""

    def _new_engine(self) -> Any:
        s = self.settings
        return self.engine.remote(None, config=self.config, seed=s.seed, device=s.device)

    def _join(self, replica: Replica) -> None:
        replica.holds = None
        replica.joining = replica.actor.refit_join_fleet.remote(self.fleet.address, replica.name, self.fleet.options,
                                                               self.settings.timeout_s * 4)
        self.asked += 1

    def open(self) -> tuple[str, ...]:
        """Open the fleet, let every replica join and send version 0; returns the replicas that hold it."""
        self.fleet.open()
        for replica in self.replicas:
            self._join(replica)
        self.admit(self.asked)
        landed, events = self.refit(0)
        if len(landed) != len(self.replicas):
            raise RefitError(f"version 0 reached {list(landed)} only, of {[r.name for r in self.replicas]}: "
                             f"{'; '.join(events)}")
        return landed

    def sample(self, step: int, prompts: list[list[int]]) -> list[Rollout]:
        """The step's rollouts, prompt ``i`` sampled by the ``i % n``-th of the ``n`` replicas holding the last
        version, in prompt order (each prompt's group together)."""
        from refit_core.kit.ray import gather

        live = [r for r in self.replicas if r.holds == step - 1]
        if not live:
            raise RefitError(f"step {step}: no replica holds version {step - 1}")
        s = self.settings
        shares = [list(range(k, len(prompts), len(live))) for k in range(len(live))]
        samples = gather({r.actor.sample.remote([prompts[i] for i in share], group_size=s.group_size,
                                                max_tokens=s.completion_tokens, temperature=1.0,
                                                seed=(s.seed * 1000 + step) * len(live) + k): r.name
                          for k, (r, share) in enumerate(zip(live, shares))}, f"sampling step {step}", s.timeout_s)
        by_prompt: dict[int, list[Rollout]] = {}
        for share, rollouts in zip(shares, samples):
            for rollout in rollouts:
                index = share[rollout.prompt_index]
                by_prompt.setdefault(index, []).append(dataclasses.replace(rollout, prompt_index=index))
        return [r for i in range(len(prompts)) for r in by_prompt[i]]

    def strike(self, step: int) -> str:
        """``--chaos``: kill the last replica's actor, start a new one under its name, and have it ask to join."""
        import ray

        victim = self.replicas[-1]
        ray.kill(victim.actor)
        try:  # until the process is gone: its ranks' connections to the fleet are closed
            ray.get(victim.actor.refit_gen_ranks.remote(), timeout=self.settings.timeout_s)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass
        victim.actor = self._new_engine()
        self._join(victim)
        return f"{victim.name} killed at step {step}, restarting"

    def admit(self, joined_before: int) -> float:
        """Wait until the joins asked before this step (``joined_before`` in all) are in the fleet, so that its
        next step admits them (a restarted engine: once it started); returns the seconds waited."""
        began = time.perf_counter()
        self.fleet.await_joins(joined_before, self.settings.timeout_s * 4)
        return time.perf_counter() - began

    def refit(self, version: int) -> tuple[tuple[str, ...], list[str]]:
        """Send ``version`` to the fleet; returns the replicas that hold it and what happened to the others."""
        import ray

        from refit_core.kit.ray import gather

        events = self._retry_failed_joins()
        calls = {r.name: r.actor.refit_fleet_receive.remote() for r in self.replicas
                 if r.joining is None and r.holds == version - 1}
        sent = self.fleet.send(version)
        failed = {f.replica: f.reason for f in sent.failed}
        for replica in self.replicas:
            call = calls.get(replica.name)
            if call is None and replica.name in sent.joined:  # its join: the step that admitted it, whole
                call, replica.joining = replica.joining, None
                if version > 0:
                    events.append(f"{replica.name} rejoined")
            if call is None:
                if replica.name in failed:  # a join's setup, or the actor a strike killed
                    events.append(f"{replica.name} failed the step: {_first_clause(failed[replica.name])}")
                continue  # not admitted yet
            if replica.name in sent.landed:
                (replica.holds,) = gather({call: replica.name}, f"replica {replica.name}'s step of version {version}",
                                          self.settings.timeout_s)
                continue
            ray.wait([call], timeout=self.settings.timeout_s)  # it failed the step or left: let its call end
            events.append(f"{replica.name} failed, rejoining")
            self._join(replica)
        landed = tuple(r.name for r in self.replicas if r.holds == version)
        if set(landed) != set(sent.landed):
            raise RefitError(f"version {version}: the fleet says {list(sent.landed)} hold it, the replicas "
                             f"{list(landed)}")
        return landed, events

    def _retry_failed_joins(self) -> list[str]:
        """Joins that ended before a step admitted them (they failed: a join returns only after its first step)
        are asked again."""
        import ray

        events = []
        for replica in self.replicas:
            if replica.joining is not None and ray.wait([replica.joining], timeout=0)[0]:
                events.append(f"{replica.name}'s join failed, asking again")
                self._join(replica)
        return events

    def check(self, holders: tuple[str, ...], prompt: list[int]) -> tuple[ProbeCheck, ...]:
        """Each holder's greedy generation on ``prompt``, scored by the trainers' HF policy (see the module doc)."""
        from refit_core.kit.ray import gather

        s = self.settings
        actors = {r.name: r.actor for r in self.replicas}
        probes = [rollouts[0] for rollouts in gather(
            {actors[n].sample.remote([prompt], group_size=1, max_tokens=s.completion_tokens, temperature=0.0,
                                     seed=0): n for n in holders}, "greedy probes", s.timeout_s)]
        scores = gather({t.score.remote(probes): f"train actor {r}" for r, t in enumerate(self.trainers)},
                        "scoring the probes", s.timeout_s)[0]
        return tuple(ProbeCheck(name, tuple(greedy) == probe.tokens, logprob_mismatch(probe.logprobs, logprobs))
                     for name, probe, greedy, logprobs in zip(holders, probes, scores["greedy"], scores["logprobs"]))

    def close(self) -> None:
        """Close the fleet and stop every replica's actor (best effort)."""
        import ray

        self.fleet.close()
        refs = [r.actor.shutdown.remote() for r in self.replicas]
        ray.wait(refs, num_returns=len(refs), timeout=30.0)
        for replica in self.replicas:
            ray.kill(replica.actor)


def run_fleet_loop(settings: LoopSettings, train: Backend, gen: Backend,
                   report: Callable[[str], None] = print) -> FleetResult:
    """Run the loop with ``settings.replicas`` engine replicas in a fleet on a local Ray cluster."""
    from refit_core.apps.ray_fleet import fleet_train_actor
    from refit_core.kit.ray import gather
    from refit_core.tools.demo.console import StepConsole

    if settings.lora is not None:
        raise RefitError("--replicas with --lora is not supported yet: a fleet replica receives whole weights")
    config = load_config(settings.model)
    reward = TargetSetReward()
    result = FleetResult(chance_reward=reward.chance, kl_bound=settings.kl_bound,
                         replicas=replica_names(settings.replicas))
    with local_ray(settings.train_ranks + settings.replicas + 1, report):
        start = time.perf_counter()
        trainers = train_actors(fleet_train_actor(loop_actor_class(train, TRAIN)), settings, config)
        loop = FleetLoop(settings, loop_actor_class(gen, GEN), config, trainers)
        report(f"refit loop: starting {settings.train_ranks} {train.name} train actor(s) and {settings.replicas} "
               f"{gen.name} engine actors ({settings.model}), replicas {', '.join(result.replicas)}")
        build_policy(trainers, settings, start, report)
        report(f"refit loop: policy built after {time.perf_counter() - start:.1f} s; the replicas join the fleet")
        loop.open()
        result.setup_s = time.perf_counter() - start
        report(f"refit loop: {settings.model}, {train.name} trainer x{settings.train_ranks} -> a fleet of "
               f"{settings.replicas} {gen.name} replicas at {loop.fleet.address}, all on version 0 after "
               f"{result.setup_s:.1f} s; reward = fraction of tokens in the target set (chance {reward.chance:.3f})")
        report(fleet_header(result.replicas))
        prompts = loop_prompts(settings, int(config["vocab_size"]))
        console = StepConsole(settings.steps)
        for step in range(1, settings.steps + 1):
            asked = loop.asked
            began = time.perf_counter()
            rollouts = loop.sample(step, prompts)
            gen_s = time.perf_counter() - began
            trained = train_on(trainers, rollouts, reward, settings, step)
            events = [loop.strike(step)] if step == settings.chaos_step else []
            waited = loop.admit(asked)
            if waited > 1.0:
                events.append(f"waited {waited:.1f} s for a restarted engine to ask to join")
            began = time.perf_counter()
            holders, happened = loop.refit(step)
            refit_s = time.perf_counter() - began
            row = StepRow(step, trained.reward, trained.mismatch, trained.loss, refit_s * 1e3,
                          sum(len(r.tokens) for r in rollouts) / gen_s, 0, str(step) if holders else "-")
            fleet_row = FleetRow(row, holders, loop.check(holders, prompts[0]), (*events, *happened))
            result.rows.append(row)
            result.fleet_rows.append(fleet_row)
            console.row(fleet_line(fleet_row, result.replicas), reward=f"{row.reward:.3f}",
                        kl=f"{row.mismatch.kl:.1e}")
        console.close()
        loop.close()
        gather({t.shutdown.remote(): f"train actor {r}" for r, t in enumerate(trainers)}, "shutting down",
               settings.timeout_s)
    return plotted(result, settings, report)


def _first_clause(reason: str) -> str:
    """A failure's reason up to its first detail (a transport's own message follows ``": ["``)."""
    return reason.splitlines()[0].split(": [")[0][:120] if reason else "?"


def fleet_header(replicas: tuple[str, ...]) -> str:
    """The fleet loop's table header: the loop's columns, then the replicas holding the version, their checks."""
    width = len(" ".join(replicas))
    return f"{STEP_COLUMNS}  {'holding':<{width}}  {'= HF':>5}  {'probe KL':>8}  events"


def fleet_line(row: FleetRow, replicas: tuple[str, ...]) -> str:
    """One step: the loop's cells, each replica's name where it holds the version (``--`` where not), how many
    of the holders' greedy generations equal HF's, the worst probe KL, and the fleet's events."""
    cells = " ".join(name if name in row.holders else ABSENT.ljust(len(name)) for name in replicas)
    equal = f"{sum(c.equal for c in row.checks)}/{len(row.checks)}"
    worst = max((c.mismatch.kl for c in row.checks), default=0.0)
    return f"{step_cells(row.row)}  {cells}  {equal:>5}  {worst:>8.1e}  {'; '.join(row.events)}".rstrip()


def summarize_fleet(result: FleetResult, settings: LoopSettings, report: Callable[[str], None] = print) -> bool:
    """The loop's verdict (:func:`~refit_core.tools.demo.rl_loop.summarize`), then the fleet's; True when both
    hold."""
    loop_ok = summarize(result, settings, report)
    checks = [c for r in result.fleet_rows for c in r.checks]
    absent = {name: [r.row.step for r in result.fleet_rows if name not in r.holders] for name in result.replicas}
    gaps = "; ".join(f"{name} absent at step(s) {', '.join(map(str, steps))}"
                     for name, steps in absent.items() if steps)
    report(f"refit fleet: {'OK' if result.ok else 'FAILED'}: {len(result.replicas)} replicas, {len(checks)} checks "
           f"after the steps, {sum(c.equal for c in checks)} greedy generations equal to HF's, worst probe KL "
           f"{max((c.mismatch.kl for c in checks), default=0.0):.1e}; {gaps or 'no replica absent'}")
    return loop_ok and result.ok


def run_cli(settings: LoopSettings, train: str | None, gen: str | None) -> int:
    """``refit demo --loop --replicas N``: exit status 0 when every replica's weights were right and reward rose."""
    pm = get_plugin_manager()
    result = run_fleet_loop(settings, pm.backend(train or "dtensor", TRAIN), pm.backend(gen or "vllm", GEN))
    return 0 if summarize_fleet(result, settings) else 1


__all__ = ["FleetLoop", "FleetResult", "FleetRow", "ProbeCheck", "Replica", "chaos_step", "fleet_header",
           "fleet_line", "replica_names", "run_cli", "run_fleet_loop", "summarize_fleet"]
