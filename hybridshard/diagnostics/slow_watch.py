"""``hybridshard topo --watch RUN_DIR``: the straggler report's JSON lines as a per-node table over time.

Each line of ``stragglers.jsonl`` (written by rank 0; see docs/diagnostics.md) is one report: per node,
its ranks' median compute per step and the job's median. The table has a row per report and a
column per node (grouped by rack when the nodes have network paths): the node's compute in ms and
its ratio to the job's, ``*`` on a node named by an active verdict; the active verdicts follow.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any, Iterable

__all__ = ["find_log", "read_reports", "render_watch", "active_verdicts"]


def find_log(run_dir: str) -> str | None:
    """The run's ``stragglers.jsonl``: in ``run_dir`` or in one of its node directories; ``None`` if none."""
    if os.path.isfile(run_dir):
        return run_dir
    found = sorted(glob.glob(os.path.join(run_dir, "stragglers.jsonl")) +
                   glob.glob(os.path.join(run_dir, "*", "stragglers.jsonl")))
    return found[0] if found else None


def read_reports(path: str) -> list[dict[str, Any]]:
    """Every complete JSON line (a line being written is skipped)."""
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def active_verdicts(run_dir: str) -> list[str]:
    """The active verdicts of the run's last report, one text each (empty when none or no report)."""
    path = find_log(run_dir)
    reports = read_reports(path) if path else []
    if not reports:
        return []
    return [f"slow {v['kind']}: {v['subject']} ({v['group']} {v['ratio']:.2f}x, since report "
            f"{reports[-1]['report']} or before); {v['action']}" for v in reports[-1]["active"]]


def render_watch(reports: Iterable[dict[str, Any]], *, last: int = 20) -> list[str]:
    """The table (see the module docstring) of the last ``last`` reports."""
    reports = list(reports)[-last:]
    if not reports:
        return ["no straggler reports yet"]
    nodes = sorted({n for r in reports for n in r["nodes"]},
                   key=lambda n: (next((r["nodes"][n]["rack"] for r in reports if n in r["nodes"]), ""), n))
    racks = [next((r["nodes"][n]["rack"] for r in reports if n in r["nodes"]), "") for n in nodes]
    width = max(14, *(len(n) + 1 for n in nodes))
    lines = []
    if any(racks):
        lines.append(f"{'rack':>14}" + "".join(f"{rack or '-':>{width}}" for rack in racks))
    lines.append(f"{'report (step)':>14}" + "".join(f"{n:>{width}}" for n in nodes) + "   verdicts")
    for r in reports:
        named = {n for v in r["active"] for n in v.get("nodes", [])}
        cells = []
        for n in nodes:
            d = r["nodes"].get(n)
            if d is None:
                cells.append(f"{'-':>{width}}")
                continue
            ratio = d["compute_max_s"] / d["job_compute_s"] if d["job_compute_s"] else 0.0
            text = ("*" if n in named else "") + f"{d['compute_max_s'] * 1e3:.1f}ms {ratio:.2f}x"
            cells.append(f"{text:>{width}}")
        verdicts = "; ".join(f"{v['kind']}: {v['subject']}" for v in r["active"]) or "-"
        lines.append(f"{r['report']:>6} ({r['steps']:>5})" + "".join(cells) + "   " + verdicts)
    lines.append("cells: the node's slowest rank's compute per step and its ratio to the job's median; "
                 "* named by a verdict")
    for v in reports[-1]["active"]:
        lines.append(f"active: slow {v['kind']}: {v['subject']}: {v['group']} {v['seconds'] * 1e3:.2f} ms, "
                     f"{v['ratio']:.2f}x ({v['reference_s'] * 1e3:.2f} ms); {v['action']}")
    return lines
