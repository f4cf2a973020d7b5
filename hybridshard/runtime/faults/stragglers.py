"""The straggler report: every N steps each rank's timing summary goes through the job's store, and
rank 0 names what is slow (:mod:`hybridshard.runtime.faults.verdicts`), logs changes at WARNING and
writes one JSON line per report.

[Note: summaries through the store]
The summaries travel through the job's store (the c10d store the heartbeats use), not a collective.
A collective would have to be issued in the same order on every rank from the hooks' thread (on
NCCL, on the device: reading its result on the host is a sync, or a step late), it would count in
the step's collectives and checks, and every rank would wait for the slowest at it: the very cost
being measured. Through the store each rank writes one key per report (``hybridshard/slow/<k % 2>/<rank>``,
a few hundred bytes, its report number inside) from the training thread, outside any hook's
collective order; rank 0 alone reads every rank's key with one ``multi_get`` at its next steps until
all carry report ``k`` (ranks are at most a step or two apart: the collectives hold them together),
so a report is read within a step or two of its end. Two slots let a rank already at report ``k + 1``
write without overwriting what rank 0 has not read; no key is ever deleted (2 W keys in all). No
second heartbeat: nothing here runs on a timer.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import statistics
import time
from typing import Any

import torch

from hybridshard.runtime.faults import peers
from hybridshard.runtime.faults.gpu_state import GpuReader, GpuState
from hybridshard.runtime.faults.verdicts import GroupTime, RankSummary, Tracker
from hybridshard.runtime.trace.step_timing import CLOCK, StepTimes
from hybridshard.topology.job_nic import job_nic

logger = logging.getLogger(__name__)

__all__ = ["ENV_LOG", "ENV_ON", "ENV_REPLICA", "ENV_STEPS", "Reporter", "at_forward", "configure", "log_path",
           "reporter", "reset", "set_replica_group", "summarize"]

ENV_ON = "HYBRIDSHARD_STRAGGLERS"
ENV_STEPS = "HYBRIDSHARD_STRAGGLER_STEPS"
ENV_LOG = "HYBRIDSHARD_STRAGGLER_LOG"
ENV_REPLICA = "HYBRIDSHARD_REPLICA_ID"
"""The fault-tolerant replica group's id (set by ``hybridshard launch --fault-tolerant``), until
``FaultTolerance`` tells its own (:func:`set_replica_group`)."""
DEFAULT_STEPS = 100
WARMUP = 2
"""Steps left out of every summary: the first forward gathers without prefetch, allocates, compiles."""
_PREFIX = "hybridshard/slow/"
_REPORTER: list["Reporter"] = []
_STARTS: list[int] = [0]
_REPLICA: list[str] = [""]
"""The replica group ``FaultTolerance`` named (:func:`set_replica_group`); empty until then."""
"""Reporters started in this process: each one's keys are its own (every rank starts them alike)."""


def _env_on() -> bool:
    raw = os.environ.get(ENV_ON, "0").strip().lower()
    if raw in ("1", "true", "yes", "on", ""):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{ENV_ON} expects 1 or 0, found {raw!r}; set {ENV_ON}=1 to look for stragglers or 0 not to")


def _env_steps() -> int:
    raw = os.environ.get(ENV_STEPS)
    if raw is None:
        return DEFAULT_STEPS
    try:
        steps = int(raw)
    except ValueError:
        steps = 0
    if steps < 1:
        raise ValueError(f"{ENV_STEPS} expects a number of steps >= 1, found {raw!r}; "
                         f"set e.g. {ENV_STEPS}={DEFAULT_STEPS} or unset it")
    return steps


def log_path() -> str | None:
    """Where rank 0 writes its JSON lines: ``HYBRIDSHARD_STRAGGLER_LOG``, else ``stragglers.jsonl`` in
    ``HYBRIDSHARD_RUN_DIR`` (set by ``hybridshard launch`` to the node's run directory), else nowhere."""
    if os.environ.get(ENV_LOG):
        return os.environ[ENV_LOG]
    run_dir = os.environ.get("HYBRIDSHARD_RUN_DIR")
    return os.path.join(run_dir, "stragglers.jsonl") if run_dir else None


def summarize(rank: int, steps: list[StepTimes], members: dict[str, tuple[int, ...]], *, node: str = "",
              rack: str = "", nic: str = "", gpu: GpuState | None = None, replica_group: str = "") -> RankSummary:
    """One rank's report: the medians of its steps, and its GPU's reading (see [Note: clocks in the evidence])."""
    keys = sorted({k for t in steps for k in t.comm_s})
    comm = {}
    for key in keys:
        comm[key] = GroupTime(statistics.median(t.comm_s.get(key, 0.0) for t in steps),
                              members.get(key.split("@", 1)[1], ()))
    return RankSummary(rank, node, rack, nic, len(steps), statistics.median(t.step_s for t in steps),
                       statistics.median(t.compute_s for t in steps), comm, gpu, replica_group)


