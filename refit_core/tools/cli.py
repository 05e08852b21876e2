"""The ``refit`` command line: ``plugins``, ``plan``, ``demo``, ``check-plugin``, ``status``, ``secret`` and
``bench``."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from refit_core.contract.errors import RefitError
from refit_core.contract.layout import parse_backend_layout
from refit_core.contract.lora import LoraSpec
from refit_core.contract.plugins import get_plugin_manager
from refit_core.kit.models import PRESETS, load_config
from refit_core.plan.choose import FORWARD_FLOORS, RELAY_BUCKETS
from refit_core.tools.demo.command import add_demo_command
from refit_core.units import format_bytes

if TYPE_CHECKING:
    from refit_core.contract.options import RelayOptions
    from refit_core.plan.choose import Planner, Prediction, RelayChoice

AUTO = "auto"

FLAGS = {"allow_unused_sources=True": "--allow-unused-sources"}
"""Library settings an error may name, and the flag that sets them here."""


def as_flags(message: str) -> str:
    """An error message as the command line says it: a setting it names becomes the flag that sets it."""
    for setting, flag in FLAGS.items():
        message = message.replace(setting, flag)
    return message


def cmd_plugins(args: argparse.Namespace) -> int:
    pm = get_plugin_manager()
    rows = [("plugin", "distribution", "version", "backends (sides)")]
    for info in pm.plugins:
        backends = ", ".join(f"{b.name} ({'+'.join(sorted(b.sides))})" for b in info.backends) or "-"
        rows.append((info.name, info.distribution, info.version, backends))
    for name, error in pm.broken.items():
        rows.append((name, "?", "?", f"BROKEN: {error}"))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[3])
    described = [b for info in pm.plugins for b in info.backends if b.description]
    if described:
        print()
        width = max(len(b.name) for b in described)
        for backend in described:
            print(f"  {backend.name.ljust(width)}  {backend.description}")
    if len(rows) == 1:
        print("(no refit plugins installed: pip install refit-plugin-dtensor refit-plugin-vllm ...)")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from refit_core.contract.options import RefitOptions, RelayOptions
    from refit_core.plan.choose import predicted_s, without_forwarding
    from refit_core.plan.offline import PlanSummary, plan_from_metadata
    from refit_core.plan.simulate import Topology
    from refit_core.tools.demo.runner import default_device

    train, train_layout = parse_backend_layout(args.train)
    gen, gen_layout = parse_backend_layout(args.gen)
    Topology.parse(args.topology)  # a bad --topology fails here, not after the whole plan
    given = _relay_settings(args.relay)
    choose_floor = args.forward_within_nodes and args.forward_min_bytes == AUTO
    choose_direct = "replicas" in given and "direct" not in given
    if args.forward_within_nodes:
        given["node_ranks"] = Topology.parse(args.topology).gpus_per_node
        if args.forward_min_bytes is not None and not choose_floor:
            given["forward_min_bytes"] = args.forward_min_bytes
    relay = RelayOptions(**given)
    simulating = bool(args.simulate or args.explain or choose_floor or choose_direct)
    bucket = None if args.bucket_mb is None else args.bucket_mb << 20
    config = load_config(args.model)

    lora = LoraSpec.parse(args.lora) if args.lora else None

    def plan(relay: RelayOptions, bucket_bytes: int | None = None, adapters: LoraSpec | None = lora) -> PlanSummary:
        return plan_from_metadata(get_plugin_manager(), config, train, train_layout, gen, gen_layout,
                                  options=RefitOptions(bucket_bytes=bucket_bytes or bucket, relay=relay,
                                                      allow_unused_sources=args.allow_unused_sources),
                                  device=args.device or ("cuda" if simulating else default_device()),
                                  progress=lambda line: print(f"refit plan: {line}", file=sys.stderr, flush=True),
                                  lora=adapters)

    summary = None
    unforwarded_s: float | None = None  # the prediction without forwarding, where a choice simulated it
    if choose_direct:
        choice = _choose_relay(plan, relay, args.topology, RELAY_BUCKETS if bucket is None else (None,))
        relay, summary = choice.relay, choice.plan
    if choose_floor:
        choice = _choose_forwarding(plan, relay, args.topology)
        relay, summary, unforwarded_s = choice.relay, choice.plan, choice.baseline.predicted_s
    if summary is None:
        summary = plan(relay)
    print(f"refit plan: {args.model}, {train}:{train_layout} -> {gen}:{gen_layout}")
    for line in summary.lines():
        print("  " + line)
    if lora is not None:
        print("  " + lora_line(lora, summary.schedule.summary.bytes, plan(relay, adapters=None).schedule.summary.bytes))
    forwarding = relay.node_ranks > 0
    if forwarding and summary.relay is None:
        print(f"  forwarding:   none: no region of at least {relay.forward_min_bytes} bytes is "
              "held by two gen ranks of one node")
    if args.simulate or args.explain:
        from refit_core.plan.simulate import anchor_lines, simulate
        from refit_core.units import format_duration

        topology = Topology.parse(args.topology)
        simulation = simulate(summary.schedule, topology, relay=summary.relay)
        print("refit plan: simulated (disaggregated placement: gen ranks on the nodes after the train ranks')")
        for line in [*simulation.lines(), *anchor_lines()]:
            print("  " + line)
        if forwarding and summary.relay is not None:
            if unforwarded_s is None:
                unforwarded_s = predicted_s(plan(without_forwarding(relay)), topology)
            speedup = unforwarded_s / simulation.predicted_s
            verdict = (f"forwarding is {speedup:.2f}x faster" if speedup >= 1 else
                       f"forwarding is {1 / speedup:.2f}x slower: run without it, or raise --forward-min-bytes")
            print("refit plan: without forwarding within nodes the same refit predicts "
                  f"{format_duration(unforwarded_s)}; {verdict}")
        if args.explain:
            from refit_core.tools.pictures import write_plan_picture

            title = f"{args.model}: {train}:{train_layout} -> {gen}:{gen_layout}"
            path = write_plan_picture(summary.schedule, simulation, args.explain, title)
            print(f"refit plan: picture written to {path}")
    return 0


def lora_line(lora: LoraSpec, lora_bytes: int, full_bytes: int) -> str:
    """The LoRA refit's bytes per step beside the full model's."""
    share = lora_bytes / full_bytes if full_bytes else 0.0
    return (f"lora:         {lora.mode.value} mode, r={lora.rank}, targets {','.join(lora.targets)}: "
            f"{format_bytes(lora_bytes)} per step vs {format_bytes(full_bytes)} for the full model "
            f"({share:.2%})")


def _relay_settings(text: str | None) -> dict[str, Any]:
    """``--relay replicas=32,direct=8,fanout=1`` (or ``broadcast=1``) -> the settings given, for
    :class:`RelayOptions`."""
    if not text:
        return {}
    out: dict[str, Any] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, _, value = item.partition("=")
        if key not in ("replicas", "direct", "fanout", "broadcast") or not value.isdigit():
            raise RefitError(f"--relay item {item!r}: use replicas=N[,direct=N][,fanout=N][,broadcast=1]")
        out[key] = bool(int(value)) if key == "broadcast" else int(value)
    if out.get("broadcast"):
        out.setdefault("direct", 1)
    if "replicas" not in out:
        raise RefitError("--relay needs replicas=N (the gen ranks' identical replicas, e.g. the gen layout's dp)")
    return out


def _choose_relay(plan: Planner, relay: RelayOptions, topology: str, buckets: Sequence[int | None]) -> RelayChoice:
    """:func:`~refit_core.plan.choose.choose_relay`, printing each prediction and the choice."""
    from refit_core.plan.choose import choose_relay
    from refit_core.plan.simulate import Topology
    from refit_core.units import format_duration

    print(f"refit plan: relay trees vs direct fanout, {relay.replicas} replicas, simulated on {topology}:")

    def show(prediction: Prediction) -> None:
        assert prediction.predicted_s is not None  # every relay candidate is simulated
        print(f"  {prediction.label:<40} predicted {format_duration(prediction.predicted_s)}, "
              f"{prediction.predicted_s / prediction.bound_s:.2f}x the bound")

    choice = choose_relay(plan, relay, Topology.parse(topology), buckets=buckets, on_prediction=show)
    if choice.refused:
        print(f"  no relay: {choice.refused}")
    if choice.skipped:
        print(f"  {', '.join(map(str, choice.skipped))} roots: not planned (the trainers' share alone is slower)")
    best = choice.chosen
    verdict = "direct fanout wins" if choice.chose_baseline else f"relay wins, {choice.speedup:.2f}x faster than direct"
    print(f"  best: {best.label} (direct={choice.relay.direct}, fanout={choice.relay.fanout}): predicted "
          f"{format_duration(choice.predicted_s)}, {choice.predicted_s / best.bound_s:.2f}x the receiver-side bound "
          f"{format_duration(best.bound_s)} ({verdict})")
    return choice


def _forward_min_bytes(text: str) -> int | str:
    if text == AUTO:
        return AUTO
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: a number of bytes, or auto")
    return int(text)


def _choose_forwarding(plan: Planner, relay: RelayOptions, topology: str) -> RelayChoice:
    """:func:`~refit_core.plan.choose.choose_forwarding` over ``FORWARD_FLOORS``, printing each prediction
    and the choice."""
    from refit_core.plan.choose import choose_forwarding
    from refit_core.plan.simulate import Topology
    from refit_core.units import format_bytes, format_duration

    print(f"refit plan: forwarding within nodes of {relay.node_ranks} gen ranks, each floor simulated on "
          f"{topology}:")

    def show(prediction: Prediction) -> None:
        if prediction.baseline:
            assert prediction.predicted_s is not None  # the baseline is always simulated
            print(f"  {'no forwarding':<28} predicted {format_duration(prediction.predicted_s)}")
            return
        label = f"forward_min_bytes {format_bytes(prediction.relay.forward_min_bytes)}"
        if prediction.predicted_s is None:
            print(f"  {label:<28} nothing shared is that large")
            return
        print(f"  {label:<28} predicted {format_duration(prediction.predicted_s)}, "
              f"{format_bytes(prediction.forwarded_bytes)} forwarded")

    choice = choose_forwarding(plan, relay, Topology.parse(topology), floors=FORWARD_FLOORS, on_prediction=show)
    verdict = ("forwarding does not win" if choice.chose_baseline else
               f"forward_min_bytes {format_bytes(choice.relay.forward_min_bytes)}, "
               f"{choice.speedup:.2f}x faster than no forwarding")
    print(f"  best: {verdict}")
    return choice


def cmd_check_plugin(args: argparse.Namespace) -> int:
    from refit_core.testing.results import Outcome
    from refit_core.testing.runner import model_free_suite
    from refit_core.testing.static import model_free_checks

    suite = model_free_suite(args.name, args.model, args.train_layout, args.gen_layout)
    print(f"refit check-plugin: {suite.plugin} (backend {suite.backend}; models "
          f"{', '.join(m.name for m in suite.models)}), model-free checks", flush=True)
    results = model_free_checks(suite)
    for result in results:
        print(result.line())
    counts = {o: sum(r.outcome is o for r in results) for o in Outcome}
    print(f"refit check-plugin {suite.plugin}: {counts[Outcome.PASSED]} checks passed, "
          f"{counts[Outcome.FAILED]} failed, {counts[Outcome.SKIPPED]} skipped")
    return 1 if counts[Outcome.FAILED] else 0


def cmd_secret(args: argparse.Namespace) -> int:
    from refit_core.net.auth import new_secret

    print(new_secret())
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from refit_core.contract.options import RefitOptions
    from refit_core.fleet.status import fleet_table, read_fleet

    wanted = {"job": args.job} if args.job else {}
    status = read_fleet(args.rendezvous, RefitOptions(**wanted, **({"secret": args.secret} if args.secret else {})))
    if status.replicas:
        print(fleet_table(status.replicas))
    else:
        print(f"the fleet at {args.rendezvous} has no replicas yet (train rank 0 publishes its view after each step)")
    print(f"join requests so far: {status.join_requests}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    try:
        from refit_core.tools.bench import main as bench_main
    except ImportError as exc:
        raise RefitError(f"refit bench is unavailable: {exc}") from exc
    return bench_main(args.rest[1:] if args.rest[:1] == ["--"] else args.rest)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="refit", description="Move trained weights into inference engines.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress of setup and steps")
    sub = parser.add_subparsers(dest="command", required=True)

    sub.add_parser("plugins", help="list installed plugins and their backends").set_defaults(func=cmd_plugins)

    models = f"preset ({', '.join(PRESETS)}) or HF model directory / config.json"
    plan = sub.add_parser("plan", help="plan a refit from metadata alone and print its summary")
    plan.add_argument("--model", required=True, help=models)
    plan.add_argument("--train", required=True,
                      help="BACKEND:LAYOUT, e.g. dtensor:fsdp=2,tp=2; layout keys tp, pp, vpp, ep, etp, dp, fsdp, "
                           "and pp_first / pp_last (layers of megatron's first / last pipeline stage, "
                           "e.g. megatron:pp=16,pp_first=3,pp_last=2,dp=16,ep=16)")
    plan.add_argument("--gen", required=True, help="BACKEND:LAYOUT, e.g. vllm:tp=2,dp=2")
    plan.add_argument("--bucket-mb", type=int,
                      help="bucket size in MiB (default: a live refit's on --device: 512 on cuda, 64 on cpu)")
    plan.add_argument("--device", choices=("cpu", "cuda"),
                      help="device the live refit runs on, for its default bucket (default: cuda when present, or "
                           "when simulating a GPU cluster: --simulate, --explain, --relay without direct)")
    plan.add_argument("--simulate", action="store_true",
                      help="predict the refit's time on a cluster (--topology): per-link bytes, busiest link, "
                           "receiver- and sender-side bounds, published numbers beside it")
    plan.add_argument("--topology", default="h200",
                      help="h200, h100, or gpus_per_node=8,nvlink_gbps=370,nic_gbps=50,latency_us=15")
    plan.add_argument("--explain", metavar="PNG", help="draw the plan's traffic and busiest links into PNG")
    plan.add_argument("--allow-unused-sources", action="store_true",
                      help="plan although some train tensors have no destination (e.g. DeepSeek-V3's MTP "
                           "layer, which vLLM's main model does not hold)")
    plan.add_argument("--lora", metavar="r=N[,alpha=A][,targets=q,k,v,o,gate,up,down][,mode=merged]",
                      help="plan a LoRA refit: adapter mode moves only the adapters (derived from the model's "
                           "linear shapes), merged mode the merged weights; prints bytes per step beside the "
                           "full model's")
    plan.add_argument("--relay", metavar="replicas=N[,direct=N][,fanout=N][,broadcast=1]",
                      help="relay: the gen ranks form N identical replicas; the trainers feed `direct` of them and "
                           "every holder forwards each message, as soon as it landed, to `fanout` more (1: chains); "
                           "broadcast=1: the trainers' messages reach every replica in NCCL broadcasts; without "
                           "direct: simulate direct fanout, chains and trees with 1, 2, 4... roots (only the given "
                           "fanout where given) and the broadcast, and plan the fastest")
    plan.add_argument("--forward-within-nodes", action="store_true",
                      help="regions several gen ranks of one node hold (TP-replicated norms, MLA's q_a / kv_a) "
                           "cross the network once per node and are forwarded over NVLink "
                           "(RelayOptions.node_ranks = the topology's GPUs per node); with --simulate, also "
                           "predicts the refit without it")
    plan.add_argument("--forward-min-bytes", type=_forward_min_bytes, metavar="N|auto",
                      help="with --forward-within-nodes: smaller shared regions are fed to every holder "
                           "(RelayOptions.forward_min_bytes, default 1 MiB); auto simulates no forwarding and "
                           f"floors of {', '.join(str(f) for f in FORWARD_FLOORS)} bytes and plans the fastest")
    plan.set_defaults(func=cmd_plan)

    add_demo_command(sub, models)

    check = sub.add_parser("check-plugin", help="run the conformance kit's model-free checks on an installed plugin")
    check.add_argument("name", help="the plugin's name (as `refit plugins` lists it)")
    check.add_argument("--model", action="append", default=[],
                       help=f"{models}; repeatable (default: the plugin's published suite, else tiny-llama, "
                            "tiny-qwen3-moe)")
    check.add_argument("--train-layout", action="append", help="e.g. fsdp=2,tp=2; repeatable (default: the suite's)")
    check.add_argument("--gen-layout", action="append", help="e.g. tp=2; repeatable (default: the suite's)")
    check.set_defaults(func=cmd_check_plugin)

    bench = sub.add_parser("bench", help="GPU benchmark: wire vs baselines vs refit (see benchmarks/)")
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    bench.set_defaults(func=cmd_bench)

    status = sub.add_parser("status", help="print a running fleet's replicas: version, ranks, layout, join time, "
                                           "last error (RefitFleet)")
    status.add_argument("rendezvous", help="the fleet's HOST:PORT (train rank 0's RefitFleet rendezvous)")
    status.add_argument("--secret", help="the job's secret (default: REFIT_SECRET from the environment)")
    status.add_argument("--job", help="the job's name (default: REFIT_JOB, else refit's)")
    status.set_defaults(func=cmd_status)

    secret = sub.add_parser("secret", help="print a fresh random secret for a job: REFIT_SECRET=$(refit secret), "
                                           "the same on every rank")
    secret.set_defaults(func=cmd_secret)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # argparse's REMAINDER drops a first argument that looks like an option
        argv = ["bench", "--", *argv[1:]]
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    try:
        return args.func(args)
    except RefitError as exc:
        print(f"refit: error: {as_flags(str(exc))}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
