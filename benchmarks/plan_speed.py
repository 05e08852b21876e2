"""Planning time and memory at scale: ``python benchmarks/plan_speed.py [--reference] [CASE ...]``.

Each case runs ``refit plan``'s metadata planning (:func:`refit_core.plan.offline.plan_from_metadata`:
every rank's pieces from the plugins' layout hooks, the array planner, the schedule) in a fresh
process, so its peak memory is its own, and prints wall and CPU seconds (CPU time is the one-core
cost on a shared machine), the layout hooks' share, peak RSS and the fingerprint. ``--reference``
also times the reference planner (``refit_core.plan.reference``) and the schedule on the same pieces, side
by side, and checks that both fingerprints agree. ``--against DIR`` runs every case with another
checkout (an older commit) too, alternating runs so both see the same load on a shared machine, and
prints the ratio of CPU seconds. Runs on CPU; no GPU is needed.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Case:
    """A planning case; ``unused_ok`` where the train side holds tensors no engine rank takes (MTP)."""

    model: str
    train: str
    gen: str
    unused_ok: bool = False
    target_s: float | None = None
    """Issue #16's goal: CPU seconds on one core (and ``target_gib`` of peak RSS); None: no goal."""
    target_gib: float | None = None


CASES = {
    "qwen3-30b-a3b-1024": Case("qwen3-30b-a3b-shape", "dtensor:fsdp=128,tp=8", "vllm:tp=8", target_s=5.0),
    "qwen3-30b-a3b-128": Case("qwen3-30b-a3b-shape", "dtensor:fsdp=16,tp=8", "vllm:tp=8"),
    # the published layouts (NeMo-RL DeepSeek-V3 PP16 x EP16 -> TP32 x DP8; Kimi-K2 256 -> 128 GPUs):
    # 61 layers over PP16 as megatron's uneven pipeline, 3 + 14 x 4 + 2 (MTP on the last stage)
    "deepseek-v3": Case("deepseek-v3-shape", "megatron:pp=16,pp_first=3,pp_last=2,dp=16,ep=16",
                        "vllm:tp=32,dp=8,ep=256", True, target_s=10.0, target_gib=4.0),
    "kimi-k2": Case("kimi-k2-shape", "megatron:pp=16,pp_first=3,pp_last=2,dp=16,ep=16", "vllm:tp=8,dp=16,ep=128",
                    target_s=10.0, target_gib=4.0),
    # what plans today: the same models without pipeline stages, 16 -> 16 ranks
    "deepseek-v3-16": Case("deepseek-v3-shape", "megatron:dp=16,ep=16", "vllm:tp=16,ep=16", True),
    "kimi-k2-16": Case("kimi-k2-shape", "megatron:dp=16,ep=16", "vllm:tp=16,ep=16"),
}
HEADLINE = ["qwen3-30b-a3b-1024", "qwen3-30b-a3b-128", "deepseek-v3", "kimi-k2", "deepseek-v3-16", "kimi-k2-16"]


def run_case(name: str, reference: bool) -> dict:
    """One case in this process (the child's side)."""
    import gc

    from refit_core.contract.experts import group_side
    from refit_core.contract.layout import parse_backend_layout
    from refit_core.contract.options import RefitOptions
    from refit_core.contract.pieces import DestinationPiece
    from refit_core.contract.plugins import get_plugin_manager
    from refit_core.kit.models import load_config
    from refit_core.plan.gcpause import gc_paused
    from refit_core.plan.offline import plan_from_metadata
    from refit_core.plan.reference import plan_transfers
    from refit_core.plan.schedule import build_schedule

    case = CASES[name]
    model, train, gen = case.model, case.train, case.gen
    pm = get_plugin_manager()
    config = load_config(model)
    train_backend, train_layout = parse_backend_layout(train)
    gen_backend, gen_layout = parse_backend_layout(gen)
    options = RefitOptions(allow_unused_sources=case.unused_ok)
    # the plugins' one-off work per config (imports, a meta-device model) is not planning: warm it
    pm.source_layout(train_backend, config, train_layout, 0)
    pm.destination_layout(gen_backend, config, gen_layout, 0)
    gc.collect()
    summary = plan_from_metadata(pm, config, train_backend, train_layout, gen_backend, gen_layout, options=options)
    out = {"case": name, "model": model, "train": train, "gen": gen, "seconds": summary.seconds,
           "cpu_s": summary.cpu_s, "describe_cpu_s": summary.describe_cpu_s, "peak_rss_bytes": summary.peak_rss_bytes,
           "fingerprint": summary.schedule.fingerprint, "segments": summary.schedule.summary.segments,
           "train_ranks": summary.train_ranks, "gen_ranks": summary.gen_ranks}
    if reference:
        settings = options.resolved("cpu")
        assert settings.bucket_bytes is not None
        with gc_paused():
            src = group_side([[p.meta for p in pm.source_layout(train_backend, config, train_layout, r)]
                              for r in range(train_layout.world_size)], pm.expert_name)
            dst = group_side([[p.meta for p in m.pieces] + [DestinationPiece(s, s.full_box()).meta for s in m.loader]
                              for m in (pm.destination_layout(gen_backend, config, gen_layout, r)
                                        for r in range(gen_layout.world_size))], pm.expert_name)
            start, cpu = time.perf_counter(), time.process_time()
            transfers = plan_transfers(src.metas, dst.metas, cast=settings.cast,
                                       allow_unused_sources=settings.allow_unused_sources)
            schedule = build_schedule(transfers, len(src.metas), len(dst.metas), settings.bucket_bytes,
                                      settings.messages, expert_groups=set(src.counts) | set(dst.counts),
                                      agreed_settings=settings.digest())
        out.update(reference_seconds=time.perf_counter() - start, reference_cpu_s=time.process_time() - cpu,
                   reference_fingerprint=schedule.fingerprint)
    return out


