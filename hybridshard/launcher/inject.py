"""Injected slowness, for tests and benchmarks of the straggler report (docs/diagnostics.md).

* :class:`SleepyLoader`: a data loader that sleeps before each batch on one rank (a slow input pipeline);
* :func:`throttle_cpu`: one process's CPU capped by cgroup v2's ``cpu.max`` where ``/sys/fs/cgroup`` is a
  writable cgroup v2 hierarchy, by cgroup v1's ``cpu.cfs_quota_us`` where ``/sys/fs/cgroup/cpu`` is a
  writable v1 ``cpu`` hierarchy; elsewhere the documented substitute, :class:`CpuHog`: a thread in the
  rank's own process that spins in Python for a share of every period, so it competes for the
  interpreter lock and a core (the rank's hooks and its Python work slow down; torch's kernels compete
  for the core);
* :func:`shape_command`: the ``tc qdisc change`` line that shapes one host's link down mid-run on the
  local cluster (its namespaces' veth devices, :mod:`hybridshard.launcher.netns`); run it as root.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Iterable, Iterator

logger = logging.getLogger(__name__)

__all__ = ["CGROUP_ROOT", "CpuHog", "SleepyLoader", "shape_command", "throttle_cpu"]

CGROUP_ROOT = "/sys/fs/cgroup"


class SleepyLoader:
    """``batches``, sleeping ``seconds`` before each one from batch ``start`` on, when ``slow`` (this rank's)."""

    def __init__(self, batches: Iterable[Any], *, seconds: float, slow: bool = True, start: int = 0) -> None:
        if seconds < 0:
            raise ValueError(f"SleepyLoader expects seconds >= 0, found {seconds!r}; pass e.g. seconds=0.01")
        self.batches, self.seconds, self.slow, self.start = batches, seconds, slow, start

    def __iter__(self) -> Iterator[Any]:
        for i, item in enumerate(self.batches):
            if self.slow and i >= self.start:
                time.sleep(self.seconds)
            yield item


class CpuHog:
    """A thread that spins for ``share`` of every ``period_s`` in this process (see the module docstring)."""

    def __init__(self, share: float = 0.5, period_s: float = 0.01) -> None:
        if not 0 < share <= 1:
            raise ValueError(f"CpuHog expects a share in (0, 1], found {share!r}; pass e.g. share=0.5")
        self.share, self.period_s = share, period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._spin, name="hybridshard-cpu-hog", daemon=True)

    def _spin(self) -> None:
        busy = self.share * self.period_s
        while not self._stop.is_set():
            until = time.perf_counter() + busy
            while time.perf_counter() < until:
                pass
            if self.share < 1:
                time.sleep(self.period_s - busy)

    def start(self) -> "CpuHog":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def __enter__(self) -> "CpuHog":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _cgroup_v2_writable(root: str) -> bool:
    return os.path.exists(os.path.join(root, "cgroup.controllers")) and os.access(root, os.W_OK)


def _cgroup_v1_cpu(root: str) -> str | None:
    path = os.path.join(root, "cpu")
    return path if os.path.exists(os.path.join(path, "cpu.cfs_quota_us")) and os.access(path, os.W_OK) else None


def throttle_cpu(pid: int, fraction: float, *, root: str = CGROUP_ROOT, name: str = "hybridshard-throttle") -> Any:
    """Cap process ``pid`` at ``fraction`` of one CPU: a cgroup v2 child ``name`` with ``cpu.max`` (v1: a
    child of the ``cpu`` hierarchy with ``cpu.cfs_quota_us``); returns its path (empty once ``pid`` exits:
    ``os.rmdir`` it). Where cgroup v2 is not writable, and ``pid`` is this process, a started :class:`CpuHog`
    taking ``1 - fraction`` (stop it to end the throttle); otherwise a ``ValueError``."""
    if not 0 < fraction <= 1:
        raise ValueError(f"throttle_cpu expects a fraction of one CPU in (0, 1], found {fraction!r}; pass e.g. 0.5")
    if _cgroup_v2_writable(root):
        path = os.path.join(root, name)
        os.makedirs(path, exist_ok=True)
        period = 100_000
        with open(os.path.join(path, "cpu.max"), "w") as f:
            f.write(f"{int(period * fraction)} {period}\n")
        with open(os.path.join(path, "cgroup.procs"), "w") as f:
            f.write(f"{pid}\n")
        logger.info("process %d capped at %.0f%% of a CPU (%s/cpu.max)", pid, 100 * fraction, path)
        return path
    v1 = _cgroup_v1_cpu(root)
    if v1 is not None:
        path = os.path.join(v1, name)
        os.makedirs(path, exist_ok=True)
        for key, value in (("cpu.cfs_period_us", 100_000), ("cpu.cfs_quota_us", int(100_000 * fraction))):
            with open(os.path.join(path, key), "w") as f:
                f.write(f"{value}\n")
        with open(os.path.join(path, "cgroup.procs"), "w") as f:  # every thread of the process
            f.write(f"{pid}\n")
        logger.info("process %d capped at %.0f%% of a CPU (%s/cpu.cfs_quota_us)", pid, 100 * fraction, path)
        return path
    if pid != os.getpid():
        raise ValueError(
            f"throttle_cpu expects a writable cgroup hierarchy at {root} (v2, or v1's cpu) to cap another process "
            f"({pid}), found none; run as root on a host with cgroups, or call it inside that process to get a CpuHog instead")
    return CpuHog(share=min(1.0, 1.0 - fraction) or 0.05).start()


def shape_command(namespace: str, device: str, rate: str, *, latency: str = "50ms", burst: str = "32kbit",
                  verb: str = "change") -> list[str]:
    """The command that shapes ``device`` in ``namespace`` to ``rate`` (``"100mbit"``) with a token bucket:
    ``verb="add"`` the first time, ``"change"`` mid-run, ``"del"`` to lift it."""
    if verb not in ("add", "change", "replace", "del"):
        raise ValueError(f"shape_command expects verb add, change, replace or del, found {verb!r}; pass verb='change'")
    cmd = ["ip", "netns", "exec", namespace, "tc", "qdisc", verb, "dev", device, "root"]
    if verb == "del":
        return cmd
    return cmd + ["tbf", "rate", rate, "burst", burst, "latency", latency]
