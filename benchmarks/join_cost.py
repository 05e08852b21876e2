"""What a replica joining a running fleet costs on its own side, at the Qwen3-30B-A3B shape (CPU, gloo).

``python benchmarks/join_cost.py``. One trainer (``RefitFleet``, Megatron-style with every expert its own
parameter: 18,867 tensors) and two vLLM-style replicas (TP1, stacked experts), from ``refit bench``'s synthetic
backends (:mod:`refit_core.tools.bench.layouts`). The shape keeps the model's tensor count and structure (48
layers, 128 experts, 4 query and 2 KV heads per layer) and shrinks every dimension (hidden 64, experts' 32),
so that the metadata, the plan and its messages are the real model's in number while the bytes fit a CPU.
Replica A joins before the first step; replica B joins the running job later, with the same layout (its plan
is train rank 0's second of that layout). For each, the joiner's own setup phases (``setup_times()``: its
pieces, the metadata exchange, the wait for its part of the plan, the agreement, the transport: its planning and
setup) against the goal of 2 s, and its first step's bind (part of that step); and train rank 0's setup of each
replica's job. Every step is checked bitwise on the replicas.

``--relay``: the trainers feed replica A only (``FleetOptions(direct=1)``), and replica B joins under A, which
forwards it each step (:mod:`refit_core.fleet.mirror`): B's job is planned by A's rank 0, from A's pieces.
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
from typing import Any

BASE = "qwen3-30b-a3b-shape"
SHRUNK = {"hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512}
GOAL_S = 2.0
FINAL = 4
"""The last version the trainer sends (replica B joins after replica A's first)."""


def config() -> dict[str, Any]:
    from refit_core.apps import load_config

    return {**load_config(BASE), **SHRUNK}


def _phases(times: Any) -> dict[str, float]:
    return {name: getattr(times, f"{name}_s") for name in ("pieces", "metadata", "plan", "agree", "transport")}


def _rank(rank: int, nprocs: int, address: str, folder: str, relay: bool) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    from refit_core import RefitOptions
    from refit_core.apps import RefitFleet, join_fleet
    from refit_core.tools.bench import layouts

    plugins = layouts.register()
    options = RefitOptions(timeout_s=300, bucket_bytes=64 << 20, fleet={"direct": 1 if relay else 0})
    cfg = config()
    if rank == 0:
        model = layouts.MegatronSequentialStyleModel(cfg, tp=1, rank=0, device="cpu")
        fleet = RefitFleet(model, rendezvous=address, rank=0, world_size=1, options=options, plugins=plugins)
        fleet.open()
        steps, planned, version, b_asked = [], {}, 0, False
        while version <= FINAL:
            model.fill(version)
            step = fleet.send(version)
            steps.append((version, list(step.landed), list(step.joined)))
            for name in step.joined:
                if name in fleet._senders:
                    planned[name] = _phases(fleet._senders[name][1].setup_times)
            if "a" in step.landed and not b_asked:  # replica B joins the running job before the next step
                open(os.path.join(folder, "b-joins"), "w").close()
                time.sleep(2.0)
                b_asked = True
            version += 1 if step.landed else 0
        fleet.close()
        return {"tensors": len(model.params), "pieces": len(model.pieces), "steps": steps, "planner": planned,
                "plans": (fleet.plans.misses, fleet.plans.hits)}
    name = "a" if rank == 1 else "b"
    engine = layouts.VllmStyleModel(cfg, tp=1, rank=0, device="cpu")
    if name == "b":
        while not os.path.exists(os.path.join(folder, "b-joins")):
            time.sleep(0.01)
    start = time.perf_counter()
    receiver = join_fleet(engine, fleet=address, replica=name, rank=0, world_size=1, options=options,
                          plugins=plugins, join_timeout_s=300)
    joined_s = time.perf_counter() - start
    setup = _phases(receiver.setup_times)
    held = []
    while not held or held[-1][0] < FINAL:
        receiver.receive()
        held.append((receiver.version, not engine.mismatches(receiver.version)))
    bind = receiver.setup_times.bind_s
    fed = {child: _phases(mirror.setup_times) for child, mirror in receiver._feeding.items()}
    receiver.close()
    return {"replica": name, "setup": setup, "bind_s": bind, "join_call_s": joined_s, "held": held,
            "tensors": len(engine.params), "fed": fed, "feeder": receiver.member.feeder}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--relay", action="store_true", help="replica B is fed by replica A, not the trainers")
    args = parser.parse_args()
    from refit_core.apps import free_port, spawn

    folder = tempfile.mkdtemp(prefix="refit-join-")
    address = f"127.0.0.1:{free_port()}"
    results = spawn(_rank, 3, address, folder, args.relay, env={"REFIT_PLUGINS": "none"}, timeout_s=900)
    trainer = results[0]
    print(f"{BASE} with dims shrunk ({SHRUNK}): trainer {trainer['tensors']:,} parameters holding "
          f"{trainer['pieces']:,} pieces, replicas {results[1]['tensors']:,} parameters each; "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs\n")
    print("| replica | joined at | pieces | metadata | plan (wait) | agree | transport | setup | first bind | goal |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results[1:]:
        s = r["setup"]
        total = sum(s.values())
        when = "first step" if r["replica"] == "a" else "a later step (running job)"
        when += f", fed by {r['feeder']}" if r["feeder"] else ""
        print(f"| {r['replica']} | {when} | {s['pieces']:.3f} s | {s['metadata']:.3f} s | {s['plan']:.3f} s | "
              f"{s['agree']:.3f} s | {s['transport']:.3f} s | **{total:.3f} s** | {r['bind_s']:.3f} s | "
              f"< {GOAL_S:g} s {'✓' if total < GOAL_S else '✗'} |")
    print("\ntrain rank 0's setup of each replica's job (its plan phase plans):")
    for name, p in trainer["planner"].items():
        print(f"  {name}: " + ", ".join(f"{k} {v:.3f} s" for k, v in p.items()))
    print("train rank 0's plans: %d planned, %d reused" % trainer["plans"])
    for r in results[1:]:
        for child, p in r["fed"].items():
            print(f"replica {r['replica']}'s setup of the job feeding {child} (its plan phase plans): "
                  + ", ".join(f"{k} {v:.3f} s" for k, v in p.items()))
    print("\nsteps (version, landed, joined):", trainer["steps"])
    ok = all(bitwise for r in results[1:] for _, bitwise in r["held"])
    print("every version held bitwise:", ok)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
