"""A failed job reads as one screen: per-rank logs, the launcher's summary (root cause first), and the
console filter that keeps torchrun's own output and the consequential tracebacks off the console."""

import glob
import io
import json
import os
import signal
import subprocess
import sys

import pytest

from hybridshard.launcher.console import ConsoleFilter
from hybridshard.launcher.netns import check_rights
from hybridshard.launcher.runlog import traceback_from_log, write_json
from hybridshard.launcher.summary import Ending, rank_endings, render_summary, root_cause

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = os.path.join(REPO, "tests", "failure_job.py")
NETNS = check_rights() is None
MAX_LINES = 40  # the whole console of a failed 2 x 2 job, summary included


# -- the summary from records (no processes) ------------------------------------------------------

def _error_file(path, message, when, consequence=False, stack="Traceback (most recent call last):\n  x\n"):
    write_json(path, {"message": {"message": message, "extraInfo": {
        "py_callstack": stack + message, "timestamp": str(int(when)),
        "hybridshard": {"time": when, "consequence": consequence}}}})
    return path


def _node(tmp_path, name, node_rank, ranks, failures, result="failed"):
    d = tmp_path / name
    d.mkdir(exist_ok=True)
    record = {"node": name, "node_rank": node_rank, "max_restarts": 0, "restarts": [], "result": result,
              "attempts": [{"attempt": 0, "started": 0.0, "ranks": [
                  {"rank": r, "local_rank": i, "stdout": str(d / f"{r}.out"), "stderr": str(d / f"{r}.err"),
                   "error_file": str(d / f"{r}.json")} for i, r in enumerate(ranks)]}],
              "failures": failures}
    write_json(str(d / "node.json"), record)


def test_root_cause_is_the_first_own_failure_not_the_first_consequence(tmp_path):
    # rank 2 failed first in time, but as a consequence; rank 1 raised on its own, later.
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    _error_file(str(tmp_path / "a" / "1.json"), "ValueError: a bad batch", 105.0)
    _error_file(str(tmp_path / "b" / "2.json"), "CollectiveError: rank 1 raised ValueError", 100.0, consequence=True)
    (tmp_path / "b" / "3.out").write_text("step 1\nlast words\n")
    _node(tmp_path, "a", 0, [0, 1], [{"rank": 0, "local_rank": 0, "exitcode": -15, "time": 106.0, "error_file": None},
                                      {"rank": 1, "local_rank": 1, "exitcode": 1, "time": 106.0,
                                       "error_file": str(tmp_path / "a" / "1.json")}])
    _node(tmp_path, "b", 1, [2, 3], [{"rank": 2, "local_rank": 0, "exitcode": 1, "time": 101.0,
                                      "error_file": str(tmp_path / "b" / "2.json")}], result="failed")
    from hybridshard.launcher.runlog import read_node_records

    endings = rank_endings(read_node_records(str(tmp_path)))
    assert [e.ending for e in endings] == [Ending.STOPPED, Ending.CAUSE, Ending.CONSEQUENCE, Ending.FINISHED]
    assert root_cause(endings).rank == 1
    lines = render_summary(str(tmp_path))
    assert lines[0].startswith("hybridshard: job failed: root cause rank 1 (a, local rank 1), exit code 1")
    assert lines[1] == "  ValueError: a bad batch"
    assert sum("Traceback" in line for line in lines) == 1
    assert "  rank 0 (a): stopped by its agent after rank 1 failed" in lines
    assert "  rank 3 (b): finished" in lines


