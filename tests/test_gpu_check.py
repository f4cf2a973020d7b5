"""`make gpu-check`'s driver (benchmarks/gpu_check.py) and its steps on a machine without a GPU.

Every step must skip with a clear line and exit 0 here, ``GPU_CHECK_STEPS`` must select, and the
one part that runs on CPU as well, one rank of a 64-rank job on torch's fake process group, runs as
its scaled-down stand-in: the same script and code path with a small model.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check  # noqa: E402

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the skips of a machine without CUDA")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _run(argv: list[str], timeout: int = 120, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], cwd=ROOT, env={**ENV, **env}, capture_output=True, text=True,
                          timeout=timeout)


def test_steps_are_in_priority_order_within_twelve_minutes():
    assert [s.number for s in gpu_check.STEPS] == [1, 2, 3, 4, 5, 6, 7]
    assert gpu_check.TOTAL_BUDGET_S <= 12 * 60 - 30  # leaves time for the NVML recording and start-up
    assert [s.number for s in gpu_check.selected("3, 1")] == [1, 3]
    assert [s.number for s in gpu_check.selected("")] == [1, 2, 3, 4, 5, 6, 7]
    for bad in ("8", "1,x", ","):
        with pytest.raises(ValueError, match=r"^GPU_CHECK_STEPS must be step numbers from \[1, 2, 3, 4, 5, 6, 7\]"):
            gpu_check.selected(bad)


@no_gpu
def test_driver_skips_every_step_and_exits_0():
    done = _run(["benchmarks/gpu_check.py"], GPU_CHECK_STEPS="")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines == [f"step {s.number} ({s.name}): skipped: no CUDA device on this machine" for s in gpu_check.STEPS]


@no_gpu
def test_gpu_check_steps_selects_and_refuses_unknown_steps():
    done = _run(["benchmarks/gpu_check.py"], GPU_CHECK_STEPS="1,3")
    assert done.returncode == 0, done.stderr
    assert [line.split(" (")[0] for line in done.stdout.splitlines()] == ["step 1", "step 3"]
    bad = _run(["benchmarks/gpu_check.py"], GPU_CHECK_STEPS="9")
    assert bad.returncode == 2 and "found '9'" in bad.stderr and not bad.stdout


@no_gpu
@pytest.mark.parametrize("script", ["host_sync_check.py", "gpu_step.py", "big_rank.py", "memory_trace.py",
                                    "stream_race.py", "big_rank_nodes.py"])
def test_each_step_script_skips_without_a_gpu(script):
    args = ["--backend", "gloo"] if script == "memory_trace.py" else []
    done = _run([f"benchmarks/{script}", *args])
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("skipped: no CUDA device on this machine") or \
        "skipped: no CUDA device on this machine (" in done.stdout, done.stdout


def test_one_rank_of_a_64_rank_job_stand_in(tmp_path):
    """The fake process group's store refuses every call: the runtime must go without one (peers.store()
    is None), and the peak against the planner is computed for both hybridshard systems."""
    out = tmp_path / "big.json"
    done = _run(["benchmarks/big_rank.py", "--stand-in", "--steps", "2", "--warmup", "1", "--json", str(out)],
                timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "figures: CPU stand-in rank 0 of 64 (8x8 fake mesh)" in done.stdout, done.stdout
    got = json.loads(out.read_text())
    assert got["store"] == {"found": False, "failed_calls": 0}, got["store"]
    for name in ("hybrid", "sliced"):
        r = got[name]
        assert r["peak_bytes"] > 0 and r["planned_bytes"] > 0 and r["ratio"] == r["peak_bytes"] / r["planned_bytes"]
        assert r["step_ms"] > 0
    # The optimizer sliced across 8 replicas holds less: its planned and measured peaks are both lower.
    assert got["sliced"]["planned_bytes"] < got["hybrid"]["planned_bytes"]
    assert got["sliced"]["peak_bytes"] < got["hybrid"]["peak_bytes"]
    assert got["fsdp2"]["step_ms"] > 0


def test_one_rank_of_a_256_rank_job_with_shard_groups_over_two_nodes_stand_in(tmp_path):
    """Step 7's script on CPU: 32 fake nodes of 8, shard groups of 2 nodes built by the planner with
    their two hops; every setting measured against its own planner row, the secondary shard planned
    only where asked and freed by the end of the step."""
    out = tmp_path / "nodes.json"
    done = _run(["benchmarks/big_rank_nodes.py", "--stand-in", "--steps", "1", "--warmup", "1", "--json", str(out)],
                timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "figures: CPU stand-in rank 0 of 256 (32 nodes x 8, shard groups of 2 nodes: 16x16 fake groups)" in done.stdout, done.stdout
    got = json.loads(out.read_text())
    assert got["groups"] == {"shard_size": 16, "replicate_size": 16, "two_hops": True}, got["groups"]
    assert got["store"] == {"found": False, "failed_calls": 0}, got["store"]
    for name in ("two", "node", "sliced"):
        r = got[name]
        assert r["peak_bytes"] > 0 and r["ratio"] == r["peak_bytes"] / r["planned_bytes"] and r["step_ms"] > 0
        assert r["secondary_held_after_step"] == 0, (name, r)
    assert got["node"]["secondary_planned_bytes"] > 0 == got["two"]["secondary_planned_bytes"]
    # the secondary shards take the place of the hop across nodes' results held by the gathers in flight
    assert got["two"]["hop_planned_bytes"] > 0 == got["node"]["hop_planned_bytes"]
    assert got["node"]["planned_bytes"] == got["two"]["planned_bytes"] - got["two"]["hop_planned_bytes"] \
        + got["node"]["secondary_planned_bytes"]
    assert got["sliced"]["planned_bytes"] < got["two"]["planned_bytes"]
    assert got["sliced"]["peak_bytes"] < got["two"]["peak_bytes"]


def test_stream_race_subset_runs_on_cpu():
    """Step 5's run without the GPU and its sanitizer: the same subset (the optimizer sliced across 2
    replicas, shard groups of one) trains its 3 steps on 2 gloo ranks."""
    done = _run(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "benchmarks/stream_race.py",
                 "--cpu"], timeout=180)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "figures: CPU dry run, no sanitizer: HYBRID_SHARD sliced across 2 replicas" in done.stdout, done.stdout


def test_device_sync_warnings_are_attributed_as_the_emulator_counts():
    """Step 1 on the GPU counts torch's sync-debug warnings by phase and caller; here the warnings are
    raised by hand from code that claims to be hybridshard's, torch's GradScaler's, or the user's."""
    import warnings

    import host_sync_check as H

    from hybridshard.runtime.trace.position import where

    def from_file(path: str) -> None:
        code = compile("def sync(w):\n    w.warn('called a synchronizing CUDA operation')\n", path, "exec")
        scope: dict = {}
        exec(code, scope)
        scope["sync"](warnings)

    def through_torch(path: str) -> None:  # hybridshard's code calling a torch wrapper that syncs
        inner: dict = {}
        exec(compile("def sync(w):\n    w.warn('called a synchronizing CUDA operation')\n",
                     os.path.join(H._TORCH, "cuda", "streams.py"), "exec"), inner)
        outer = {"inner": inner["sync"]}
        exec(compile("def call(w):\n    inner(w)\n", path, "exec"), outer)
        outer["call"](warnings)

    syncs = H.DeviceSyncs()
    phase = where.phase
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = syncs.show
        try:
            where.phase = "backward"
            from_file(os.path.join(H._PACKAGE, "runtime", "agreement.py"))
            from_file(os.path.join(H._PACKAGE, "runtime", "agreement.py"))
            where.phase = "forward"
            through_torch(os.path.join(H._PACKAGE, "runtime", "streams.py"))
            where.phase = "other"
            from_file(os.path.join(H._PACKAGE, "runtime", "grad_norm.py"))
            from_file(os.path.join(H._TORCH, "amp", "grad_scaler.py"))
            from_file(str(ROOT / "train.py"))
            warnings.warn("an unrelated warning")
        finally:
            where.phase = phase
    assert syncs.by_phase == {("hot", "backward"): 2, ("hot", "forward"): 1, ("exempt", "other"): 2, ("other", "other"): 1}, syncs.by_phase


def test_a_step_over_its_budget_is_stopped_with_its_children(tmp_path, capsys):
    """A step that runs past its budget is stopped, children included (torchrun's ranks), and said so."""
    import psutil

    pid_file = tmp_path / "child.pid"
    code = ("import subprocess, sys, time; "
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], "
            "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); "
            f"open({str(pid_file)!r}, 'w').write(str(p.pid)); print('figures: started', flush=True); time.sleep(120)")
    step = gpu_check.Step(9, "sleeps", 4, (("-c", code),))
    start = time.monotonic()
    assert gpu_check.run_step(step, logs=str(tmp_path)) is False
    assert time.monotonic() - start < 30
    out = capsys.readouterr().out
    assert "step 9 (sleeps): started" in out and "step 9 (sleeps): stopped at its 4 s budget" in out, out
    child = int(pid_file.read_text())
    try:
        psutil.Process(child).wait(timeout=5)  # SIGKILL sent: gone at once (a zombie, if nobody reaps it)
    except (psutil.NoSuchProcess, psutil.TimeoutExpired):
        pass
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE
    assert (tmp_path / "step9-0.log").read_text().startswith("$ python -c")
