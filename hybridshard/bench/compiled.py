"""``hybridshard bench --compile``: what compiling cost each contestant, counted with torch's own tools.

[Note: bench compile counts]
Dynamo's counters (``torch._dynamo.utils.counters``) are global to the process, and the contestants
run interleaved in one process, so :class:`CompileCounts` takes the difference of
``counters["frames"]["ok"]`` (frames compiled) and ``sum(counters["graph_break"].values())`` (graph
breaks) around each of a contestant's steps and adds it to that contestant. Frames compiled in the
first step are the compile; frames compiled in any later step are recompiles. The first step's wall
time (barriers around it, as a timed step) is reported as the compile time, apart from the median
step, which the warm-up steps keep out of.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Iterator

__all__ = ["CompileCounts"]


def _now() -> tuple[int, int]:
    from torch._dynamo.utils import counters

    return counters["frames"]["ok"], sum(counters["graph_break"].values())


class CompileCounts:
    """Per contestant: frames compiled in the first step and after it, and graph breaks."""

    def __init__(self) -> None:
        self.first_frames: dict[str, int] = defaultdict(int)
        self.later_frames: dict[str, int] = defaultdict(int)
        self.breaks: dict[str, int] = defaultdict(int)
        self.first_step_ms: dict[str, float] = {}
        self._steps: dict[str, int] = defaultdict(int)

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[None]:
        """Count what one step of ``name`` compiles."""
        frames, breaks = _now()
        try:
            yield
        finally:
            new_frames, new_breaks = _now()
            target = self.first_frames if self._steps[name] == 0 else self.later_frames
            target[name] += new_frames - frames
            self.breaks[name] += new_breaks - breaks
            self._steps[name] += 1

    def facts(self, name: str) -> dict[str, float | int | None]:
        return {"first_step_ms": self.first_step_ms.get(name), "frames_first_step": self.first_frames[name],
                "recompiles": self.later_frames[name], "graph_breaks": self.breaks[name]}