def test_a_hang_names_the_rank_that_reported_it_not_the_one_its_agent_stopped(tmp_path):
    # Rank 0's watchdog stopped it (a consequence, precise time); its agent then stopped rank 1, whose
    # time torchrun gives in whole seconds, earlier on paper.
    (tmp_path / "a").mkdir()
    _error_file(str(tmp_path / "a" / "0.json"), "CollectiveError: rank 0: step check cannot complete\n"
                "where every rank is:\n   running  rank 1: not in a collective", 31.8, consequence=True)
    _node(tmp_path, "a", 0, [0, 1], [{"rank": 0, "local_rank": 0, "exitcode": 1, "time": 31.8,
                                      "error_file": str(tmp_path / "a" / "0.json")},
                                     {"rank": 1, "local_rank": 1, "exitcode": -15, "time": 31.0, "error_file": None}])
    lines = render_summary(str(tmp_path))
    assert lines[0].startswith("hybridshard: job failed: root cause rank 0 (a, local rank 0), exit code 1"), lines
    assert "  rank 1 (a): stopped by its agent after rank 0 failed" in lines
    # A consequence leading the summary shows its message (where every rank is), not its traceback.
    assert lines[2:4] == ["  | where every rank is:", "  |    running  rank 1: not in a collective"], lines
    assert not any("Traceback" in line for line in lines)


def test_a_killed_rank_is_named_with_its_signal_and_last_output(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "1.out").write_text("step 0\nrank 1: killing myself\n")
    _node(tmp_path, "a", 0, [0, 1], [{"rank": 1, "local_rank": 1, "exitcode": -signal.SIGKILL, "time": 50.0,
                                      "error_file": None}])
    lines = render_summary(str(tmp_path), expected_nodes=2)
    assert lines[0].startswith("hybridshard: job failed: root cause rank 1 (a, local rank 1), killed by SIGKILL")
    assert lines[1] == "  last output: rank 1: killing myself"
    assert any("1 of 2 nodes left no record" in line for line in lines)


def test_traceback_from_a_log_takes_the_whole_last_chain(tmp_path):
    log = tmp_path / "stderr.log"
    log.write_text("noise\nTraceback (most recent call last):\n  a\nKeyError: 1\n\nDuring handling of the above "
                   "exception, another exception occurred:\n\nTraceback (most recent call last):\n  b\n"
                   "MemoryError: out of memory on the host\nafter\n")
    block, last = traceback_from_log(str(log))
    assert last == "MemoryError: out of memory on the host"
    assert block.startswith("Traceback") and "KeyError: 1" in block and "after" not in block


def test_console_folds_tracebacks_and_keeps_torchrun_off():
    console, log = io.StringIO(), io.StringIO()
    f = ConsoleFilter(console, log)
    for line in ["[rank0] step 1", "[rank0] [rank0]: Traceback (most recent call last):", "[rank0] [rank0]:   File x",
                 "[rank0] [rank0]: RuntimeError: inner", "[rank0] ", "[rank0] [rank0]: The above exception was the "
                 "direct cause of the following exception:", "[rank0] ", "[rank0] [rank0]: Traceback (most recent "
                 "call last):", "[rank0] [rank0]:   File y", "[rank0] [rank0]: CollectiveError: rank 3 was lost",
                 "[rank0] [rank0]:   lost  rank 3", "W1126 torchrun warning", "[hybridshard] restart 1 of 2: rank 3",
                 "[rank0] Traceback (most recent call last):", "[rank0]   File z", "[rank0] ValueError: last"]:
        f.feed(line + "\n")
    f.close()
    assert console.getvalue().splitlines() == [
        "[rank0] step 1", "[rank0] CollectiveError: rank 3 was lost", "[rank0]   lost  rank 3",
        "[hybridshard] restart 1 of 2: rank 3", "[rank0] ValueError: last"]
    assert log.getvalue() == "W1126 torchrun warning\n"


# -- a 2-node x 2-rank job ------------------------------------------------------------------------

def _env():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    env.update(PYTHONPATH=REPO, OMP_NUM_THREADS="1", TORCH_CPP_LOG_LEVEL="ERROR")
    return env


