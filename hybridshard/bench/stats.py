"""Pure summaries of the measured steps: percentiles, ratios and loss agreement (no process group)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

__all__ = ["Timing", "quantile", "summarize", "ratios", "loss_agreement", "BASELINES"]

BASELINES = ("fsdp1", "fsdp2", "floor")
"""Contestants every other one is compared with, when they ran."""


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) with linear interpolation between order statistics (numpy's default)."""
    if not values:
        raise ValueError("quantile of no values")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be in [0, 1], found {q}")
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass(frozen=True)
class Timing:
    """Step times of one contestant, in milliseconds."""

    median_ms: float
    p10_ms: float
    p90_ms: float
    num_steps: int


def summarize(times_ms: Sequence[float]) -> Timing:
    return Timing(quantile(times_ms, 0.5), quantile(times_ms, 0.1), quantile(times_ms, 0.9), len(times_ms))


def ratios(medians_ms: Mapping[str, float], name: str) -> dict[str, float]:
    """``name``'s median over each baseline's median (``fsdp1``, ``fsdp2``, ``floor``) that ran; < 1 is faster."""
    return {base: medians_ms[name] / medians_ms[base] for base in BASELINES if base in medians_ms and medians_ms[base] > 0}


def loss_agreement(
    losses: Mapping[str, Sequence[float]], *, reference: str, num_steps: int, first_step_only: Sequence[str] = ()
) -> dict[str, float | None]:
    """Max |loss - reference loss| over the first ``num_steps`` steps, per contestant.

    Contestants in ``first_step_only`` (the floor, which does not average gradients across ranks)
    are compared on step 0 only. ``None`` where there is nothing to compare (no reference).
    """
    if reference not in losses:
        return {name: None for name in losses}
    ref = losses[reference]
    out: dict[str, float | None] = {}
    for name, values in losses.items():
        n = 1 if name in first_step_only else min(num_steps, len(values), len(ref))
        out[name] = max((abs(a - b) for a, b in zip(values[:n], ref[:n])), default=None)
    return out
