"""Live setup time against world size, on this machine (CPU, gloo, the toy plugin).

For each world size N, N processes (N/2 train ranks of ``ToyTrainer``, N/2 gen ranks of
``ToyEngine``, both from ``tests/example_plugin``) import everything, wait until all are ready,
then run ``setup()`` and one verified step. Every rank reports its :class:`~refit_core.run.timing.SetupTimes`
(pieces, metadata exchange, plan, fingerprint agreement, transport, bind) and the bytes it read from
the rendezvous store. Printed: per world size, the slowest rank's total and each phase's slowest rank;
the planner's (train rank 0's) own planning time and download; and the largest download of any other
rank (its part of the plan). The planner's time and every rank's bytes do not depend on how many cores
the machine has; the wall-clock phases do.

    .venv/bin/python benchmarks/setup_scaling.py --worlds 2,4,8,16,32 --out benchmarks/results/setup-scaling-cpu

The machine's core count bounds what this shows: with more processes than cores, ranks wait for
the CPU, not for each other's data (the ``metadata`` and ``agree`` phases absorb that wait).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from datetime import datetime, timezone
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "example_plugin"))

PHASES = ("pieces_s", "metadata_s", "plan_s", "agree_s", "transport_s", "bind_s")


def _rank(rank: int, world: int, address: str, ready_dir: str, timeout_s: float) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    from refit_toy.demo import reference
    from refit_toy.models import ToyEngine, ToyTrainer

    from refit_core import RefitOptions, RefitReceiver, RefitSender
    from refit_core.kit.verify import mismatches

    train_world = world // 2
    train = rank < train_world
    local, size = (rank, train_world) if train else (rank - train_world, world - train_world)
    options = RefitOptions(timeout_s=timeout_s)
    model: Any = ToyTrainer(local, size) if train else ToyEngine(local, size)
    endpoint = (RefitSender if train else RefitReceiver)(model, rendezvous=address, rank=local, world_size=size,
                                                          options=options)
    open(os.path.join(ready_dir, str(rank)), "w").close()  # start together: after every rank's imports
    while len(os.listdir(ready_dir)) < world:
        time.sleep(0.01)
    began = time.perf_counter()
    schedule = endpoint.setup()
    setup_wall = time.perf_counter() - began
    own = (schedule.rounds_of_source if train else schedule.rounds_of_destination)(local)
    messages = [m for msgs in own for m in msgs]
    bad: list[str] = []
    if train:
        model.load(reference(0, 0))
        endpoint.send(version=0)
    else:
        endpoint.receive()
        bad = mismatches(endpoint.plugins.destination_map(model).pieces, reference(0, 0))
    times = endpoint.setup_times
    endpoint.close()
    assert times is not None
    return {"rank": rank, "side": "train" if train else "gen", "setup_wall_s": setup_wall,
            "times": times.to_json(), "mismatches": bad, "messages": len(messages),
            "segments": sum(len(m.src_segments) for m in messages),
            "peers": len({m.dst if train else m.src for m in messages})}


def measure(world: int, timeout_s: float) -> dict[str, Any]:
    from refit_core.kit.launch import free_port, spawn

    with tempfile.TemporaryDirectory() as ready:
        started = time.perf_counter()
        ranks = spawn(_rank, world, f"127.0.0.1:{free_port()}", ready, timeout_s, timeout_s=timeout_s * 3)
        wall = time.perf_counter() - started
    bad = [r["rank"] for r in ranks if r["mismatches"]]
    if bad:
        raise SystemExit(f"setup_scaling: world {world}: gen ranks {bad} got wrong bytes")
    slowest = {p: max(r["times"][p] or 0.0 for r in ranks) for p in PHASES}
    (planner,) = [r for r in ranks if r["times"]["planner"]]
    others = [r for r in ranks if not r["times"]["planner"]]
    return {"world": world, "setup_s": max(r["setup_wall_s"] for r in ranks),
            "setup_total_s": max(r["times"]["total_s"] for r in ranks), "slowest_phase_s": slowest,
            "planner_plan_s": planner["times"]["plan_s"], "planner_read_bytes": planner["times"]["metadata_bytes"],
            "other_plan_s_max": max(r["times"]["plan_s"] for r in others),
            "other_read_bytes_max": max(r["times"]["metadata_bytes"] for r in others),
            "other_read_bytes_min": min(r["times"]["metadata_bytes"] for r in others),
            "other_segments_max": max(r["segments"] for r in others),
            "other_peers_max": max(r["peers"] for r in others),
            "plan_segments": sum(r["segments"] for r in ranks if r["side"] == "train"), "wall_s": wall, "ranks": ranks}


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| world | setup (slowest rank) | pieces | metadata | planner: plan | others: plan (wait + check) "
             "| agree | transport | bind (gen: 1st step) | planner read | others read (max) "
             "| others' own segments / peers (max) | plan segments |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        s = row["slowest_phase_s"]
        phases = [s["pieces_s"], s["metadata_s"], row["planner_plan_s"], row["other_plan_s_max"], s["agree_s"],
                  s["transport_s"], s["bind_s"]]
        lines.append(f"| {row['world']} | {row['setup_s']:.2f} s | " + " | ".join(f"{v:.3f}" for v in phases)
                     + f" | {row['planner_read_bytes'] / 1024:.1f} KiB"
                     + f" | {row['other_read_bytes_max'] / 1024:.1f} KiB"
                     + f" | {row['other_segments_max']} / {row['other_peers_max']} | {row['plan_segments']} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", default="2,4,8,16,32")
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--out", default=None, help="write PREFIX.json and PREFIX.md")
    args = parser.parse_args()
    rows = []
    for world in (int(w) for w in args.worlds.split(",")):
        print(f"setup_scaling: world {world} ...", file=sys.stderr, flush=True)
        rows.append(measure(world, args.timeout_s))
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    text = table(rows)
    print(text)
    if args.out:
        meta = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "host": platform.node(),
                "cpus": os.cpu_count(), "python": platform.python_version(),
                "command": "python benchmarks/setup_scaling.py " + " ".join(sys.argv[1:])}
        with open(args.out + ".json", "w") as f:
            json.dump({**meta, "rows": rows}, f, indent=1)
        with open(args.out + ".md", "w") as f:
            f.write(f"# Live setup time vs world size (CPU machine, {meta['cpus']} cores, gloo, toy plugin), "
                    f"{meta['date']}\n\nCommand: `{meta['command']}`\n\n{text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