def run_job(mode, tmp_path, port):
    """The job on 2 nodes x 2 ranks: ``(exit status, console lines, run directory)``. The local cluster
    where this machine allows namespaces, else two agents acting as nodes (node 0's console merges)."""
    run_dir = str(tmp_path / "run")
    if NETNS:
        done = subprocess.run([sys.executable, os.path.join(REPO, "launch", "local-cluster"), "--nodes", "2",
                               "--procs-per-node", "2", "--timeout", "150", "--port", str(port), "--log-dir", run_dir,
                               "--", JOB, mode], env=_env(), capture_output=True, text=True, timeout=200, cwd=tmp_path)
        return done.returncode, (done.stdout + done.stderr).splitlines(), run_dir
    procs = [subprocess.Popen([sys.executable, "-m", "hybridshard", "launch", "--nnodes", "2", "--node-rank", str(k),
                               "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
                               "--log-dir", run_dir, "--", JOB, mode], env={**_env(), "HYBRIDSHARD_NODE_NAME": f"node{k}"},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
             for k in (0, 1)]
    outs = [p.communicate(timeout=200)[0] for p in procs]
    return procs[0].returncode or procs[1].returncode, outs[0].splitlines(), run_dir


def rank_logs(run_dir, rank):
    """``(stdout, stderr)`` of ``rank``'s log files (global rank: node rank * 2 + local rank)."""
    node, local = divmod(rank, 2)
    [d] = glob.glob(os.path.join(run_dir, f"node{node}", "*", "attempt_0", str(local)))
    return (open(os.path.join(d, "stdout.log")).read(), open(os.path.join(d, "stderr.log")).read())


def assert_full_logs(run_dir, ranks_and_steps):
    for rank, steps in ranks_and_steps.items():
        out, err = rank_logs(run_dir, rank)
        assert [line for line in out.splitlines() if " step " in line] == [f"rank {rank} step {s}" for s in range(steps)]
        assert f"rank {rank} stderr line {steps - 1}" in err


def failed_job(mode, tmp_path, port, cause, first_line):
    """Run a job that fails; check its summary's root cause (``cause``: what follows ``root cause``) and
    first line, and the bounded console. Returns ``(console text, run directory)``."""
    rc, lines, run_dir = run_job(mode, tmp_path, port)
    text = "\n".join(lines)
    assert rc != 0, text
    [head] = [line for line in lines if "job failed: root cause" in line]
    assert f"root cause {cause}" in head, text
    assert lines[lines.index(head) + 1] == f"  {first_line}", text
    assert "ChildFailedError" not in text and "FAILED" not in text, text  # torchrun's banner
    assert len(lines) <= MAX_LINES, text
    return text, run_dir


def test_job_with_a_killed_rank(tmp_path):
    text, run_dir = failed_job("kill", tmp_path, 29641, "rank 3 (", "last output: rank 3: killing myself at step 2")
    assert "local rank 1), killed by SIGKILL" in text
    assert "Traceback" not in text, text  # the survivors' tracebacks stay in their logs
    assert_full_logs(run_dir, {0: 2, 1: 2, 2: 2})
    assert rank_logs(run_dir, 3)[0].splitlines()[-1] == "rank 3: killing myself at step 2"
    assert "Traceback" in rank_logs(run_dir, 0)[1]  # rank 0's full output, the traceback included
    assert json.load(open(os.path.join(run_dir, "node1", "node.json")))["result"] == "failed"


def test_job_with_a_rank_raising_its_own_error(tmp_path):
    text, run_dir = failed_job("raise", tmp_path, 29643, "rank 1 (",
                               "ValueError: rank 1 found a bad batch at step 2")
    assert "local rank 1), exit code 1" in text
    assert text.count("Traceback (most recent call last)") == 1, text
    assert text.count('raise ValueError(f"rank {rank} found a bad batch') == 1, text
    assert_full_logs(run_dir, {0: 2, 2: 2, 3: 2})
    assert "ValueError: rank 1 found a bad batch at step 2" in rank_logs(run_dir, 1)[1]


def test_job_that_finishes(tmp_path):
    rc, lines, run_dir = run_job("ok", tmp_path, 29645)
    text = "\n".join(lines)
    assert rc == 0, text
    assert "job failed" not in text and "Traceback" not in text
    assert [line.split("] ", 2)[-1] for line in lines if "step" in line] == [f"rank 0 step {s}" for s in range(4)], text
    assert len(lines) <= 12, text
    assert_full_logs(run_dir, {r: 4 for r in range(4)})
