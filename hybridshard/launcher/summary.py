"""The failure summary: one screen, the root cause first, built from the run directory.

[Note: root cause]
Every rank of a failed job ends in one of a few ways (:class:`Ending`). Its time is the one its error
file gives (the runtime writes a float), else when torchrun saw it fail. The root cause is the
earliest rank that failed on its own (raised, exited non-zero, killed by a signal other than the
agent's SIGTERM); only when there is none, the earliest that failed as a consequence (the runtime's
``CollectiveError`` says which rank it lost, or that every rank is alive: a hang), and only then one
its agent stopped (torchrun's times are whole seconds: they never outrank an error file's). Reading order: the root
cause with its first error line and, once, its traceback; one line per other rank; where the logs
are; what to do.
"""

from __future__ import annotations

import datetime
import glob
import json
import os
import signal
from dataclasses import dataclass
from enum import Enum

from hybridshard.launcher.runlog import last_output, read_error_file, read_node_records, traceback_from_log

__all__ = ["Ending", "RankEnding", "rank_endings", "render_summary"]

_LINE_MAX = 160


class Ending(str, Enum):
    CAUSE = "failed"
    """Raised, exited non-zero or was killed, on its own."""
    CONSEQUENCE = "failed too"
    """Failed because another rank did (the runtime's CollectiveError, or its stop on a lost peer)."""
    STOPPED = "stopped by its agent"
    """Still running when a rank of its node failed: torchrun sent it SIGTERM."""
    FINISHED = "finished"
    UNKNOWN = "no exit seen (its node's agent was stopped or lost)"
    """Its node left no final record (the node was lost, or its launcher stopped)."""


@dataclass(frozen=True)
class RankEnding:
    rank: int
    host: str
    local_rank: int
    ending: Ending
    exitcode: int | None = None
    time: float | None = None
    first_line: str = ""
    message: str = ""
    """The whole error message (the runtime's names every rank's state)."""
    traceback: str = ""
    stdout: str | None = None
    stderr: str | None = None

    def how(self) -> str:
        if self.exitcode is None:
            return ""
        if self.exitcode < 0:
            try:
                return f"killed by {signal.Signals(-self.exitcode).name}"
            except ValueError:
                return f"killed by signal {-self.exitcode}"
        return f"exit code {self.exitcode}"


def _ending_of(node: dict, rank: dict, failure: dict | None) -> RankEnding:
    base = dict(rank=rank["rank"], host=node.get("node", "?"), local_rank=rank["local_rank"],
                stdout=rank.get("stdout"), stderr=rank.get("stderr"))
    err = read_error_file((failure or {}).get("error_file") or rank.get("error_file"))
    if failure is None and err is None:
        ending = Ending.FINISHED if node.get("result") in ("failed", "succeeded") else Ending.UNKNOWN
        return RankEnding(ending=ending, **base)
    code = None if failure is None else failure["exitcode"]
    if err is not None:
        ending = Ending.CONSEQUENCE if err.consequence else Ending.CAUSE
        return RankEnding(ending=ending, exitcode=code, time=err.time, first_line=err.message.splitlines()[0],
                          message=err.message, traceback=err.callstack.rstrip(), **base)
    if code == -signal.SIGTERM:
        return RankEnding(ending=Ending.STOPPED, exitcode=code, time=failure["time"], **base)
    found = traceback_from_log(rank.get("stderr")) if code > 0 else None
    if found is not None:
        return RankEnding(ending=Ending.CAUSE, exitcode=code, time=failure["time"], first_line=found[1],
                          traceback=found[0], **base)
    last = last_output(rank.get("stdout"), rank.get("stderr"))
    return RankEnding(ending=Ending.CAUSE, exitcode=code, time=failure["time"],
                      first_line=f"last output: {last}" if last else "", **base)


def rank_endings(nodes: list[dict]) -> list[RankEnding]:
    """How every rank of the last attempt of each node ended."""
    out = []
    for node in nodes:
        if not node.get("attempts"):
            continue
        failures = {f["rank"]: f for f in node.get("failures", [])}
        for rank in node["attempts"][-1]["ranks"]:
            out.append(_ending_of(node, rank, failures.get(rank["rank"])))
    return sorted(out, key=lambda e: e.rank)


