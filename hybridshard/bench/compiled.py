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
Each contestant's first step compiles from nothing, as a user's first run would. Three things
outlive a compile and would carry one contestant's compile over to the next (contestants compile
blocks of the same code), or one run's over to the next:

- dynamo's cache of compiled frames, kept on the code object (``Block.forward``'s): its guards do
  not tell one system's block from another's, so a second contestant would run the first one's
  compiled frame and capture no graph. :func:`private_forward` gives each compiled contestant's
  blocks a copy of the class's forward code (the same code, a code object of its own);
- inductor's on-disk caches (FX graph and AOTAutograd, under ``TORCHINDUCTOR_CACHE_DIR``, shared by
  the user's processes and kept between runs) and its in-memory ones (loaded kernels by source):
  :meth:`CompileCounts.cold` runs each contestant's warm-up steps in
  ``torch._inductor.utils.fresh_cache``, an empty directory of its own per rank, the in-memory
  caches cleared on the way in;
- what a process pays once, whoever compiles first (inductor's imports, the C++ compiler probe,
  the compile worker pool): :func:`warm_inductor` pays it on an unrelated function before any
  contestant.

Graphs captured and cache hits and misses are counted per contestant and reported, so a reuse shows.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import types
from collections import defaultdict
from typing import Iterator

__all__ = ["CompileCounts", "warm_inductor", "private_forward", "CACHE_COUNTERS"]

# (counters group, key) of each count kept per contestant (graphs captured, cache lookups), by the report's name.
CACHE_COUNTERS = {"graphs": ("stats", "unique_graphs"),
                  "fx_hits": ("inductor", "fxgraph_cache_hit"), "fx_misses": ("inductor", "fxgraph_cache_miss"),
                  "aot_hits": ("aot_autograd", "autograd_cache_hit"), "aot_misses": ("aot_autograd", "autograd_cache_miss")}


# Seconds torch spent compiling, by its own phase clocks (``dynamo_timed``): a frame's compile (dynamo and
# the forward's backend compile) and the backward's compile, which AOTAutograd runs at the first backward.
COMPILE_PHASES = {"frame_compile_s": "entire_frame_compile", "backward_compile_s": "entire_backward_compile"}


def _now() -> tuple[float, ...]:
    from torch._dynamo.utils import counters, cumulative_time_spent_ns

    return (counters["frames"]["ok"], sum(counters["graph_break"].values()),
            *(counters[group][key] for group, key in CACHE_COUNTERS.values()),
            *(cumulative_time_spent_ns.get(phase, 0) / 1e9 for phase in COMPILE_PHASES.values()))


def warm_inductor(device=None) -> None:
    """Compile (forward and backward, on ``device``) an unrelated function, so no contestant pays the process's
    first-compile costs."""
    import torch

    with tempfile.TemporaryDirectory(prefix="hybridshard-warm-inductor-") as root:
        from torch._inductor.utils import fresh_cache

        with fresh_cache(dir=root):
            fn = torch.compile(lambda x, w: torch.tanh(x @ w).sum())
            x, w = torch.randn(3, 5, device=device), torch.randn(5, 7, device=device, requires_grad=True)
            fn(x, w).backward()
    torch._dynamo.reset()


def private_forward(model, cls: type) -> int:
    """Give ``model``'s modules of class ``cls`` one copy of ``cls.forward`` of their own; how many.

    The same code in a new code object, so dynamo compiles it apart from any other copy; see [Note: cold compiles].
    """
    fn = cls.forward
    copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__, copy.__qualname__ = fn.__kwdefaults__, fn.__qualname__
    modules = [m for m in model.modules() if isinstance(m, cls)]
    for m in modules:
        m.forward = types.MethodType(copy, m)
    return len(modules)


class CompileCounts:
    """Per contestant: frames compiled in the first step and after it, graph breaks, cache lookups, compile seconds."""

    def __init__(self) -> None:
        self.first_frames: dict[str, int] = defaultdict(int)
        self.later_frames: dict[str, int] = defaultdict(int)
        self.breaks: dict[str, int] = defaultdict(int)
        self.cache: dict[str, dict[str, float]] = defaultdict(lambda: dict.fromkeys([*CACHE_COUNTERS, *COMPILE_PHASES], 0))
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
            frames, breaks, *rest = (a - b for a, b in zip(after, before))
            target = self.first_frames if self._steps[name] == 0 else self.later_frames
            target[name] += frames
            self.breaks[name] += breaks
            for key, n in zip([*CACHE_COUNTERS, *COMPILE_PHASES], rest):
                self.cache[name][key] += n
            self._steps[name] += 1

    def facts(self, name: str) -> dict[str, float | int | None]:
        return {"first_step_ms": self.first_step_ms.get(name), "frames_first_step": self.first_frames[name],
                "recompiles": self.later_frames[name], "graph_breaks": self.breaks[name], **self.cache[name]}
