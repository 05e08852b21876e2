"""A failed ``refit demo``: the failing side's last error lines and the log path, a non-zero exit,
and no process left behind.

The engine side fails while it starts (vLLM refuses 4 attention heads over tensor parallelism 3),
after the trainer started its 2 rank processes, which then wait for the engine at the rendezvous:
the runner must kill them too (they used to outlive ``refit demo``, holding its stdout).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.environments import require

require("vllm")
require("refit_dtensor")
require("refit_vllm")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TAG = "REFIT_TEST_PROCESS_TAG"


def tagged_processes(tag: str) -> list[int]:
    """Processes of this user whose environment carries ``TAG=tag`` (inherited by every descendant)."""
    needle = f"{TAG}={tag}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if needle in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def test_failed_demo_reports_the_error_and_leaves_no_process(tmp_path: Path) -> None:
    tag = uuid.uuid4().hex
    env = {**os.environ, TAG: tag}

    control = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env)
    try:
        deadline = time.monotonic() + 10  # until the child has exec'd, /proc shows the parent's environment
        while tagged_processes(tag) != [control.pid] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert tagged_processes(tag) == [control.pid], "the leftover-process check cannot see processes"
    finally:
        control.kill()
        control.wait()

    proc = subprocess.run([sys.executable, "-m", "refit_core", "demo", "--train", "dtensor", "--gen", "vllm",
                           "--gen-layout", "tp=3", "--steps", "1"], check=False, capture_output=True, text=True,
                          timeout=900, env=env)
    out = proc.stdout
    lines = out.strip().splitlines()
    assert proc.returncode == 1, out + proc.stderr[-3000:]
    assert "FAILED (logs: " in lines[-1], lines[-1]
    log_dir = lines[-1].split("FAILED (logs: ", 1)[1].rstrip(")")
    assert (Path(log_dir) / "gen.log").is_file() and (Path(log_dir) / "train.log").is_file()
    assert "failed  gen: gen (vllm) failed: ValidationError" in out
    assert f"last lines of {log_dir}/gen.log:" in out
    assert "must be divisible by tensor parallel size (3)" in out.split("last lines of", 1)[1]
    assert "failed  train: train program stopped by refit demo" in out, "the trainer was not running: no test"
    assert "INFO" not in out and len(lines) < 30, out
    assert tagged_processes(tag) == [], "refit demo left processes behind"