def root_cause(endings: list[RankEnding]) -> RankEnding | None:
    """See [Note: root cause]."""
    for kinds in ((Ending.CAUSE,), (Ending.CONSEQUENCE,), (Ending.STOPPED,)):
        found = [e for e in endings if e.ending in kinds]
        if found:
            return min(found, key=lambda e: (e.time if e.time is not None else float("inf"), e.rank))
    return None


def _clip(text: str) -> str:
    return text if len(text) <= _LINE_MAX else text[: _LINE_MAX - 3] + "..."


def _clock(t: float | None) -> str:
    if t is None:
        return ""
    text = datetime.datetime.fromtimestamp(t).strftime("%H:%M:%S.%f")
    return text[:-4] if t % 1 else text[:8]


def render_summary(run_dir: str, nodes: list[dict] | None = None, *, expected_nodes: int | None = None,
                   verbose: bool = False) -> list[str]:
    """The summary of ``nodes`` (node records; default: every node under ``run_dir``)."""
    nodes = read_node_records(run_dir) if nodes is None else nodes
    endings = rank_endings(nodes)
    cause = root_cause(endings)
    lines = []
    failed = any(n.get("result") not in ("succeeded",) for n in nodes) or not nodes
    if cause is None:
        lines.append(f"hybridshard: job {'failed' if failed else 'finished'}: no rank failed"
                     + (" (the nodes' agents left no record of their ranks)" if not endings else ""))
    else:
        what = cause.how() + (f" at {_clock(cause.time)}" if cause.time else "")
        lines.append(f"hybridshard: job failed: root cause rank {cause.rank} ({cause.host}, local rank {cause.local_rank}), {what}")
        if cause.first_line:
            lines.append("  " + _clip(cause.first_line))
        # A consequence (no rank failed on its own: a hang) is explained by its message, not its traceback.
        shown = cause.traceback if cause.ending is not Ending.CONSEQUENCE or verbose else "\n".join(
            cause.message.splitlines()[1:])
        lines += ["  | " + line for line in shown.splitlines()]
    restarts = [r for n in nodes for r in n.get("restarts", [])]
    for r in sorted(restarts, key=lambda r: r["time"]):
        lines.append(f"  restart {r['attempt']}: {_clip(r['text'])}")
    for e in endings:
        if e is cause:
            continue
        text = e.ending.value
        if e.ending is Ending.STOPPED and cause is not None:
            text += f" after rank {cause.rank} failed"
        elif e.how() and e.ending is not Ending.STOPPED and e.exitcode != -signal.SIGTERM:
            text += f" ({e.how()})"
        if e.first_line:
            text += ": " + e.first_line
        lines.append(_clip(f"  rank {e.rank} ({e.host}): {text}"))
        if verbose and e.traceback:
            lines += ["  | " + line for line in e.traceback.splitlines()]
    if expected_nodes is not None and len(nodes) < expected_nodes:
        lines.append(f"  {expected_nodes - len(nodes)} of {expected_nodes} nodes left no record in {run_dir} "
                     "(a node lost before it started, or not sharing this directory: see its own console)")
    if failed:  # a job that timed out or hung while something was slow: say what (docs/diagnostics.md)
        lines += ["  while " + text for text in slow_verdicts(run_dir)]
    lines.append(f"logs: {run_dir}/<node>/: each rank's stdout.log and stderr.log, torchrun's torchrun.log")
    if cause is not None and (cause.stderr or cause.stdout):
        lines.append(f"  rank {cause.rank}: {os.path.dirname(cause.stderr or cause.stdout)}/{{stdout,stderr}}.log")
    if failed:
        lines.append("next: fix the root cause and run again (with checkpoints, --resume continues from the latest); "
                     "--max-restarts N restarts in place instead")
    return lines


def slow_verdicts(run_dir: str) -> list[str]:
    """The straggler report's active verdicts at its last report (``stragglers.jsonl`` in the run
    directory or a node's directory; see docs/diagnostics.md), one text each."""
    found = sorted(glob.glob(os.path.join(run_dir, "stragglers.jsonl")) +
                   glob.glob(os.path.join(run_dir, "*", "stragglers.jsonl")))
    last = None
    for path in found[:1]:
        try:
            with open(path) as f:
                for line in f:
                    try:
                        last = json.loads(line)
                    except json.JSONDecodeError:
                        continue
        except OSError:
            return []
    if not last:
        return []
    return [f"slow {v['kind']}: {v['subject']} ({v['group']} {v['ratio']:.2f}x at report {last['report']}); "
            f"{v['action']}" for v in last.get("active", [])]
