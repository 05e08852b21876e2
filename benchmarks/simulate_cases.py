"""Predicted refit times for issue #16's cases against their bounds: ``python benchmarks/simulate_cases.py``.

Each case (three shared with ``benchmarks/plan_speed.py``) is planned from metadata
(:func:`refit_core.plan.offline.plan_from_metadata`, the CUDA bucket) twice, with the trainers feeding
every engine GPU and with forwarding within nodes (``RelayOptions.node_ranks`` = the topology's GPUs
per node), and simulated on ``--topology`` (H100 nodes by default). Prints, side by side, the
prediction, the receiver- and sender-side bounds and their ratios; ``--out PREFIX`` writes
``PREFIX.md`` and ``PREFIX.json``. Runs on CPU.

``--relay``: issue #48's fleet instead: engine replicas fed by one trainer (:data:`RELAY_CASES`), each
planned by :func:`refit_core.plan.choose.choose_relay` (direct fanout, chains and trees, buckets of
:data:`~refit_core.plan.choose.RELAY_BUCKETS`, the relay's slices of :data:`~refit_core.plan.choose.RELAY_CHUNKS`)
on every ``--topology`` given (comma separated), against the goal of 1.15x the receiver-side bound.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass

from plan_speed import CASES as PLANNING_CASES
from plan_speed import Case

from refit_core.contract.layout import parse_backend_layout
from refit_core.contract.options import RefitOptions, RelayOptions
from refit_core.contract.plugins import get_plugin_manager
from refit_core.kit.models import load_config
from refit_core.plan.choose import RELAY_BUCKETS, choose_relay
from refit_core.plan.offline import PlanSummary, plan_from_metadata
from refit_core.plan.simulate import Topology, simulate

CASES = {
    **{name: PLANNING_CASES[name] for name in ("deepseek-v3", "kimi-k2", "qwen3-30b-a3b-1024")},
    "llama-3-70b": Case("llama-3-70b-shape", "dtensor:fsdp=64", "vllm:tp=8,dp=4"),
}
"""Issue #16's layouts: ``benchmarks/plan_speed.py``'s published ones, and Llama-3-70B."""

DEEPSEEK_TRAIN = PLANNING_CASES["deepseek-v3"].train
RELAY_CASES = {
    **{f"llama-3-8b-x{n}": (Case("llama-3-8b-shape", "megatron:tp=8", f"vllm:tp=8,dp={n}"), n) for n in (3, 8, 64)},
    "deepseek-v3-ep256": (PLANNING_CASES["deepseek-v3"], 8),  # experts across the replicas: no relay possible
    "deepseek-v3-tp32": (Case("deepseek-v3-shape", DEEPSEEK_TRAIN, "vllm:tp=32,dp=8", True), 8),
}
"""Issue #48's fleet: (layouts, engine replicas). DeepSeek-V3 as NeMo-RL publishes it (vLLM's experts
sharded over all 256 engine ranks: the replicas differ, no relay) and with each replica holding every
expert, tensor parallel (vLLM's expert parallelism always spans every DP replica)."""


@dataclass(frozen=True)
class Prediction:
    """One simulated plan: milliseconds and ratios."""

    predicted_ms: float
    receiver_bound_ms: float
    sender_bound_ms: float
    forwarding_ms: float
    forwarded_gib: float

    @property
    def over_receiver_bound(self) -> float:
        return self.predicted_ms / self.receiver_bound_ms

    @property
    def over_larger_bound(self) -> float:
        return self.predicted_ms / max(self.receiver_bound_ms, self.sender_bound_ms)


def predict(case: Case, topology: Topology, forward: bool) -> Prediction:
    train, train_layout = parse_backend_layout(case.train)
    gen, gen_layout = parse_backend_layout(case.gen)
    relay = RelayOptions(node_ranks=topology.gpus_per_node) if forward else RelayOptions()
    summary = plan_from_metadata(get_plugin_manager(), load_config(case.model), train, train_layout, gen, gen_layout,
                                 options=RefitOptions(relay=relay, allow_unused_sources=case.unused_ok),
                                 device="cuda")
    sim = simulate(summary.schedule, topology, relay=summary.relay)
    trainers = len(summary.schedule.rounds)
    forwarded = summary.relay.schedule.summary.bytes if summary.relay is not None else 0
    return Prediction(sim.predicted_s * 1e3, sim.bound_s * 1e3, sim.sender_bound_s * 1e3,
                      sum(sim.round_seconds[trainers:]) * 1e3, forwarded / 2**30)


