"""The run directory: what each node leaves on disk for the failure summary.

[Note: run directory]
``hybridshard launch --log-dir RUN`` gives this node's torchrun ``--log-dir RUN/<node>`` (``node<K>``
for a fixed node rank, else ``<host>-<pid>``), and torchrun writes, per attempt and local rank,
``stdout.log``, ``stderr.log`` and ``error.json`` (torch's ``DefaultLogsSpecs``; the worker finds the
last one in ``TORCHELASTIC_ERROR_FILE``). Beside them the node leaves:

- ``node.json``: written by :mod:`.agent` at each attempt's start and at the end: the host, which
  global rank each local rank is and where its files are, each restart, and every failure torchrun's
  ``ChildFailedError`` lists (exit code or signal, time);
- ``torchrun.log``: torchrun's own output (agent warnings, its failure banner), kept off the console.

``error.json`` is torch's error-file format (what ``@record`` writes: ``message.message`` and
``message.extraInfo.{py_callstack,timestamp}``); a process that trained with the runtime writes it
itself for an uncaught exception or a stop (:func:`hybridshard.runtime.faults.errors.write_error_file`),
adding ``extraInfo.hybridshard``: ``time`` (float seconds) and ``consequence`` (the error is the
consequence of another rank's failure). Everything here is read after
torchrun returned, so it works when the job's store is gone.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["NODE_RECORD", "TORCHRUN_LOG", "NodeLogs", "default_run_dir", "ErrorRecord", "read_error_file",
           "read_node_records", "write_json", "traceback_from_log", "last_output"]

NODE_RECORD = "node.json"
TORCHRUN_LOG = "torchrun.log"


@dataclass(frozen=True)
class NodeLogs:
    """Where this node's torchrun writes (see [Note: run directory]) and what it shows."""

    run_dir: str
    node_dir: str
    show_rank0: bool
    """Tee local rank 0's lines to the console (node rank 0, or every node when ranks are unfixed)."""
    shown_streams: str = "3"
    """torchrun's ``--tee`` value: 3 both streams, 1 stdout only (fault-tolerant jobs: torchft logs to stderr)."""

    @classmethod
    def for_node(cls, run_dir: str, node_rank: int | None, *, fault_tolerant: bool = False) -> NodeLogs:
        run_dir = os.path.abspath(run_dir)
        name = f"node{node_rank}" if node_rank is not None else f"{socket.gethostname()}-{os.getpid()}"
        # Each replica group of a fault-tolerant job shows its own rank 0's training lines.
        show = fault_tolerant or node_rank in (None, 0)
        return cls(run_dir, os.path.join(run_dir, name), show, "1" if fault_tolerant else "3")

    def torchrun_args(self) -> list[str]:
        shown = ["--tee", self.shown_streams, "--local-ranks-filter", "0"] if self.show_rank0 else []
        return ["--log-dir", self.node_dir, "--redirects", "3", *shown]


def default_run_dir(env: dict[str, str] | os._Environ, now: float | None = None) -> str:
    """``hybridshard-logs/job<SLURM_JOB_ID>``, else ``hybridshard-logs/run-<date>-<time>``, in the working
    directory. Give every node the same ``--log-dir`` on a shared file system to merge their summaries."""
    if env.get("SLURM_JOB_ID"):
        return os.path.join("hybridshard-logs", f"job{env['SLURM_JOB_ID']}")
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    return os.path.join("hybridshard-logs", f"run-{stamp}")


@dataclass(frozen=True)
class ErrorRecord:
    """What one rank's error file says."""

    message: str
    """``Type: text`` (all lines)."""
    time: float
    callstack: str
    consequence: bool
    """The error is the consequence of another rank's failure (a collective that failed with it)."""


def write_json(path: str, data: Any) -> None:
    """Write ``data`` to ``path`` atomically (a reader never sees half a file)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def read_error_file(path: str | None) -> ErrorRecord | None:
    """The error file at ``path``, ``None`` when absent or unreadable (torch's format, any writer)."""
    if not path or not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            data = json.load(f)
        message = data["message"]
        if isinstance(message, str):
            return ErrorRecord(message, float(data.get("timestamp", 0)), "", False)
        extra = message.get("extraInfo", {})
        ours = extra.get("hybridshard", {})
        return ErrorRecord(str(message.get("message", "")), float(ours.get("time", extra.get("timestamp", 0))),
                           str(extra.get("py_callstack", "")), bool(ours.get("consequence", False)))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def read_node_records(run_dir: str) -> list[dict]:
    """Every node's ``node.json`` under ``run_dir``, in node order."""
    records = []
    try:
        names = sorted(os.listdir(run_dir))
    except OSError:
        return []
    for name in names:
        path = os.path.join(run_dir, name, NODE_RECORD)
        try:
            with open(path) as f:
                record = json.load(f)
        except (OSError, ValueError):
            continue
        record["dir"] = os.path.join(run_dir, name)
        records.append(record)
    return sorted(records, key=lambda r: (r.get("node_rank") is None, r.get("node_rank") or 0, r["dir"]))


def traceback_from_log(path: str | None) -> tuple[str, str] | None:
    """``(traceback, exception line)`` of the last Python traceback in the log at ``path``, or ``None``."""
    if not path or not os.path.isfile(path):
        return None
    try:
        with open(path, errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last):")]
    if not starts:
        return None
    # A chained exception's tracebacks form one block; start at the first of the last block's chain.
    first = starts[-1]
    for i in reversed(starts[:-1]):
        between = lines[i:first]
        if any(line.startswith(("During handling", "The above exception")) for line in between):
            first = i
        else:
            break
    end = len(lines)
    for i in range(starts[-1] + 1, len(lines)):
        if lines[i] and not lines[i][0].isspace():
            end = i + 1
            break
    block = lines[first:end]
    return "\n".join(block), block[-1] if block else ""


def last_output(*paths: str | None) -> str:
    """The last non-blank line among the logs at ``paths`` (of the one written last)."""
    best, best_mtime = "", -1.0
    for path in paths:
        if not path or not os.path.isfile(path):
            continue
        with open(path, errors="replace") as f:
            lines = [line for line in f.read().splitlines() if line.strip()]
        if lines and os.path.getmtime(path) > best_mtime:
            best, best_mtime = lines[-1].strip(), os.path.getmtime(path)
    return best
