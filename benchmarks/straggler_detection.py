"""How often the straggler report names injected slowness right, on the local cluster (issue 46's targets).

    .venv/bin/python benchmarks/straggler_detection.py [--runs 10] [--kinds sleep,throttle,link,spine,healthy]

Every run is one job (tests/straggler_cluster_job.py) on ``launch/local-cluster --nodes 4 --racks 2
--procs-per-node 1`` (one rank a host, two hosts a rack, the replicate reduction in two hops), a report
every ``--every`` steps, and one kind of slowness from about step ``--start`` on:

* ``sleep``: rank 3's data loader sleeps ``--sleep-factor`` x its median step (expected: ``rank 3 (host3)``);
* ``throttle``: rank 3's CPU capped at ``--cpu`` of one CPU (cgroup ``cpu.max`` or v1 ``cpu.cfs_quota_us``;
  elsewhere the documented substitute, a CPU hog thread; expected: ``rank 3 (host3)``);
* ``link``: host3's link shaped to ``--link-rate`` mid-run (``--set-rate host3=RATE``; expected:
  ``host3's link (eth0)``);
* ``spine``: every rack's uplink shaped to ``--spine-rate`` mid-run (expected: racks ``pod0/rack0, pod0/rack1``);
* ``healthy``: ``--healthy-steps`` steps with nothing injected, under background load (a process spinning
  ``--load`` of one CPU); every verdict is a false one.

A run names its slowness correctly when the first report from the one the slowness starts in that has
an active verdict is that report or the next, and its verdicts are exactly the expected one. The
slowness starts at ``--start`` for the ranks' own injections and, for the network's, at the first step
that began after the local cluster changed the rate (``net-events.jsonl`` against rank 0's step
starts). Per kind it prints: runs named correctly / runs, runs with a verdict before the slowness
started, and the step ratio the slowness caused (the median step of the reports after it over those
before it, the first report left out), and the runs where that ratio fell below 1.3 (an injection
weaker than the target's; still counted). Timing on a shared machine is noisy: give it a quiet one.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOCAL_CLUSTER = os.path.join(REPO, "launch", "local-cluster")
JOB = os.path.join(REPO, "tests", "straggler_cluster_job.py")
KINDS = ("sleep", "throttle", "link", "spine", "healthy")
EXPECTED = {"sleep": ("rank", "rank 3 (host3)"), "throttle": ("rank", "rank 3 (host3)"),
            "link": ("link", "host3's link (eth0)"), "spine": ("racks", "racks pod0/rack0, pod0/rack1")}
_SPIN = ("import sys,time\nshare=float(sys.argv[1])\nwhile True:\n t=time.perf_counter()+0.05*share\n"
         " while time.perf_counter()<t: pass\n time.sleep(0.05*(1-share))")


@dataclass(frozen=True)
class RunResult:
    """One run: its reports (rank 0's JSON lines) and what they show."""

    kind: str
    rc: int
    every: int
    start: int | None
    """The first slow step (``None``: healthy)."""
    reports: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    output: str = ""

    @property
    def start_report(self) -> int | None:
        """The ``steps`` of the report the slowness starts in."""
        return None if self.start is None else (self.start // self.every + 1) * self.every

    def verdicts(self, record: dict[str, Any]) -> set[tuple[str, str]]:
        return {(a["kind"], a["subject"]) for a in record["active"]}

    def named(self, expected: tuple[str, str]) -> bool:
        """Named right within 2 reports of the start (see the module docstring)."""
        first = self.start_report
        for record in self.reports:
            if first is None or record["steps"] < first or not record["active"]:
                continue
            return record["steps"] <= first + self.every and self.verdicts(record) == {expected}
        return False

    def false_before(self) -> list[tuple[int, set[tuple[str, str]]]]:
        """Reports with a verdict before the slowness started (every report of a healthy run)."""
        first = self.start_report
        return [(r["steps"], self.verdicts(r)) for r in self.reports
                if r["active"] and (first is None or r["steps"] < first)]

    def step_ratio(self) -> float | None:
        """The median step after the slowness started over the one before (reports wholly on each side)."""
        first = self.start_report
        if first is None:
            return None
        step = lambda r: statistics.median(v[1] for v in r["ranks"].values())  # noqa: E731
        before = [step(r) for r in self.reports[1:] if r["steps"] < first]
        after = [step(r) for r in self.reports if r["steps"] > first]
        return statistics.median(after) / statistics.median(before) if before and after else None

    def show(self) -> str:
        return "\n".join(f"  {r['steps']:>4}: step {statistics.median(v[1] for v in r['ranks'].values()) * 1e3:6.1f} ms "
                         f"{sorted(self.verdicts(r)) or '-'}" for r in self.reports)


def _first_step_after(run_dir: str, moment: float) -> int | None:
    [path] = glob.glob(os.path.join(run_dir, "node0", "job-steps.json"))
    with open(path) as f:
        starts = json.load(f)["starts"]
    return next((i for i, t in enumerate(starts) if t > moment), None)


def run_once(kind: str, run_dir: str, *, every: int = 20, start: int = 100, steps: int = 160, healthy_steps: int = 220,
             sleep_factor: float = 0.6, cpu: float = 0.1, link_rate: str = "200mbit", spine_rate: str = "100mbit",
             load: float = 0.5, timeout_s: float = 110.0) -> RunResult:
    """One job of ``kind`` on a fresh local cluster, its run directory ``run_dir``."""
    if kind not in KINDS:
        raise ValueError(f"run_once expects a kind in {KINDS}, found {kind!r}; pass one of them")
    cluster = ["--nodes", "4", "--racks", "2", "--procs-per-node", "1", "--timeout", str(timeout_s), "--log-dir", run_dir]
    job = ["--steps", str(healthy_steps if kind == "healthy" else steps), "--slow-from", str(start), "--target", "3"]
    if kind == "sleep":
        job += ["--inject", "sleep", "--factor", str(sleep_factor)]
    elif kind == "throttle":
        job += ["--inject", "throttle", "--cpu", str(cpu)]
    elif kind in ("link", "spine"):
        target = "host3" if kind == "link" else "spine"
        cluster += ["--set-rate", f"{target}={link_rate if kind == 'link' else spine_rate}",
                    "--set-rate-when", f"step {start} "]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "HYBRIDSHARD_"))}
    env.update(PYTHONPATH=REPO, HYBRIDSHARD_STRAGGLER_STEPS=str(every))
    spinner = subprocess.Popen([sys.executable, "-c", _SPIN, str(load)]) if kind == "healthy" and load > 0 else None
    started = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, LOCAL_CLUSTER, *cluster, "--", sys.executable, JOB, *job], env=env,
                              capture_output=True, text=True, timeout=timeout_s + 40)
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
    seconds = time.monotonic() - started
    for path in glob.glob("/sys/fs/cgroup/cpu/hybridshard-throttle-*"):  # the throttled rank's, empty now
        try:
            os.rmdir(path)
        except OSError:
            pass
    reports = []
    for path in glob.glob(os.path.join(run_dir, "node0", "stragglers.jsonl")):
        with open(path) as f:
            reports = [json.loads(line) for line in f if line.strip()]
    first: int | None = None if kind == "healthy" else start
    events = os.path.join(run_dir, "net-events.jsonl")
    if kind in ("link", "spine"):
        first = None
        if os.path.exists(events):
            with open(events) as f:
                moment = json.loads(f.readline())["time"]
            first = _first_step_after(run_dir, moment)
    return RunResult(kind, proc.returncode, every, first, reports, seconds, (proc.stdout + proc.stderr)[-3000:])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=10, help="runs of each kind (default 10)")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {', '.join(KINDS)}")
    p.add_argument("--out", default=os.path.join(REPO, "hybridshard-logs", "straggler-detection"),
                   help="runs' directories and the summary go under OUT/<time>")
    p.add_argument("--every", type=int, default=20, help="steps a report (default 20)")
    p.add_argument("--start", type=int, default=100, help="step the slowness starts at (default 100)")
    p.add_argument("--steps", type=int, default=160, help="steps of an injected run (default 160)")
    p.add_argument("--healthy-steps", type=int, default=220, help="steps of a healthy run (default 220)")
    p.add_argument("--sleep-factor", type=float, default=0.6, help="sleep: x the median step (default 0.6)")
    p.add_argument("--cpu", type=float, default=0.1, help="throttle: share of one CPU left (default 0.1)")
    p.add_argument("--link-rate", default="200mbit", help="link: host3's rate (default 200mbit)")
    p.add_argument("--spine-rate", default="100mbit", help="spine: the uplinks' rate (default 100mbit)")
    p.add_argument("--load", type=float, default=0.5, help="healthy: background load, share of one CPU (default 0.5)")
    p.add_argument("-v", "--verbose", action="store_true", help="every run's reports")
    args = p.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or args.runs < 1:
        print(f"straggler_detection: expected --kinds from {','.join(KINDS)} and --runs >= 1, found "
              f"{args.kinds!r} and {args.runs}; pass e.g. --kinds link,spine --runs 2", file=sys.stderr)
        return 2
    stamp = time.strftime("%Y%m%d-%H%M%S")
    rows = []
    for kind in kinds:
        results = []
        for i in range(args.runs):
            r = run_once(kind, os.path.join(args.out, stamp, f"{kind}-{i}"), every=args.every, start=args.start,
                         steps=args.steps, healthy_steps=args.healthy_steps, sleep_factor=args.sleep_factor,
                         cpu=args.cpu, link_rate=args.link_rate, spine_rate=args.spine_rate, load=args.load)
            results.append(r)
            ok = "-" if kind == "healthy" else ("named" if r.named(EXPECTED[kind]) else "MISSED")
            ratio = r.step_ratio()
            print(f"{kind} run {i}: rc {r.rc}, {r.seconds:.0f}s, start step {r.start}, {ok}, step ratio "
                  f"{'-' if ratio is None else f'{ratio:.2f}'}, verdicts before: {r.false_before() or '-'}", flush=True)
            if args.verbose or r.rc != 0:
                print(r.show() if r.reports else r.output, flush=True)
        ratios = [x for x in (r.step_ratio() for r in results) if x is not None]
        rows.append((kind, "-" if kind == "healthy" else f"{sum(r.named(EXPECTED[kind]) for r in results)}/{len(results)}",
                     f"{sum(bool(r.false_before()) for r in results)}/{len(results)}",
                     f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})" if ratios else "-",
                     "-" if kind == "healthy" else str(sum(x < 1.3 for x in ratios))))
    print(f"\n{'kind':<10}{'named in 2 reports':>20}{'runs w/ false verdict':>24}{'step ratio, median (range)':>30}"
          f"{'runs < 1.3x':>14}")
    for kind, named, false, ratio, weak in rows:
        print(f"{kind:<10}{named:>20}{false:>24}{ratio:>30}{weak:>14}")
    print("false verdict: a verdict active before the slowness started (healthy: any); the runs' directories: "
          f"{os.path.join(args.out, stamp)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