def relay_rows(names: list[str], topologies: list[str]) -> list[str]:
    """Issue #48's fleet: each case's chosen relay on each topology, as markdown rows (printed as they come)."""
    rows = ["| case | topology | candidates | chosen | predicted | receiver-side bound | / bound | direct fanout | "
            "chosen in |", "|---|---|---:|---|---:|---:|---:|---:|---:|"]
    print(*rows, sep="\n", flush=True)
    for name in names:
        case, replicas = RELAY_CASES[name]
        train, train_layout = parse_backend_layout(case.train)
        gen, gen_layout = parse_backend_layout(case.gen)

        def plan(relay: RelayOptions, bucket_bytes: int | None = None, case: Case = case) -> PlanSummary:
            return plan_from_metadata(get_plugin_manager(), load_config(case.model), train, train_layout, gen,
                                      gen_layout, options=RefitOptions(bucket_bytes=bucket_bytes, relay=relay,
                                                                       allow_unused_sources=case.unused_ok),
                                      device="cuda")

        for topology in topologies:
            start = time.perf_counter()
            choice = choose_relay(plan, RelayOptions(replicas=replicas), Topology.parse(topology),
                                  buckets=RELAY_BUCKETS)
            took = time.perf_counter() - start
            best = choice.chosen
            chosen = best.label if not choice.refused else f"{best.label} (no relay: {choice.refused})"
            row = (f"| {name}: `{case.train}` -> `{case.gen}` | {topology} | {len(choice.candidates)} | {chosen} | "
                   f"{choice.predicted_s * 1e3:.1f} ms | {best.bound_s * 1e3:.1f} ms | "
                   f"{choice.predicted_s / best.bound_s:.2f} | {choice.baseline.predicted_s * 1e3:.1f} ms | "
                   f"{took:.0f} s |")
            rows.append(row)
            print(row, flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="*", help=f"from {', '.join(CASES)} (--relay: {', '.join(RELAY_CASES)})")
    parser.add_argument("--topology", default="h100", help="a preset or a topology; --relay: several, comma separated")
    parser.add_argument("--relay", action="store_true", help="issue #48's fleet: the relay chooser's picks")
    parser.add_argument("--out", help="write PREFIX.md and PREFIX.json (--relay: PREFIX.md)")
    args = parser.parse_args(argv)
    if args.relay:
        rows = relay_rows(args.cases or list(RELAY_CASES), args.topology.split(","))
        if args.out:
            with open(f"{args.out}.md", "w") as f:
                f.write("# Relay fleet: simulated, chosen by choose_relay\n\n`python benchmarks/simulate_cases.py "
                        f"--relay --topology {args.topology}`\n\n" + "\n".join(rows) + "\n")
        return 0
    args.cases = args.cases or list(CASES)
    topology = Topology.parse(args.topology)
    rows = []
    header = ("| case | forwarding | predicted | receiver-side bound | sender-side bound | / receiver bound | "
              "/ larger bound | forwarding part | forwarded |")
    lines = [f"Simulated on `--topology {args.topology}` ({topology}); CUDA bucket (512 MiB).", "", header,
             "|---|---|---|---|---|---|---|---|---|"]
    print(header, flush=True)
    for name in args.cases:
        case = CASES[name]
        for forward in (False, True):
            p = predict(case, topology, forward)
            rows.append({"case": name, **asdict(case), "forward": forward, **asdict(p),
                         "over_receiver_bound": p.over_receiver_bound, "over_larger_bound": p.over_larger_bound})
            line = " | ".join([f"| {name}", "on" if forward else "off", f"{p.predicted_ms:.1f} ms",
                               f"{p.receiver_bound_ms:.1f} ms", f"{p.sender_bound_ms:.1f} ms",
                               f"{p.over_receiver_bound:.2f}", f"{p.over_larger_bound:.2f}",
                               f"{p.forwarding_ms:.1f} ms", f"{p.forwarded_gib:.1f} GiB |"])
            lines.append(line)
            print(line, flush=True)
    if args.out:
        with open(f"{args.out}.md", "w") as f:
            f.write("# Simulated refit times against their bounds\n\n`python benchmarks/simulate_cases.py "
                    f"--topology {args.topology}`\n\n" + "\n".join(lines) + "\n")
        with open(f"{args.out}.json", "w") as f:
            json.dump({"topology": asdict(topology), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
