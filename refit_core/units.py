"""Human-readable sizes for progress lines and summaries."""


def format_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``; ``16.1e9`` -> ``"15.0 GiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
