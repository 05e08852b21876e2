"""One side of ``refit demo``, run as its own program: ``python -m refit_core.tools.demo.side ...``."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import traceback
from dataclasses import asdict

from refit_core.contract.errors import RefitError
from refit_core.contract.layout import ParallelLayout
from refit_core.contract.plugins import get_plugin_manager
from refit_core.contract.side import Side
from refit_core.kit.demo import DemoContext, DemoReport, ProgressLog, installed_demos
from refit_core.kit.models import model_inventory


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="refit-demo-side")
    parser.add_argument("--side", choices=[side.value for side in Side], required=True)
    parser.add_argument("--backend", required=True)
    parser.add_argument("--peer-backend", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--layout", default="")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rendezvous", required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--options", default="{}", help="RefitOptions as JSON")
    parser.add_argument("--report", required=True, help="where to write the JSON report")
    parser.add_argument("--events", help="where to append progress events (default: print them)")
    parser.add_argument("--quantize", default=None, help="fp8: the gen side holds block-FP8 weights")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format=f"[{args.side}] %(message)s")
    logging.getLogger("refit").setLevel(logging.INFO)  # this program's output goes to the demo's log file
    try:
        inventory = model_inventory(args.model)
        ctx = DemoContext(args.model, inventory.config, ParallelLayout.parse(args.layout), args.steps,
                          args.seed, args.rendezvous, args.device, args.peer_backend, json.loads(args.options),
                          inventory.specs, ProgressLog(args.side, args.events), quantize=args.quantize)
        pm = get_plugin_manager()
        backend = pm.backend(args.backend, args.side)
        program = installed_demos(pm).of(backend.name).program(Side(args.side))
        if program is None:
            raise RefitError(f"backend {args.backend!r} has no {args.side} demo program")
        report = program(ctx)
    except Exception as exc:  # noqa: BLE001 - the report carries the failure to `refit demo`
        traceback.print_exc()
        first_line = (str(exc).strip().splitlines() or [""])[0]
        report = DemoReport(False, [f"{args.side} ({args.backend}) failed: {type(exc).__name__}: {first_line}"])
    with open(args.report, "w") as f:
        json.dump(asdict(report), f)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