def _vs_target(case: Case, r: dict) -> str:
    """``; target <= 5 s CPU: met (0.82x)`` for a case with a goal, else nothing."""
    if case.target_s is None:
        return ""
    parts = [f"{r['cpu_s'] / case.target_s:.2f}x of <= {case.target_s:g} s CPU"]
    met = r["cpu_s"] <= case.target_s
    if case.target_gib is not None:
        gib = r["peak_rss_bytes"] / 2**30
        parts.append(f"{gib / case.target_gib:.2f}x of <= {case.target_gib:g} GiB")
        met &= gib <= case.target_gib
    return f"; target: {', '.join(parts)}: {'met' if met else 'NOT met'}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="*", help=f"of {', '.join(CASES)} (default: {', '.join(HEADLINE)})")
    parser.add_argument("--reference", action="store_true", help="time the reference planner side by side")
    parser.add_argument("--against", metavar="DIR",
                        help="also run each case with another checkout's refit_core and plugins (e.g. "
                             "`git worktree add /tmp/base main`), alternating, and print the CPU ratio")
    parser.add_argument("--repeat", type=int, default=2, help="runs of each side with --against (default 2)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        from refit_core.contract.errors import RefitError

        try:
            print(json.dumps(run_case(args.child, args.reference)))
        except (RefitError, ValueError, KeyError) as exc:  # the case cannot plan: say why, as data
            print(json.dumps({"case": args.child, "error": f"{type(exc).__name__}: {exc}"}))
        return 0
    failed = False
    for name in args.cases or HEADLINE:
        if name not in CASES:
            parser.error(f"unknown case {name!r}; known: {', '.join(CASES)}")
        runs = [_child(name, args.reference)]
        theirs = []
        for _ in range(args.repeat if args.against else 0):  # alternating, so both see the same load
            theirs.append(_child(name, False, args.against))
            runs.append(_child(name, args.reference))
        r = min((x for x in runs if "error" not in x), key=lambda x: x["cpu_s"], default=runs[0])
        model, train, gen = CASES[name].model, CASES[name].train, CASES[name].gen
        if "error" in r:
            print(f"{name}: {model} {train} -> {gen}: cannot plan: {r['error'][:300]}")
            failed = True
            continue
        print(f"{name}: {model} {train} ({r['train_ranks']}) -> {gen} ({r['gen_ranks']}), {r['segments']} segments: "
              f"{r['seconds']:.2f} s wall, {r['cpu_s']:.2f} s CPU (layout hooks {r['describe_cpu_s']:.2f} s, "
              f"planner and schedule {r['cpu_s'] - r['describe_cpu_s']:.2f} s), "
              f"peak RSS {r['peak_rss_bytes'] / 2**30:.2f} GiB, fingerprint {r['fingerprint']}"
              f"{_vs_target(CASES[name], r)}")
        if len(runs) > 1:
            print(f"  (the run with the least CPU of {len(runs)}, alternating with {args.against})")
        if args.reference:
            same = r["reference_fingerprint"] == r["fingerprint"]
            planner = r["cpu_s"] - r["describe_cpu_s"]
            print(f"  reference planner + schedule on the same pieces: {r['reference_cpu_s']:.2f} s CPU vs "
                  f"{planner:.2f} s CPU here: {r['reference_cpu_s'] / max(planner, 1e-9):.1f}x; "
                  f"fingerprints {'equal' if same else 'DIFFER: ' + r['reference_fingerprint']}")
            failed |= not same
        if theirs:
            ok = [x for x in theirs if "error" not in x]
            if not ok:
                print(f"  {args.against}: cannot plan: {theirs[0]['error'][:200]}")
                continue
            base = min(ok, key=lambda x: x["cpu_s"])
            print(f"  {args.against}: {base['cpu_s']:.2f} s CPU (layout hooks {base['describe_cpu_s']:.2f} s), "
                  f"peak RSS {base['peak_rss_bytes'] / 2**30:.2f} GiB, fingerprint {base['fingerprint']}; "
                  f"here {r['cpu_s']:.2f} s: {base['cpu_s'] / r['cpu_s']:.2f}x less CPU (least of {len(ok)} each)")
    return 1 if failed else 0


def _child(name: str, reference: bool, tree: str | None = None) -> dict:
    """One case in a fresh process; ``tree``: another checkout's ``refit_core`` and plugins instead."""
    cmd = [sys.executable, __file__, "--child", name] + (["--reference"] if reference else [])
    env = None
    if tree is not None:
        paths = [tree, *sorted(glob.glob(os.path.join(tree, "plugins", "*")))]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        return {"case": name, "error": f"no result (exit {done.returncode}): {done.stderr.strip()[-400:]}"}
    return json.loads(lines[-1])


if __name__ == "__main__":
    sys.exit(main())
