"""Reading ``refit plan``'s printed predictions back in the relay tests."""

from __future__ import annotations


def seconds(prediction: str) -> float:
    """``predicted 47 us, ...``, ``47 us`` or ``1.2 ms`` (:func:`refit_core.units.format_duration`) -> seconds."""
    value, unit = prediction.removeprefix("predicted ").split(",")[0].split()
    return float(value) * {"us": 1e-6, "ms": 1e-3, "s": 1.0}[unit]
