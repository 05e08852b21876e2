"""A CPU platform for verl 0.9.1, which ships CUDA, ROCm and NPU ones only: its workers build their gloo process
groups and FSDP2 engines on ``cpu`` once ``VERL_PLATFORM=cpu`` names this platform and this module is imported
in their process (:data:`RUNTIME_ENV` for Ray's workers). Test scaffolding: verl's code runs unchanged."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import PlatformRegistry

ROOT = Path(__file__).resolve().parents[2]
RUNTIME_ENV = {"env_vars": {"VERL_PLATFORM": "cpu", "PYTHONPATH": f"{ROOT}:{ROOT / 'tests' / 'verl'}",
                            "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
                            # verl registers its FSDP engines for cuda and npu only; they run on this platform's cpu
                            "VERL_ENGINE_DEVICE": "cuda", "VERL_ENGINE_VENDOR": "nvidia"},
               "worker_process_setup_hook": "cpu_platform.register"}
"""Ray's workers: this platform, the repository and tests/verl importable, one thread each (2 cores here)."""


class CpuPlatform(PlatformBase):
    """verl's platform interface on the host: gloo collectives, no device, no IPC."""

    device_name = "cpu"
    vendor_name = "cpu"

    @property
    def device_module(self) -> ModuleType:
        return torch.cpu

    def is_available(self) -> bool:
        return True

    def current_device(self) -> Any:
        return "cpu"  # verl places tensors on get_device_id(): the host's device, not an index

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: int | None = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return (None, None)

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextlib.contextmanager
    def nvtx_range(self, msg: str) -> Iterator[None]:
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None


def register() -> None:
    """Register :class:`CpuPlatform` as verl's ``cpu`` platform (idempotent)."""
    if PlatformRegistry.get("cpu") is None:
        PlatformRegistry.register(platform="cpu")(CpuPlatform)


register()
