"""tests/verl: verl's workers on the host need verl's ``cpu`` platform (``cpu_platform.py``), chosen before verl
first detects one; outside ``.venv-verl`` nothing here applies (the tests skip by design)."""

from __future__ import annotations

import os

try:
    from cpu_platform import RUNTIME_ENV  # registers the platform in this process
except ImportError:  # no verl here
    RUNTIME_ENV = {"env_vars": {}}

for key, value in RUNTIME_ENV["env_vars"].items():
    if key != "PYTHONPATH":
        os.environ.setdefault(key, value)