class Reporter:
    """One rank's side of the report; rank 0 also judges. See [Note: summaries through the store]."""

    def __init__(self, every: int, rank: int, world: int, store: Any, *, path: str | None = None) -> None:
        self.every, self.rank, self.world, self.store, self.path = every, rank, world, store, path
        self.node = os.environ.get("HYBRIDSHARD_NODE_NAME") or socket.gethostname()
        self.rack = os.environ.get("HYBRIDSHARD_NETWORK_PATH", "").strip("/")
        found = job_nic(os.environ.get("MASTER_ADDR") or getattr(store, "host", None))  # [Note: the job's NIC]
        self.nic, self.nic_source = found.name, found.source
        self.replica_group = _REPLICA[0] or os.environ.get(ENV_REPLICA, "")
        self.gpu: GpuReader | None = None
        """CUDA ranks: their GPU in NVML, read once per report (see [Note: clocks in the evidence])."""
        self.tracker = Tracker()
        self._steps: list[StepTimes] = []
        self._last = -1
        self._first: int | None = None
        self._pending: int | None = None
        self._keys_exist = False
        self.prefix = f"{_PREFIX}{_STARTS[0]}/"
        self.reports: list[dict[str, Any]] = []
        """Rank 0: every report it judged (what it wrote as JSON lines)."""

    def at_forward(self, step: int, device: torch.device | None) -> None:
        CLOCK.at_forward(step, device)
        if self.gpu is None and device is not None and device.type == "cuda":
            self.gpu = GpuReader(device)
        if step == self._last:
            return
        self._last = step
        if self._first is None:
            self._first = step
        self._steps += [t for t in CLOCK.take() if t.step >= self._first + WARMUP]
        if self._pending is not None:
            self._try_read()
        if step > self._first + WARMUP and step % self.every == 0 and self._steps:
            self._publish(step // self.every)

    def _publish(self, window: int) -> None:
        summary = summarize(self.rank, self._steps, CLOCK.members, node=self.node, rack=self.rack, nic=self.nic,
                            gpu=self.gpu.read() if self.gpu else None, replica_group=self.replica_group)
        self._steps = []
        value = json.dumps({"window": window, **summary.to_json()})
        self.store.set(f"{self.prefix}{window % 2}/{self.rank}", value)
        if self.rank == 0:
            self._pending = window
            self._try_read()

    def _try_read(self) -> None:
        window = self._pending
        keys = [f"{self.prefix}{window % 2}/{r}" for r in range(self.world)]
        if not self._keys_exist:
            if not self.store.check(keys):
                return
            self._keys_exist = True
        values = [json.loads(v) for v in self.store.multi_get(keys)]
        if any(v["window"] < window for v in values):
            return  # a rank has not got there yet: read again at the next step
        self._pending = None
        self.judge(window, [RankSummary.from_json(v) for v in values if v["window"] == window])

    def judge(self, window: int, summaries: list[RankSummary]) -> dict[str, Any]:
        active, changes = self.tracker.update(summaries)
        for line in changes:
            logger.warning("hybridshard stragglers (report %d, steps %d-%d): %s", window,
                           (window - 1) * self.every, window * self.every - 1, line)
        record = {"time": time.time(), "report": window, "steps": window * self.every,
                  "active": [v.to_json() for v in active], "changes": changes, "nodes": _nodes(summaries),
                  "ranks": {s.rank: [round(s.compute_s, 6), round(s.step_s, 6)] for s in summaries}}
        if any(s.gpu for s in summaries):
            record["gpus"] = {s.rank: s.gpu.to_json() for s in summaries if s.gpu}
        if len({s.replica_group for s in summaries}) == 1 and summaries[0].replica_group:
            record["replica_group"] = summaries[0].replica_group
        self.reports.append(record)
        if self.path:
            try:
                with open(self.path, "a") as f:
                    f.write(json.dumps(record) + "\n")
            except OSError as err:
                logger.warning("could not write the straggler report to %s (%s); set %s to a writable file",
                               self.path, err, ENV_LOG)
                self.path = None
        return record


def _nodes(summaries: list[RankSummary]) -> dict[str, Any]:
    """Per node: its rack, ranks, compute (median and slowest rank) and the job's median, for the table."""
    job = statistics.median(s.compute_s for s in summaries) if summaries else 0.0
    out: dict[str, Any] = {}
    for s in summaries:
        out.setdefault(s.node, {"rack": s.rack, "ranks": [], "compute": [], "step": []})
        n = out[s.node]
        n["ranks"].append(s.rank)
        n["compute"].append(s.compute_s)
        n["step"].append(s.step_s)
    for n in out.values():
        compute = n.pop("compute")
        n["compute_s"], n["compute_max_s"] = statistics.median(compute), max(compute)
        n["step_s"] = statistics.median(n.pop("step"))
        n["job_compute_s"] = job
    return out


def configure(on: bool | None) -> Reporter | None:
    """The process's reporter when ``on`` (``None`` reads ``HYBRIDSHARD_STRAGGLERS``), started on first use;
    ``None`` when off, on one rank, or without a store. Each model's engine keeps its own answer: the
    clock runs during the steps of the models that asked for it (``hybridshard bench`` interleaves both)."""
    on = _env_on() if on is None else on
    if not on:
        return None
    if _REPORTER:
        return _REPORTER[0]
    store = peers.store()
    rank, world = peers.identity()
    if store is None or world < 2:
        return None  # one rank, or torch's fake backend: nothing to compare
    _STARTS[0] += 1
    reporter = Reporter(_env_steps(), rank, world, store, path=log_path() if rank == 0 else None)
    _REPORTER[:] = [reporter]
    return reporter


def reset() -> None:
    """Stop and forget the process's reporter (the next ``configure`` starts a new one, with new keys)."""
    _REPORTER.clear()
    CLOCK.stop()


def set_replica_group(replica_id: str) -> None:
    """This process's fault-tolerant replica group (``FaultTolerance`` calls it): in the summaries from
    the next report on (see [Note: slow replica groups])."""
    _REPLICA[0] = replica_id
    if _REPORTER:
        _REPORTER[0].replica_group = replica_id


def reporter() -> Reporter | None:
    return _REPORTER[0] if _REPORTER else None


def at_forward(step: int, device: torch.device | None, on: bool) -> None:
    """Called as each forward starts (the engine's root pre-hook) with the model's own switch."""
    if on and _REPORTER:
        CLOCK.start()
        _REPORTER[0].at_forward(step, device)
    elif CLOCK.running():
        CLOCK.stop()
