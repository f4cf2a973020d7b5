"""``hybridshard bench --compile``: what compiling cost each contestant, counted with torch's own tools.

[Note: bench compile counts]
Dynamo's counters (``torch._dynamo.utils.counters``) are global to the process, and the contestants
run interleaved in one process, so :class:`CompileCounts` takes the difference of
``counters["frames"]["ok"]`` (frames compiled) and ``sum(counters["graph_break"].values())`` (graph
breaks) around each of a contestant's steps and adds it to that contestant. Frames compiled in the
first step are the compile; frames compiled in any later step are recompiles. The first step's wall
time (barriers around it, as a timed step) is reported as the compile time, apart from the median
step, which the warm-up steps keep out of.

[Note: cold compiles]
Inductor keeps what it compiled in caches that outlive a compile: on disk (the FX graph cache and
AOTAutograd's cache under ``TORCHINDUCTOR_CACHE_DIR``, shared by every process of the user and kept
between runs) and in memory (loaded kernels by source hash). Contestants compile blocks of the same
code, so whoever compiles second would find the first one's graphs there, and every contestant
would find the last run's. :meth:`CompileCounts.cold` runs each contestant's warm-up steps, the
compile among them, in ``torch._inductor.utils.fresh_cache``: an empty cache directory of its own
(per rank: ranks do not share either) with the in-memory caches cleared on the way in, so each
contestant compiles from nothing. The hits are counted (``counters["inductor"]["fxgraph_cache_hit"]``,
``counters["aot_autograd"]["autograd_cache_hit"]``) and reported, so a reuse would show. What a
process pays once whoever compiles first (inductor's imports, the C++ compiler probe, the compile
worker pool) :func:`warm_inductor` pays before any contestant, on an unrelated function.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections import defaultdict
from typing import Iterator

__all__ = ["CompileCounts", "warm_inductor", "CACHE_COUNTERS"]

# (counters group, key) of each cache lookup counted per contestant, under the name the report shows.
CACHE_COUNTERS = {"fx_hits": ("inductor", "fxgraph_cache_hit"), "fx_misses": ("inductor", "fxgraph_cache_miss"),
                  "aot_hits": ("aot_autograd", "autograd_cache_hit"), "aot_misses": ("aot_autograd", "autograd_cache_miss")}


def _now() -> tuple[int, ...]:
    from torch._dynamo.utils import counters

    return (counters["frames"]["ok"], sum(counters["graph_break"].values()),
            *(counters[group][key] for group, key in CACHE_COUNTERS.values()))


def warm_inductor() -> None:
    """Compile (forward and backward) an unrelated function, so no contestant pays the process's first-compile costs."""
    import torch

    with tempfile.TemporaryDirectory(prefix="hybridshard-warm-inductor-") as root:
        from torch._inductor.utils import fresh_cache

        with fresh_cache(dir=root):
            fn = torch.compile(lambda x, w: torch.tanh(x @ w).sum())
            x, w = torch.randn(3, 5), torch.randn(5, 7, requires_grad=True)
            fn(x, w).backward()
    torch._dynamo.reset()


class CompileCounts:
    """Per contestant: frames compiled in the first step and after it, graph breaks and cache lookups."""

    def __init__(self) -> None:
        self.first_frames: dict[str, int] = defaultdict(int)
        self.later_frames: dict[str, int] = defaultdict(int)
        self.breaks: dict[str, int] = defaultdict(int)
        self.cache: dict[str, dict[str, int]] = defaultdict(lambda: dict.fromkeys(CACHE_COUNTERS, 0))
        self.first_step_ms: dict[str, float] = {}
        self._steps: dict[str, int] = defaultdict(int)
        self._root: str | None = None

    @contextlib.contextmanager
    def cold(self, name: str) -> Iterator[None]:
        """Run ``name``'s steps in an empty inductor cache of its own; see [Note: cold compiles]."""
        from torch._inductor.utils import fresh_cache

        if self._root is None:
            self._root = tempfile.mkdtemp(prefix="hybridshard-bench-inductor-")
        with fresh_cache(dir=self._root, delete=False):
            yield

    def close(self) -> None:
        """Remove the contestants' cache directories (what they compiled is loaded by then)."""
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
            self._root = None

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[None]:
        """Count what one step of ``name`` compiles."""
        before = _now()
        try:
            yield
        finally:
            after = _now()
            frames, breaks, *lookups = (a - b for a, b in zip(after, before))
            target = self.first_frames if self._steps[name] == 0 else self.later_frames
            target[name] += frames
            self.breaks[name] += breaks
            for key, n in zip(CACHE_COUNTERS, lookups):
                self.cache[name][key] += n
            self._steps[name] += 1

    def facts(self, name: str) -> dict[str, float | int | None]:
        return {"first_step_ms": self.first_step_ms.get(name), "frames_first_step": self.first_frames[name],
                "recompiles": self.later_frames[name], "graph_breaks": self.breaks[name], **self.cache[name]}
