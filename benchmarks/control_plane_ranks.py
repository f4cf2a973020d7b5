"""The fault phases of the control-plane harness (``control_plane_scale.py``): W ranks as threads of
one process, one real TCPStore, the project's real heartbeat, watchdog and fault-check code.

What runs for real, per simulated rank: its own :class:`~hybridshard.runtime.faults.rank_state.ControlPlane`
with its own TCPStore client (libuv server, one per W), its watchdog thread (heartbeats, the fault
check of :mod:`hybridshard.runtime.faults`, the hang report) and the registry of collectives in
flight. What is simulated: a collective is a registered entry, never a transfer (no model compute, no
process group); a rank's death is its watchdog thread stopping with its store connection left open,
as a frozen process's (threads cannot be SIGKILLed, and a SIGKILL'd process on gloo fails its peers'
collectives at once, the easy case); rank 0's checkpoint stall is rank 0 outside any collective
while every other rank's collective waits on it.

Timing under the GIL on 2 cores measures the harness too. Store operations and bytes are counted
exactly (a counting wrapper around each rank's client); times are wall clock, and each phase reports
``lag_ms``: how late a thread that sleeps 50 ms wakes, worst case over the phase, the delay every
simulated rank's thread saw on top of the control plane's own time.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from hybridshard.runtime.faults import peers, watchdog
from hybridshard.runtime.faults.rank_state import ControlPlane, bound

STALL_FACTOR = 1.5
"""The stall is 90 s against the default HYBRIDSHARD_FAULT_SECONDS of 60: scaled alike."""
SWITCH_INTERVAL = 0.05
"""Seconds a thread holds the interpreter lock before one waiting may take it (Python's default 0.005).
[Note: a thousand ranks under one lock] With a thousand rank threads waiting, every waiter wakes each
interval to ask for the lock, and a follower's few milliseconds of work are cut into turns: at 1,024
ranks the default gave a detect phase 4.3 s of lag and 20.6 ms of CPU per rank, 0.05 s gave 1.7 s and
10.0 ms (one run each). A rank of a real job is a process of its own with a few threads."""


class CountingStore:
    """A store client that counts its operations and bytes (exact, whatever the timing)."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.ops, self.reads, self.sent, self.received, self.beats = inner, 0, 0, 0, 0, 0
        self.multi_gets = 0
        self.beat_times: list[float] = []
        """When each heartbeat was written (``time.monotonic()``, the same clock in every process here)."""
        self.frozen = False
        """A killed rank's: its writes never happen, its reads fail (so its threads stop at once)."""

    def _alive(self) -> None:
        if self.frozen:
            raise RuntimeError("this simulated rank was killed")

    def set(self, key: str, value: bytes) -> None:
        self._alive()
        self.ops += 1
        if key.startswith("hybridshard/beat/"):
            self.beats += 1
            self.beat_times.append(time.monotonic())
        self.sent += len(key) + len(value)
        self.inner.set(key, value)

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        self._alive()
        value = self.inner.compare_set(key, expected, desired)
        self.ops += 1
        self.reads += 1
        self.sent += len(key) + len(expected) + len(desired)
        self.received += len(value)
        return value

    def check(self, keys: list[str]) -> bool:
        self._alive()
        self.ops += 1
        self.reads += 1
        self.sent += sum(map(len, keys))
        return self.inner.check(keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self._alive()
        values = self.inner.multi_get(keys)
        self.ops += 1
        self.multi_gets += 1
        self.reads += 1
        self.sent += sum(map(len, keys))
        self.received += sum(map(len, values))
        return values

    def get(self, key: str) -> bytes:
        self._alive()
        value = self.inner.get(key)
        self.ops += 1
        self.reads += 1
        self.sent += len(key)
        self.received += len(value)
        return value

    def add(self, key: str, n: int) -> int:
        self._alive()
        self.ops += 1
        self.reads += 1
        self.sent += len(key) + 8
        self.received += 8
        return self.inner.add(key, n)


class Lag:
    """How late a sleeping thread wakes: the harness's own share of every timing (GIL, 2 cores)."""

    def __init__(self) -> None:
        self.worst, self._stop = 0.0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            t = time.monotonic()
            time.sleep(0.05)
            self.worst = max(self.worst, time.monotonic() - t - 0.05)

    def reset(self) -> float:
        worst, self.worst = self.worst, 0.0
        return worst

    def stop(self) -> None:
        self._stop.set()


class Ranks:
    """Ranks ``lo``..``hi - 1`` of W, in this process: one plane, one store client and one watchdog thread
    each, connected to the job's store at ``port``."""

    def __init__(self, world: int, port: int, lo: int = 0, hi: int | None = None) -> None:
        self.world, self.lo, self.hi = world, lo, world if hi is None else hi
        self._stopped: dict[int, tuple[float, str, float]] = {}
        """Rank -> (when it stopped, its report, its watchdog thread's CPU seconds then)."""
        self._tokens: dict[int, int] = {}
        self._lag = Lag()
        # [Note: connecting in parallel] A client's connect now and then takes 5 s here (a retried SYN,
        # seen with either server): thousands of them one after another would take many minutes.
        with concurrent.futures.ThreadPoolExecutor(64) as pool:
            clients = list(pool.map(lambda _: dist.TCPStore("127.0.0.1", port, is_master=False, use_libuv=True,
                                                            timeout=timedelta(seconds=60)), range(self.lo, self.hi)))
        self.planes: dict[int, ControlPlane] = {}
        for rank, client in zip(range(self.lo, self.hi), clients):
            plane = ControlPlane(CountingStore(client), rank, world)
            plane.is_ready = lambda: True
            plane.watch_main = False  # the process's main thread is no simulated rank's
            plane.on_stop = self._on_stop(rank, plane)
            self.planes[rank] = plane

    def _on_stop(self, rank: int, plane: ControlPlane) -> Any:
        def stop(status: int) -> None:  # what errors.stop_now does to a process: its report is its last word
            text = (plane.final or {}).get("text", "")
            self._stopped[rank] = (time.monotonic(), text, time.thread_time())  # the rank's own thread
            plane.stop.set()
        return stop

    def start(self) -> None:
        for plane in self.planes.values():
            with bound(plane):
                watchdog.start()

    def cpu(self) -> dict[int, float]:
        """CPU seconds each running rank's watchdog thread has used: what that rank would spend on a core
        of its own, apart from the time its thread waited for the interpreter lock (see the lag)."""
        out = {}
        for rank, plane in self.planes.items():
            thread = plane.thread
            if thread is not None and thread.is_alive() and thread.ident is not None:
                try:
                    out[rank] = time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
                except OSError:  # it ended in between
                    pass
        return out

    def counts(self) -> tuple[int, int, int, int]:
        """Operations, operations other than heartbeats, bytes, ``multi_get`` calls (each a reading of
        many heartbeats): over these ranks."""
        stores = [p.found["store"] for p in self.planes.values()]
        return (sum(s.ops for s in stores), sum(s.ops - s.beats for s in stores),
                sum(s.sent + s.received for s in stores), sum(s.multi_gets for s in stores))

    def beat_rates(self, since: float, until: float) -> list[tuple[int, float]]:
        """Per rank with two heartbeats or more between ``since`` and ``until``: its beats there less one,
        and the seconds from its first to its last. Their sums' ratio is the heartbeat rate; a count
        over the window alone is off by up to a beat a rank whenever the window's ends fall near the beats."""
        out = []
        for plane in self.planes.values():
            times = [t for t in plane.found["store"].beat_times if since <= t <= until]
            if len(times) >= 2:
                out.append((len(times) - 1, times[-1] - times[0]))
        return out

    def begin_all(self, ranks: range) -> None:
        for r in ranks:
            if r in self.planes:
                with bound(self.planes[r]):
                    self._tokens[r] = watchdog.begin("all_reduce", "world", range(self.world), 1 << 20)

    def end_all(self) -> None:
        for r, token in self._tokens.items():
            with bound(self.planes[r]):
                watchdog.end(token)
        self._tokens.clear()

    def asking(self) -> int:
        """Ranks asking the others now."""
        return sum(1 for p in self.planes.values() if p.override is not None)

    def checks(self) -> int:
        """Collectives in flight whose fault check began."""
        return sum(1 for p in self.planes.values() for e in list(p.in_flight.values()) if e.checked)

    def kill(self, rank: int) -> None:
        if rank in self.planes:
            self.planes[rank].found["store"].frozen = True
            self.planes[rank].stop.set()

    def stopped(self, clear: bool = False) -> dict[int, tuple[float, str, float]]:
        out = dict(self._stopped)
        if clear:
            self._stopped.clear()
        return out

    def set_limits(self, fault_s: float | None) -> None:
        _set_limits(fault_s)

    def lag(self) -> float:
        """The worst delay a sleeping thread of this process saw since the last call."""
        return self._lag.reset()

    def close(self) -> None:
        self._lag.stop()
        for plane in self.planes.values():
            plane.stop.set()
        for plane in self.planes.values():
            if plane.thread is not None:
                plane.thread.join(timeout=10)


class Job(Ranks):
    """W ranks as threads of this process, with the job's store (a libuv TCPStore server) here too."""

    def __init__(self, world: int) -> None:
        self.server = dist.TCPStore("127.0.0.1", 0, is_master=True, use_libuv=True, wait_for_workers=False,
                                    timeout=timedelta(seconds=60))
        super().__init__(world, self.server.port)


def _set_limits(fault_s: float | None) -> None:
    if fault_s is None:
        os.environ.pop("HYBRIDSHARD_FAULT_SECONDS", None)
        os.environ.pop("HYBRIDSHARD_HANG_SECONDS", None)
    else:
        os.environ["HYBRIDSHARD_FAULT_SECONDS"] = str(fault_s)
        os.environ["HYBRIDSHARD_HANG_SECONDS"] = str(5 * fault_s)  # 300 s against 60 s, scaled alike


def healthy(job: Any, seconds: float) -> dict[str, float]:
    """Steps of a healthy job: every rank in collectives of half a second, one after the other, nobody
    stuck. The heartbeats are then the only store traffic; a rank that has waited in one collective for
    a second or more also reads the count of kept causes once a poll (see [Note: keeping the causes]
    in :mod:`hybridshard.runtime.faults.causes`), which a stall phase shows, not this one."""
    job.set_limits(None)
    ops0, other0, bytes0, _ = job.counts()
    cpu0 = job.cpu()
    job.lag()
    since = time.monotonic()
    end = since + seconds
    while time.monotonic() < end:
        job.begin_all(range(job.world))
        time.sleep(min(0.5, max(0.0, end - time.monotonic())))
        job.end_all()
    until = time.monotonic()
    ops1, other1, bytes1, _ = job.counts()
    per = job.world * seconds
    spans = job.beat_rates(since, until)
    # Heartbeats from the ranks' own beat times; every other operation counted over the window.
    span_s = sum(s for _, s in spans)
    beats = sum(n for n, _ in spans) / span_s if span_s > 0 else float("nan")
    return {"store_ops_per_rank_per_s": beats + (other1 - other0) / per,
            "store_ops_per_rank_per_s_counted": (ops1 - ops0) / per, "healthy_beats_ranks": len(spans),
            "store_bytes_per_rank_per_s": (bytes1 - bytes0) / per,
            "healthy_lag_ms": 1e3 * job.lag(), "healthy_cpu_ms_per_rank_per_s": _cpu_ms(cpu0, job.cpu()) / seconds}


def _cpu_ms(before: dict[int, float], after: dict[int, float]) -> float:
    """Mean CPU milliseconds per rank between two :meth:`Job.cpu` readings (ranks in both)."""
    spent = [after[r] - before[r] for r in before if r in after]
    return 1e3 * sum(spent) / max(1, len(spent))


def stall(job: Any, fault_s: float) -> dict[str, float]:
    """Rank 0 outside any collective for STALL_FACTOR x the fault limit, every other rank waiting on it."""
    job.set_limits(fault_s)
    job.begin_all(range(1, job.world))
    ops0, other0, bytes0, readings0 = job.counts()
    cpu0 = job.cpu()
    job.lag()
    time.sleep(STALL_FACTOR * fault_s)
    deadline = time.monotonic() + 60  # checks that began still finish (the harness may be late)
    while time.monotonic() < deadline and job.asking():
        time.sleep(0.1)
    checks = job.checks()
    cpu_ms = _cpu_ms(cpu0, job.cpu())
    job.end_all()
    ops1, other1, bytes1, readings1 = job.counts()
    checks = max(checks, 1)
    # Every operation but the heartbeats (the round's writes included), + the ask's own heartbeat.
    return {"false_reports": len(job.stopped()), "stall_checks": checks,
            "store_ops_per_check_per_rank": (other1 - other0) / checks + 1,
            "store_multi_get_per_check_per_rank": (readings1 - readings0) / checks,
            "store_bytes_per_check_per_rank": (bytes1 - bytes0) / checks, "stall_lag_ms": 1e3 * job.lag(),
            "stall_cpu_ms_per_rank": cpu_ms, "stall_total_ops": ops1 - ops0}


def detect(job: Any, fault_s: float, victim: int) -> dict[str, float]:
    """Every rank in a collective; the victim's threads stop at t0. Time until every survivor named it."""
    job.set_limits(fault_s)
    job.stopped(clear=True)
    rounds = {kind: _rounds(job, kind) for kind in ("brief", "full")}
    job.begin_all(range(job.world))
    cpu0 = job.cpu()
    t0 = time.monotonic()
    job.kill(victim)
    job.lag()
    survivors = [r for r in range(job.world) if r != victim]
    deadline = t0 + fault_s + 8 * peers.REPORT_SECONDS + 60
    stopped = job.stopped()
    while time.monotonic() < deadline and len(stopped) < len(survivors):
        time.sleep(0.1 if len(survivors) < 1024 else 0.5)
        stopped = job.stopped()
    named = re.compile(rf"\brank {victim} was lost|\branks [0-9, ]*\b{victim}\b[0-9, ]* were lost")
    right = [r for r in survivors if r in stopped and named.search(stopped[r][1])]
    last = max((stopped[r][0] for r in right), default=float("nan"))
    job.end_all()
    wrong = sorted({stopped[r][1].split(": ", 1)[-1][:120] for r in survivors if r in stopped and r not in right})
    for text in wrong[:3]:
        print(f"W={job.world}: a survivor did not name rank {victim} alone: {text}")
    times = sorted(stopped[r][0] - t0 for r in right)
    cpu = sorted(stopped[r][2] - cpu0[r] for r in right if r in cpu0)
    return {"detected": len(right), "survivors": len(survivors), "reported": len(stopped), "detect_s": last - t0,
            "detect_after_check_s": last - t0 - fault_s, "detect_lag_ms": 1e3 * job.lag(),
            "detect_first_s": times[0] if times else float("nan"),
            "detect_median_s": times[len(times) // 2] if times else float("nan"),
            "detect_cpu_ms_per_rank": 1e3 * sum(cpu) / max(1, len(cpu)),
            "detect_cpu_ms_max_rank": 1e3 * cpu[-1] if cpu else float("nan"),
            **{f"detect_rounds_{kind}": _rounds(job, kind) - n for kind, n in rounds.items()}}


def _rounds(job: Any, kind: str) -> int:
    """How many rounds the ranks' asks of one kind have taken so far (see [Note: one reading for the ranks
    asking at once] in :mod:`hybridshard.runtime.faults.asks`): a phase adds one when every asker joined the first."""
    key = f"hybridshard/ask/{kind}-{peers.REPORT_SECONDS * (1 if kind == 'brief' else 3):g}/round"
    value = job.server.compare_set(key, b"\x00absent", b"\x00absent")  # the value, or that it is missing: no wait
    return 0 if value == b"\x00absent" else int(value.split(b"|")[0])


def _progress(world: int, text: str) -> None:
    print(f"W={world}: {text}", file=sys.stderr, flush=True)  # a long run's progress (not a figure line)


def fault_phases(world: int, fault_s: float, healthy_s: float, processes: int = 1) -> dict[str, Any]:
    """A healthy job, a stall of rank 0, a death: the figures of each, for W ranks as threads of this
    process, or of ``processes`` worker processes (``control_plane_procs.py``)."""
    out: dict[str, Any] = {"processes": processes}
    t = time.monotonic()
    if processes > 1:
        from control_plane_procs import ProcessJob  # noqa: PLC0415 - the process form only

        job: Any = ProcessJob(world, processes, SWITCH_INTERVAL)
    else:
        job = Job(world)
    job.start()
    out["start_s"] = time.monotonic() - t
    # The phases set the fault limits in os.environ and the switch interval; a caller's own (a test
    # run in the same process, whose later subprocesses inherit them) are put back after.
    saved = {k: os.environ.get(k) for k in ("HYBRIDSHARD_FAULT_SECONDS", "HYBRIDSHARD_HANG_SECONDS")}
    interval = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH_INTERVAL)  # see [Note: a thousand ranks under one lock]
    try:
        _progress(world, f"{world} ranks started in {out['start_s']:.1f}s")
        time.sleep(2.0)  # every rank beat once
        for name, phase in (("healthy", lambda: healthy(job, healthy_s)), ("stall", lambda: stall(job, fault_s)),
                            ("detect", lambda: detect(job, fault_s, victim=world // 2 + 1))):
            t = time.monotonic()
            out.update(phase())
            _progress(world, f"{name} phase: {time.monotonic() - t:.1f}s, lag "
                             f"{out.get(name + '_lag_ms', float('nan')):.0f} ms; " + ", ".join(
                                 f"{k} {out[k]:.4g}" for k in ("false_reports", "stall_checks", "store_ops_per_check_per_rank",
                                                               "store_multi_get_per_check_per_rank", "detected",
                                                               "stall_cpu_ms_per_rank", "detect_first_s", "detect_median_s",
                                                               "detect_s", "detect_cpu_ms_per_rank",
                                                               "detect_rounds_brief", "detect_rounds_full") if k in out and name in ("stall", "detect")
                                 and (k.startswith("detect") == (name == "detect"))))
    finally:
        job.close()
        sys.setswitchinterval(interval)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return out
