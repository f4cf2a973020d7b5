"""Wall time in each system's hooks, measured the same way for hybridshard, FSDP1 and FSDP2.

[Note: timing other systems' hooks]
A comparison needs one measure for every system: the one hybridshard's own clock takes (see
[Note: one hook clock] in :mod:`hybridshard.runtime.trace.hook_clock`), which :class:`HookClock`
observes rather than timing hybridshard's hooks again. For FSDP1 and FSDP2 it wraps their hook entry points
(:data:`ENTRY_POINTS`) and takes the same measure, added to the totals of :attr:`HookClock.label`,
the contestant whose step runs. Wall time includes waits for collectives inside the hooks, as
``comm_stats``'s does; CPU time (``time.thread_time``) leaves out time blocked or descheduled, which
4 ranks on 2 cores often are. FSDP1 and FSDP2 run no thread of their own, so nothing stands for
hybridshard's communication-thread CPU time there.

Hooks are bound when a model is wrapped, so :meth:`HookClock.install` must run before the models are
built; :meth:`uninstall` puts the originals back. ``on_enter``/``on_exit`` run at each outermost entry
and exit (benchmarks/hook_profile.py turns a profiler on and off there). A name a torch version lacks
is skipped; :attr:`missing` lists it.
"""

from __future__ import annotations

import functools
import importlib
import logging
import threading
import time
from collections import defaultdict
from typing import Any, Callable, Iterable

from hybridshard.runtime.trace import hook_clock

logger = logging.getLogger(__name__)

__all__ = ["HookClock", "ENTRY_POINTS", "OBSERVED"]

OBSERVED = "hybridshard"
"""The system whose hooks time themselves (:mod:`hybridshard.runtime.trace.hook_clock`): observed, not wrapped."""

# system -> [(module, owner class or None, attribute)]
ENTRY_POINTS: dict[str, list[tuple[str, str | None, str]]] = {
    "fsdp1": [
        ("torch.distributed.fsdp._runtime_utils", None, name)
        for name in ("_root_pre_forward", "_pre_forward", "_post_forward", "_pre_backward_hook",
                     "_post_backward_hook", "_post_backward_reshard_only_hook", "_post_backward_final_callback")
    ] + [  # FullyShardedDataParallel.forward calls the names it imported
        ("torch.distributed.fsdp.fully_sharded_data_parallel", None, name)
        for name in ("_root_pre_forward", "_pre_forward", "_post_forward")
    ],
    "fsdp2": [
        ("torch.distributed.fsdp._fully_shard._fsdp_state", "FSDPState", name)
        for name in ("_pre_forward", "_post_forward", "_pre_backward", "_root_post_backward_final_callback")
    ] + [("torch.distributed.fsdp._fully_shard._fsdp_param_group", "FSDPParamGroup", "post_backward")],
}


class HookClock:
    """Per-system wall time in hooks; see [Note: timing other systems' hooks]."""

    def __init__(self, on_enter: Callable[[], None] | None = None, on_exit: Callable[[], None] | None = None) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        """Per label, wall time in hooks."""
        self.cpu_by_entry: dict[tuple[str, str], float] = defaultdict(float)
        """Per ``(label, entry point)``, the part of :attr:`cpu_seconds` spent under it."""
        self.cpu_seconds: dict[str, float] = defaultdict(float)
        """Per label, CPU time of the threads inside hooks (and the system's own threads' jobs)."""
        self.calls: dict[str, int] = defaultdict(int)
        self.label = ""
        """Where the time goes: the contestant whose steps run now."""
        self.missing: list[str] = []
        self.on_enter, self.on_exit = on_enter, on_exit
        self._local = threading.local()
        self._patched: list[tuple[Any, str, Any]] = []
        self._observing = False

    def reset(self) -> None:
        self.seconds.clear()
        self.cpu_seconds.clear()
        self.cpu_by_entry.clear()
        self.calls.clear()

    # -- the accounting, for hybridshard's clock (a hook_clock.HookObserver) and the wrapped entries --

    def hook_entered(self) -> None:
        if self.on_enter is not None:
            self.on_enter()

    def hook_exited(self, entry: str, wall_seconds: float, cpu_seconds: float) -> None:
        if self.on_exit is not None:
            self.on_exit()
        self.cpu_seconds[self.label] += cpu_seconds
        self.cpu_by_entry[(self.label, entry)] += cpu_seconds
        self.seconds[self.label] += wall_seconds
        self.calls[self.label] += 1

    def thread_job(self, entry: str, cpu_seconds: float) -> None:
        # a step drains its jobs before it returns: the label is still that step's
        self.cpu_seconds[self.label] += cpu_seconds
        self.cpu_by_entry[(self.label, entry)] += cpu_seconds

    def _timed(self, fn: Callable) -> Callable:
        entry = fn.__qualname__

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if getattr(self._local, "inside", False):
                return fn(*args, **kwargs)
            self._local.inside = True
            self.hook_entered()
            started, cpu_started = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.hook_exited(entry, time.perf_counter() - started, time.thread_time() - cpu_started)
                self._local.inside = False

        return timed

    def install(self, systems: Iterable[str]) -> "HookClock":
        """Observe hybridshard's clock and wrap the other ``systems``' entry points; before building models."""
        for system in systems:
            if system == OBSERVED:
                previous = hook_clock.observe(self)
                if previous not in (None, self):
                    hook_clock.observe(previous)  # the clock that was there keeps observing
                    raise RuntimeError("expected no other HookClock observing hybridshard's hooks, found one; "
                                       "uninstall it first")
                self._observing = True
                continue
            if system not in ENTRY_POINTS:
                raise ValueError(f"no hook entry points known for system {system!r}; expected one of "
                                 f"{sorted([OBSERVED, *ENTRY_POINTS])}; time only those systems")
            for module_name, owner_name, attr in ENTRY_POINTS[system]:
                try:
                    owner = importlib.import_module(module_name)
                    owner = getattr(owner, owner_name) if owner_name else owner
                    original = getattr(owner, attr)
                except (ImportError, AttributeError):
                    self.missing.append(f"{module_name}.{owner_name + '.' if owner_name else ''}{attr}")
                    continue
                self._patched.append((owner, attr, original))
                setattr(owner, attr, self._timed(original))
        if self.missing:
            logger.warning("hook entry points not found in this torch, not timed: %s", self.missing)
        return self

    def uninstall(self) -> None:
        """Stop observing and put back every original (models built meanwhile keep the wrapped hooks)."""
        if self._observing:
            hook_clock.observe(None)
            self._observing = False
        for owner, attr, original in reversed(self._patched):
            setattr(owner, attr, original)
        self._patched.clear()
