"""Wall time in each system's hooks, measured the same way for hybridshard, FSDP1 and FSDP2.

[Note: timing other systems' hooks]
The runtime times its own hooks (``comm_stats``), but a comparison needs one clock for every
system. :class:`HookClock` wraps each system's hook entry points - the functions the module hooks,
the autograd hooks and the end-of-backward callback call into - and adds the wall time of every
*outermost* entry (an entry point that calls another counts once) to the total of
:attr:`HookClock.label`, which the caller sets to the contestant whose step runs:

- hybridshard: the forward pre/post hooks ``Engine`` makes, ``Unit._pre_backward``,
  ``Unit._post_backward``, ``Unit._inputs_done`` and the end-of-backward callback;
- FSDP1: ``_root_pre_forward``, ``_pre_forward``, ``_post_forward``, ``_pre_backward_hook``,
  ``_post_backward_hook``, ``_post_backward_reshard_only_hook`` and ``_post_backward_final_callback``
  of ``torch.distributed.fsdp._runtime_utils`` (and the names ``fully_sharded_data_parallel``
  imported from it);
- FSDP2: ``FSDPState._pre_forward``, ``_post_forward``, ``_pre_backward``,
  ``_root_post_backward_final_callback`` and ``FSDPParamGroup.post_backward``.

Besides wall time, the clock adds the *CPU time* of the thread inside each outermost entry
(``time.thread_time``): the hooks' own work, without the time they spend blocked on a collective,
a lock or another process (4 ranks on 2 cores are often descheduled). hybridshard also runs part of
its gradient path on its communication thread (:class:`~hybridshard.runtime.comm.executors.threads.GradJob`): that
thread's CPU time in its jobs is added to the same total (:data:`THREAD_ENTRY_POINTS`; not to the
wall time, which would count its waits). FSDP1 and FSDP2 run no thread of their own on the CPU.

Hooks are bound when a model is wrapped (FSDP1 binds functions, FSDP2 and hybridshard bound
methods), so :meth:`HookClock.install` must run before the models are built; :meth:`uninstall` puts
the originals back. The time includes waits for collectives inside the hooks, as ``comm_stats``'s
does. ``on_enter``/``on_exit`` run at each outermost entry and exit (benchmarks/hook_profile.py
turns a profiler on and off there). A name a torch version lacks is skipped; :attr:`missing` lists it.
"""

from __future__ import annotations

import functools
import importlib
import logging
import threading
import time
from collections import defaultdict
from typing import Any, Callable, Iterable

logger = logging.getLogger(__name__)

__all__ = ["HookClock", "ENTRY_POINTS", "THREAD_ENTRY_POINTS"]

# system -> [(module, owner class or None, attribute, wraps a hook factory's result)]
ENTRY_POINTS: dict[str, list[tuple[str, str | None, str, bool]]] = {
    "hybridshard": [
        ("hybridshard.runtime.engine", "Engine", "_make_pre_hook", True),
        ("hybridshard.runtime.engine", "Engine", "_make_post_hook", True),
        ("hybridshard.runtime.units.unit", "Unit", "_pre_backward", False),
        ("hybridshard.runtime.units.unit", "Unit", "_post_backward", False),
        ("hybridshard.runtime.units.unit", "Unit", "_inputs_done", False),
        ("hybridshard.runtime.engine", "_FinishBackward", "__call__", False),
    ],
    "fsdp1": [
        ("torch.distributed.fsdp._runtime_utils", None, name, False)
        for name in ("_root_pre_forward", "_pre_forward", "_post_forward", "_pre_backward_hook",
                     "_post_backward_hook", "_post_backward_reshard_only_hook", "_post_backward_final_callback")
    ] + [  # FullyShardedDataParallel.forward calls the names it imported
        ("torch.distributed.fsdp.fully_sharded_data_parallel", None, name, False)
        for name in ("_root_pre_forward", "_pre_forward", "_post_forward")
    ],
    "fsdp2": [
        ("torch.distributed.fsdp._fully_shard._fsdp_state", "FSDPState", name, False)
        for name in ("_pre_forward", "_post_forward", "_pre_backward", "_root_post_backward_final_callback")
    ] + [("torch.distributed.fsdp._fully_shard._fsdp_param_group", "FSDPParamGroup", "post_backward", False)],
}

# Entry points run on a thread of the system's own: CPU time only (see the Note).
THREAD_ENTRY_POINTS: dict[str, list[tuple[str, str | None, str, bool]]] = {
    "hybridshard": [("hybridshard.runtime.comm.executors.threads", "GradJob", "run", False)],
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

    def reset(self) -> None:
        self.seconds.clear()
        self.cpu_seconds.clear()
        self.cpu_by_entry.clear()
        self.calls.clear()

    def _timed(self, fn: Callable) -> Callable:
        entry = fn.__qualname__

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if getattr(self._local, "inside", False):
                return fn(*args, **kwargs)
            self._local.inside = True
            started, cpu_started = time.perf_counter(), time.thread_time()
            if self.on_enter is not None:
                self.on_enter()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.on_exit is not None:
                    self.on_exit()
                cpu = time.thread_time() - cpu_started
                self.cpu_seconds[self.label] += cpu
                self.cpu_by_entry[(self.label, entry)] += cpu
                self.seconds[self.label] += time.perf_counter() - started
                self.calls[self.label] += 1
                self._local.inside = False

        return timed

    def _cpu_timed(self, fn: Callable) -> Callable:
        entry = f"{fn.__qualname__} (thread)"

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            cpu_started = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:  # a step drains its jobs before it returns: the label is still that step's
                cpu = time.thread_time() - cpu_started
                self.cpu_seconds[self.label] += cpu
                self.cpu_by_entry[(self.label, entry)] += cpu

        return timed

    def _factory(self, make: Callable) -> Callable:
        @functools.wraps(make)
        def wrapped_factory(*args, **kwargs):
            return self._timed(make(*args, **kwargs))

        return wrapped_factory

    def install(self, systems: Iterable[str]) -> "HookClock":
        """Wrap the entry points of ``systems`` (names in :data:`ENTRY_POINTS`); before building models."""
        for system in systems:
            if system not in ENTRY_POINTS:
                raise ValueError(f"no hook entry points known for system {system!r}; expected one of "
                                 f"{sorted(ENTRY_POINTS)}; time only those systems")
            entries = [(e, self._timed) for e in ENTRY_POINTS[system]]
            entries += [(e, self._cpu_timed) for e in THREAD_ENTRY_POINTS.get(system, ())]
            for (module_name, owner_name, attr, factory), wrap in entries:
                try:
                    owner = importlib.import_module(module_name)
                    owner = getattr(owner, owner_name) if owner_name else owner
                    original = getattr(owner, attr)
                except (ImportError, AttributeError):
                    self.missing.append(f"{module_name}.{owner_name + '.' if owner_name else ''}{attr}")
                    continue
                self._patched.append((owner, attr, original))
                setattr(owner, attr, self._factory(original) if factory else wrap(original))
        if self.missing:
            logger.warning("hook entry points not found in this torch, not timed: %s", self.missing)
        return self

    def uninstall(self) -> None:
        """Put back every original (models built meanwhile keep the wrapped hooks)."""
        for owner, attr, original in reversed(self._patched):
            setattr(owner, attr, original)
        self._patched.clear()
