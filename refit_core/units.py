"""Byte units, and human-readable sizes and durations for progress lines and summaries."""

MiB = 1 << 20
"""Bytes in a mebibyte."""


def format_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``; ``16.1e9`` -> ``"15.0 GiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_duration(seconds: float) -> str:
    """``2.5`` -> ``"2.50 s"``; ``0.0123`` -> ``"12.3 ms"``; ``4e-5`` -> ``"40 us"``."""
    if seconds >= 1:
        return f"{seconds:.2f} s"
    return f"{seconds * 1e3:.1f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.0f} us"
