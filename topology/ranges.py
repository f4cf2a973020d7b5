"""Integer sets as short text: rank and CPU lists in reports and warnings."""

from __future__ import annotations

from typing import Sequence

__all__ = ["format_ranges"]


def format_ranges(values: Sequence[int]) -> str:
    """``(0, 1, 2, 5, 7, 8)`` -> ``"0-2,5,7-8"``; empty -> ``"-"``."""
    vals = sorted(set(values))
    if not vals:
        return "-"
    parts = []
    start = prev = vals[0]
    for v in vals[1:] + [None]:  # type: ignore[list-item]
        if v is not None and v == prev + 1:
            prev = v
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if v is not None:
            start = prev = v
    return ",".join(parts)
