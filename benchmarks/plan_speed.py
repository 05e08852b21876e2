"""Planning time and memory at scale: ``python benchmarks/plan_speed.py [--reference] [CASE ...]``.

Each case runs ``refit plan``'s metadata planning (:func:`refit_core.metaplan.plan_from_metadata`:
every rank's pieces from the plugins' layout hooks, the array planner, the schedule) in a fresh
process, so its peak memory is its own, and prints wall and CPU seconds (CPU time is the one-core
cost on a shared machine), the layout hooks' share, peak RSS and the fingerprint. ``--reference``
also times the reference planner (``refit_core.planner``) and the schedule on the same pieces, side
by side, and checks that both fingerprints agree. Runs on CPU; no GPU is needed.
"""

from __future__ import annotations

import argparse
import json
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


CASES = {
    "qwen3-30b-a3b-1024": Case("qwen3-30b-a3b-shape", "dtensor:fsdp=128,tp=8", "vllm:tp=8"),
    "qwen3-30b-a3b-128": Case("qwen3-30b-a3b-shape", "dtensor:fsdp=16,tp=8", "vllm:tp=8"),
    # the published layouts (NeMo-RL DeepSeek-V3 PP16 x EP16 -> TP32 x DP8; Kimi-K2 256 -> 128 GPUs):
    # 61 layers over PP16 as megatron's uneven pipeline, 3 + 14 x 4 + 2 (MTP on the last stage)
    "deepseek-v3": Case("deepseek-v3-shape", "megatron:pp=16,pp_first=3,pp_last=2,dp=16,ep=16",
                        "vllm:tp=32,dp=8,ep=256", True),
    "kimi-k2": Case("kimi-k2-shape", "megatron:pp=16,pp_first=3,pp_last=2,dp=16,ep=16", "vllm:tp=8,dp=16,ep=128"),
    # what plans today: the same models without pipeline stages, 16 -> 16 ranks
    "deepseek-v3-16": Case("deepseek-v3-shape", "megatron:dp=16,ep=16", "vllm:tp=16,ep=16", True),
    "kimi-k2-16": Case("kimi-k2-shape", "megatron:dp=16,ep=16", "vllm:tp=16,ep=16"),
}
HEADLINE = ["qwen3-30b-a3b-1024", "deepseek-v3", "kimi-k2", "deepseek-v3-16", "kimi-k2-16"]


def run_case(name: str, reference: bool) -> dict:
    """One case in this process (the child's side)."""
    import gc

    from refit_core.experts import group_side
    from refit_core.gcpause import gc_paused
    from refit_core.layout import parse_backend_layout
    from refit_core.metaplan import plan_from_metadata
    from refit_core.models import load_config
    from refit_core.options import RefitOptions
    from refit_core.pieces import DestinationPiece
    from refit_core.planner import plan_transfers
    from refit_core.plugins import get_plugin_manager
    from refit_core.schedule import build_schedule

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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="*", help=f"of {', '.join(CASES)} (default: {', '.join(HEADLINE)})")
    parser.add_argument("--reference", action="store_true", help="time the reference planner side by side")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        from refit_core.errors import RefitError

        try:
            print(json.dumps(run_case(args.child, args.reference)))
        except (RefitError, ValueError, KeyError) as exc:  # the case cannot plan: say why, as data
            print(json.dumps({"case": args.child, "error": f"{type(exc).__name__}: {exc}"}))
        return 0
    failed = False
    for name in args.cases or HEADLINE:
        if name not in CASES:
            parser.error(f"unknown case {name!r}; known: {', '.join(CASES)}")
        cmd = [sys.executable, __file__, "--child", name] + (["--reference"] if args.reference else [])
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if not lines:
            print(f"{name}: no result (exit {done.returncode}): {done.stderr.strip()[-400:]}")
            failed = True
            continue
        r = json.loads(lines[-1])
        model, train, gen = CASES[name].model, CASES[name].train, CASES[name].gen
        if "error" in r:
            print(f"{name}: {model} {train} -> {gen}: cannot plan: {r['error'][:300]}")
            failed = True
            continue
        print(f"{name}: {model} {train} ({r['train_ranks']}) -> {gen} ({r['gen_ranks']}), {r['segments']} segments: "
              f"{r['seconds']:.2f} s wall, {r['cpu_s']:.2f} s CPU (layout hooks {r['describe_cpu_s']:.2f} s, "
              f"planner and schedule {r['cpu_s'] - r['describe_cpu_s']:.2f} s), "
              f"peak RSS {r['peak_rss_bytes'] / 2**30:.2f} GiB, fingerprint {r['fingerprint']}")
        if args.reference:
            same = r["reference_fingerprint"] == r["fingerprint"]
            planner = r["cpu_s"] - r["describe_cpu_s"]
            print(f"  reference planner + schedule on the same pieces: {r['reference_cpu_s']:.2f} s CPU vs "
                  f"{planner:.2f} s CPU here: {r['reference_cpu_s'] / max(planner, 1e-9):.1f}x; "
                  f"fingerprints {'equal' if same else 'DIFFER: ' + r['reference_fingerprint']}")
            failed |= not same
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
