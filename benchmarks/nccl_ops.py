"""How NCCL's per-operation cost depends on how a step's bytes are posted (GPU 0 -> GPU 1).

``refit bench`` compares refit with the wire: one NCCL send of the whole model. Refit posts a step as many
operations (its messages), grouped per round and spread over ``comms_per_link`` communicators. This
measures, on the same bytes, what each way of posting N operations costs beside one operation:

- ``group``: all N in one NCCL group on one communicator (``refit bench``'s ``wire@ops=N``);
- ``serial``: N groups of one operation, one after another on one communicator and stream;
- ``alternate K``: N groups of one operation, the i-th on communicator ``i % K`` (each its own stream);
- ``rounds R, K``: the operations cut into R rounds, each round one group per communicator (refit's way);
- ``header``: one 48-byte exchange both ways and a host wait (refit's step header), alone.

Operations are cut at 1 MiB boundaries (refit's messages are 16-byte aligned). NCCL alone: the buffers are
not checked (``refit bench`` checks refit's bytes). It also prints the device memory each communicator takes
once it has moved bytes to the peer (``cudaMemGetInfo`` before and after; the first also holds NCCL's own
setup).

    python benchmarks/nccl_ops.py --gib 14.96 --ops 1,32,173 --out results.md
"""

from __future__ import annotations

import argparse
import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from refit_core.kit.launch import free_port
from refit_core.net.transport.nccl import open_comm
from refit_core.tools.bench.copybound import median_seconds

WARMUP = 2


def _rank(rank: int, args: argparse.Namespace, port: int, results: dict) -> None:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=120))
    peer = 1 - rank
    comms, streams, memory = [], [], []
    probe = torch.zeros(1 << 20, dtype=torch.uint8, device=device)
    for k in range(4):
        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info(device)[0]
        comms.append(open_comm(store, f"ops/{k}", 2, rank, device))
        streams.append(torch.cuda.Stream(device))
        sends, recvs = ([(peer, probe)], []) if rank == 0 else ([], [(peer, probe)])
        comms[k].post(sends, recvs, streams[k])
        torch.cuda.synchronize()
        memory.append(free_before - torch.cuda.mem_get_info(device)[0])
    nbytes = int(args.gib * (1 << 30)) // (1 << 20) * (1 << 20)
    data = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def post(comm, parts, stream) -> None:
        if rank == 0:
            comm.post([(peer, p) for p in parts], [], stream)
        else:
            comm.post([], [(peer, p) for p in parts], stream)

    def run(groups: list[tuple[int, list[torch.Tensor]]]) -> None:
        current = torch.cuda.current_stream(device)
        used = {k for k, _ in groups}
        for k in used:
            streams[k].wait_stream(current)
        for k, parts in groups:
            post(comms[k], parts, streams[k])
        for k in used:
            current.wait_stream(streams[k])

    out = []
    for n in args.ops:
        cuts = [i * (nbytes >> 20) // n << 20 for i in range(1, n)]
        parts = list(data.tensor_split(cuts))
        patterns = {
            "group": [(0, parts)],
            "serial": [(0, [p]) for p in parts],
            "alternate 2": [(i % 2, [p]) for i, p in enumerate(parts)],
            "alternate 4": [(i % 4, [p]) for i, p in enumerate(parts)],
        }
        rounds = max(1, min(n, args.rounds))
        per_round = [parts[r * n // rounds:(r + 1) * n // rounds] for r in range(rounds)]
        patterns[f"rounds {rounds}, 2"] = [(k, [p for i, p in enumerate(msgs) if i % 2 == k])
                                         for msgs in per_round for k in (0, 1) if len(msgs) > k]
        for name, groups in patterns.items():
            if n == 1 and name != "group":
                continue
            seconds = median_seconds(lambda: run(groups), args.iters, device, warmup=WARMUP)
            out.append((n, name, seconds))
    header = torch.zeros(6, dtype=torch.int64, device=device)
    theirs = torch.zeros(6, dtype=torch.int64, device=device)

    def exchange_header() -> None:
        comms[0].post([(peer, header)], [(peer, theirs)], streams[0])
        streams[0].synchronize()
        theirs.tolist()

    out.append((1, "header", median_seconds(exchange_header, args.iters * 10, device, warmup=WARMUP)))
    results[f"memory{rank}"] = memory
    if rank == 0:
        results["rows"] = out
    for comm in comms:
        comm.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=14.96, help="bytes per step, GiB (Llama-3-8B: 14.96)")
    parser.add_argument("--ops", type=lambda s: [int(x) for x in s.split(",")], default=[1, 32, 173])
    parser.add_argument("--rounds", type=int, default=32)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank, args=(args, free_port(), results), nprocs=2)
        rows = results["rows"]
        memory = [results["memory0"], results["memory1"]]
    base = next(s for n, name, s in rows if n == 1 and name == "group")
    lines = [f"# NCCL operation patterns: {torch.cuda.get_device_name(0)} x2, {args.gib} GiB per step, "
             f"median of {args.iters}", "", "| ops | pattern | ms | x one op | per extra op (us) |",
             "|---:|---|---:|---:|---:|"]
    for n, name, seconds in rows:
        extra = (seconds - base) / (n - 1) * 1e6 if n > 1 else 0.0
        ratio = base / seconds if name != "header" else float("nan")
        lines.append(f"| {n} | {name} | {seconds * 1e3:.3f} | {ratio:.3f} | {extra:.1f} |")
    lines += ["", "Device memory per communicator after its first bytes (MiB), sender / receiver: "
              + ", ".join(f"{a / 2**20:.0f} / {b / 2**20:.0f}" for a, b in zip(*memory))]
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
