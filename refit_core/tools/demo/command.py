"""``refit demo``: its command line (the options, and the choice between a one-pair demo and the RL loop)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from refit_core.contract.backend import GEN
from refit_core.contract.errors import RefitError
from refit_core.contract.plugins import get_plugin_manager
from refit_core.kit.models import model_inventory

if TYPE_CHECKING:
    from refit_core.tools.demo.rl_loop import LoopSettings

DEMO_MODEL = "tiny-llama"
DEMO_STEPS = 2
"""What ``refit demo`` refits, and how often, when not told (``--loop`` has its own: LoopSettings)."""


def add_demo_command(sub: Any, models: str) -> None:
    """Add ``refit demo`` to the subcommands ``sub`` (``models``: how the ``--model`` help names the models)."""
    demo = sub.add_parser("demo", help="run a real, verified refit between two programs on this machine")
    demo.add_argument("--train", help="train backend (default: best installed)")
    demo.add_argument("--gen", help="gen backend (default: best installed)")
    demo.add_argument("--model", help=f"{models} (default: {DEMO_MODEL}; with --loop, the loop's policy)")
    demo.add_argument("--steps", type=int, help=f"refits (default: {DEMO_STEPS}; with --loop, the loop's steps)")
    demo.add_argument("--train-layout", help="e.g. fsdp=2 (default: the backend's demo layout)")
    demo.add_argument("--gen-layout", help="e.g. tp=2 (default: the backend's demo layout)")
    demo.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when present")
    demo.add_argument("--colocate", action="store_true",
                      help="train and gen ranks share devices (CUDA: the same GPUs, pairs on one GPU through "
                           "CUDA IPC; CPU: the host, pairs through shared memory)")
    demo.add_argument("--timeout", type=float, default=900.0, help="seconds before both programs are stopped")
    demo.add_argument("--loop", action="store_true",
                      help="a real RL loop instead: GRPO on a tiny policy (Ray actors, FSDP2 -> vLLM), refit "
                           "after every step, reward and generation-KL table and plot (needs refit-core[ray])")
    demo.add_argument("--plot", default="refit-rl-loop.png", help="with --loop: where to write the PNG")
    demo.add_argument("--replicas", type=int, default=1,
                      help="with --loop: N engine replicas in a fleet (refit_join_fleet), the rollouts spread over "
                           "them, each checked against HF after every step it holds (default 1: one engine)")
    demo.add_argument("--chaos", type=int, nargs="?", const=-1, metavar="STEP",
                      help="with --loop --replicas N: kill the last replica's actor at STEP (default: mid-run) and "
                           "restart it under its name; it rejoins the fleet the step after")
    demo.add_argument("--lora", metavar="r=N[,alpha=A][,targets=...][,mode=adapter]",
                      help="with --loop: train a LoRA adapter on the frozen policy and refit it merged (or, with "
                           "mode=adapter, into an engine's LoRA slots); prints bytes per step beside the full "
                           "model's")
    demo.add_argument("--quantize", choices=("fp8",), help="fp8: the gen side holds block-FP8 (128 x 128) linear "
                      "weights, quantized by refit and checked against the reference quantizer")
    demo.set_defaults(func=cmd_demo)


def loop_settings(args: argparse.Namespace) -> LoopSettings:
    """``refit demo --loop``'s settings: the model and steps given, else the loop's own defaults; ``--replicas``
    and ``--chaos`` checked (a fleet of replicas; a kill needs another replica to go on with)."""
    from refit_core.tools.demo.fleet_loop import chaos_step
    from refit_core.tools.demo.rl_loop import LoopSettings, loop_lora

    steps = args.steps or LoopSettings.steps
    if args.replicas < 1:
        raise RefitError(f"--replicas {args.replicas}: at least 1")
    if args.chaos is not None and args.replicas < 2:
        raise RefitError("--chaos kills a replica and the loop goes on with the others: use --replicas 2 or more")
    return LoopSettings(model=args.model or LoopSettings.model, steps=steps, device=args.device or "cpu",
                        plot=args.plot, lora=loop_lora(args.lora), replicas=args.replicas,
                        chaos_step=None if args.chaos is None else chaos_step(steps, args.chaos))


def cmd_demo(args: argparse.Namespace) -> int:
    from refit_core.kit.demo import installed_demos
    from refit_core.tools.demo.runner import DemoPlan, default_device, fit_to_gpus, pick_pair, run_demo

    if args.loop:
        settings = loop_settings(args)
        if settings.replicas > 1:
            from refit_core.tools.demo.fleet_loop import run_cli as run_fleet_cli

            return run_fleet_cli(settings, args.train, args.gen)
        from refit_core.tools.demo.rl_loop import run_cli

        return run_cli(settings, args.train, args.gen)
    if args.replicas != 1 or args.chaos is not None:
        raise RefitError("--replicas and --chaos go with --loop")
    pm = get_plugin_manager()
    demos = installed_demos(pm)
    able = [demos.of(b.name) for b in pm.backends(GEN)]
    able = [d for d in able if args.quantize in d.quantize and d.gen]
    gen_name = args.gen
    if args.quantize and gen_name is None and able:  # the best backend that can hold quantized weights
        gen_name = max(able, key=lambda d: d.priority).backend
    train, gen = pick_pair(pm, args.train, gen_name)
    gen_layout = args.gen_layout if args.gen_layout is not None else demos.of(gen.name).gen_layout
    if args.quantize and args.gen_layout is None:
        gen_layout = ""  # one rank holding whole 128 x 128 blocks (a tiny model's TP shards would split them)
    plan = DemoPlan(train, gen, args.model or DEMO_MODEL,
                    args.train_layout if args.train_layout is not None else demos.of(train.name).train_layout,
                    gen_layout, args.steps or DEMO_STEPS, args.device or default_device(), colocate=args.colocate,
                    quantize=args.quantize)
    if args.quantize and args.quantize not in demos.of(gen.name).quantize:
        raise RefitError(f"--quantize {args.quantize}: the {gen.name} backend's demo cannot hold quantized "
                         f"weights (backends that can: {', '.join(d.backend for d in able) or 'none'})")
    plan = fit_to_gpus(plan, train_given=args.train_layout is not None, gen_given=args.gen_layout is not None)
    inventory = model_inventory(plan.model)  # a bad model is an error here, before anything starts
    print(f"refit demo: {train.name} -> {gen.name} on {plan.device}, model {plan.model} "
          f"({inventory.describe()}), {plan.steps} steps", flush=True)
    outcome = run_demo(plan, timeout_s=args.timeout, echo=lambda line: print(line, flush=True))
    print(outcome.summary, flush=True)
    return 0 if outcome.ok else 1


__all__ = ["DEMO_MODEL", "DEMO_STEPS", "add_demo_command", "cmd_demo", "loop_settings"]
