"""One check for every ratio the benchmarks print: a ratio of a bound is a result only if it is possible.

A method cannot beat its physical bound (the wire moving the same bytes over the same pairs, NCCL's
broadcast of the same bytes to every replica, one device copy of the same bytes): a ratio above
``TOLERANCE`` of its bound is a measurement error, and a time ratio is one only on the same bytes.
A copy bound is itself a measurement: one whose implied rate is under ``MIN_PLAUSIBLE`` of the device's
nominal copy rate was timed cold (or disturbed), one above the nominal rate is impossible. Either way
:func:`check_ratio` returns a :class:`Ratio` that prints as ``INVALID (reason)``, never as a number.
"""

from __future__ import annotations

from dataclasses import dataclass

TOLERANCE = 1.02
"""A ratio to a bound up to this much above 1.0 is measurement noise; above it, invalid."""
MIN_PLAUSIBLE = 0.5
"""The least fraction of the nominal copy rate a warm copy bound reaches (a quarter of the memory
bandwidth: a warm copy reaches ~0.9 of the copy rate; the cold H100 copy of issue #30, 557 GB/s, 0.33)."""

MEMORY_GBPS = {"H200": 4800.0, "H100 PCIe": 2000.0, "H100 NVL": 3900.0, "H100": 3350.0, "A100": 2039.0,
               "B200": 8000.0, "GH200": 4000.0}
"""Nominal memory bandwidth (GB/s) by GPU name fragment, most specific first (datasheets)."""


def nominal_copy_gbps(device_name: str) -> float | None:
    """Bytes a device copy can copy per second at best (half the memory bandwidth: each byte is read
    and written); None for a device not in :data:`MEMORY_GBPS` (CPU, unknown GPUs: not checked)."""
    for fragment, gbps in MEMORY_GBPS.items():
        if fragment in device_name:
            return gbps / 2
    return None


@dataclass(frozen=True)
class Ratio:
    """A ratio of a method to its bound; ``reason`` None means valid, else why it is not a result."""

    value: float | None
    reason: str | None = None

    @property
    def valid(self) -> bool:
        return self.value is not None and self.reason is None

    def text(self, digits: int = 3) -> str:
        """The number, ``-`` when there is none, or ``INVALID (reason)``."""
        if self.reason is not None:
            return f"INVALID ({self.reason})"
        return "-" if self.value is None else f"{self.value:.{digits}f}"

    def times_text(self, digits: int = 3) -> str:
        """The method's time as a multiple of the bound's and, in brackets, the fraction (``1.250x (0.800)``);
        ``-`` or ``INVALID (reason)`` as :meth:`text`."""
        if self.reason is not None or not self.value:
            return self.text(digits)
        return f"{1 / self.value:.{digits}f}x ({self.value:.{digits}f})"

    def as_json(self) -> dict[str, object]:
        return {"value": self.value, "valid": self.valid, "reason": self.reason}

    @classmethod
    def from_json(cls, data: dict[str, object] | None) -> Ratio:
        """The ratio :meth:`as_json` wrote (None: no ratio)."""
        if data is None:
            return cls(None)
        value, reason = data["value"], data["reason"]
        return cls(float(value) if isinstance(value, (int, float)) else None, str(reason) if reason else None)


def bound_rate_problem(nbytes: int, seconds: float, device_name: str) -> str | None:
    """Why a copy bound of ``nbytes`` in ``seconds`` on ``device_name`` is implausible, or None."""
    nominal = nominal_copy_gbps(device_name)
    if nominal is None or seconds <= 0:
        return None if seconds > 0 else "bound not measured"
    gbps = nbytes / seconds / 1e9
    if gbps < MIN_PLAUSIBLE * nominal:
        return (f"copy bound at {gbps:.0f} GB/s is under {MIN_PLAUSIBLE:g} of {device_name}'s nominal "
                f"{nominal:.0f} GB/s copy rate: timed cold or disturbed")
    if gbps > TOLERANCE * nominal:
        return f"copy bound at {gbps:.0f} GB/s exceeds {device_name}'s nominal {nominal:.0f} GB/s copy rate"
    return None


def check_ratio(value: float | None, bound: str, bound_problem: str | None = None) -> Ratio:
    """``value`` (method / ``bound``, 1.0 = at the bound) as a :class:`Ratio`: invalid when the bound
    itself is (``bound_problem``) or when the method beats its bound by more than :data:`TOLERANCE`."""
    if value is None:
        return Ratio(None, bound_problem)
    if bound_problem is not None:
        return Ratio(value, bound_problem)
    if value != value:  # NaN: a time was not measured
        return Ratio(value, f"{bound} not measured")
    if value > TOLERANCE:
        return Ratio(value, f"{value:.3f} of the {bound}: above the bound, a measurement error")
    return Ratio(value)


@dataclass(frozen=True)
class Timed:
    """A timed method (or bound): its name, median step seconds and the bytes a step landed."""

    name: str
    seconds: float
    nbytes: int


def same_bytes_ratio(method: Timed, bound: Timed, label: str, bound_problem: str | None = None) -> Ratio:
    """``method``'s time against its ``bound``'s (``bound.seconds / method.seconds``: 1.0 = at the bound),
    checked by :func:`check_ratio` (``label`` names the bound; ``bound_problem``: what is wrong with the
    bound itself): a result only on the same bytes, which is said first."""
    value = bound.seconds / method.seconds if method.seconds else None
    if method.nbytes != bound.nbytes:
        bound_problem = (f"the {bound.name} moved {bound.nbytes:,} bytes, {method.name} {method.nbytes:,}: "
                         "not the same bytes")
    return check_ratio(value, label, bound_problem)
