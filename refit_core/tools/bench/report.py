"""What a ``refit bench`` run leaves behind: the environment it ran in, ``PREFIX.json`` / ``PREFIX.md`` and
the ``--timeline`` pictures."""

from __future__ import annotations

import argparse
import json
import os
import platform
from typing import Any

import torch

from refit_core.contract.env import values_of
from refit_core.tools.bench.fp8 import fp8_table
from refit_core.tools.bench.rank import SAFE_ENV
from refit_core.tools.bench.results import table


def environment(args: argparse.Namespace) -> dict[str, Any]:
    """Versions of torch, CUDA and NCCL, the GPUs and the settings every rank ran with."""
    env: dict[str, Any] = {"torch": torch.__version__, "python": platform.python_version(),
                           "host": platform.node()}
    if args.device == "cuda":
        env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        env["cuda"] = torch.version.cuda
        try:
            env["torch_nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001
            pass
    try:
        import nccl.core as nccl
        env["nccl4py"] = nccl.__version__
        env["nccl"] = str(nccl.get_version())
    except Exception as exc:  # noqa: BLE001
        env["nccl4py"] = f"unavailable ({type(exc).__name__}: {exc})"
    env.update(values_of(SAFE_ENV))
    return env


def timeline_path(path: str, model: str, first: bool) -> str:
    """``--timeline PNG``'s file for ``model``: PNG itself for the run's ``first`` picture, else MODEL added."""
    if first:
        return path
    stem, dot, ext = path.rpartition(".")
    name = os.path.basename(model).replace(".json", "")
    return f"{stem}-{name}.{ext}" if dot else f"{path}-{name}"


def draw_timeline(job: dict[str, Any], results: list[dict[str, Any]], path: str, model: str) -> str:
    """The first refit method's recorded step of every rank, drawn into ``path``."""
    from refit_core.run.timing import StepTimeline
    from refit_core.tools.pictures import write_timeline_picture

    method = next((m for m in job["methods"] if m.startswith("refit")), None)
    ranks = []
    for r in results:
        entry = r["methods"].get(method, {}) if method else {}
        if "timeline" in entry:
            ranks.append((f"{r['side']} {r['rank'] - (job['num_train'] if r['side'] == 'gen' else 0)}",
                          StepTimeline.from_json(entry["timeline"])))
    return write_timeline_picture(ranks, path, f"{model}: {method}, last step, every rank")


def write(report: dict[str, Any], prefix: str) -> None:
    """``PREFIX.json`` (everything) and ``PREFIX.md`` (the tables) of ``report``."""
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    with open(prefix + ".json", "w") as f:
        json.dump(report, f, indent=1, default=str)
    env = report["environment"]
    md = [f"# refit bench: {report['machine'] or env.get('host')}, {report['date']}", "",
          f"Command: `{report['command']}`", "",
          f"Environment: {json.dumps(env)}", "",
          f"Settings: {json.dumps(report['settings'])}", ""]
    if report.get("fp8"):
        md += ["## FP8 destinations", "", fp8_table(report["fp8"]), ""]
    for summary in report["models"]:
        title = summary["model"] + (f" into block-FP8 {summary['fp8_block']}" if summary.get("fp8_block") else "")
        md += ["## " + title, "", table(summary), ""]
    with open(prefix + ".md", "w") as f:
        f.write("\n".join(md))


__all__ = ["draw_timeline", "environment", "timeline_path", "write"]
