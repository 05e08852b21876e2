"""tests/verl: verl's workers on the host need verl's ``cpu`` platform (``cpu_platform.py``), chosen before verl
first detects one; outside ``.venv-verl`` nothing here applies (the tests skip by design)."""

from __future__ import annotations

import importlib.util
import os

if importlib.util.find_spec("verl") is not None:
    from cpu_platform import RUNTIME_ENV

    for key, value in RUNTIME_ENV["env_vars"].items():
        if key != "PYTHONPATH":
            os.environ.setdefault(key, value)
    import cpu_platform  # noqa: F401  (registers the platform in this process)
