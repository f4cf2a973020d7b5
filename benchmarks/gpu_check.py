"""`make gpu-check`: what only a GPU can measure, in priority order, within a fixed time.

A lent GPU machine has about 15 minutes of device time, start-up included, so the steps run in the
order of what they are worth, each as its own processes under its own time budget (the budgets add
up to 690 s, 11 min 30 s), and each of a step's commands prints one line of figures starting
``step N (<name>):`` (steps 2 and 4 run two commands each: fp32 and bf16; one rank and two). The
first steps give the most if time runs out:

1. host syncs on the device, per phase, against the emulator's count (benchmarks/host_sync_check.py)
2. the single-GPU step against FSDP2, fp32 and bf16 (benchmarks/gpu_step.py)
3. one rank of a 64-GPU job on torch's fake process group (benchmarks/big_rank.py)
4. peak memory of the 1- and 2-rank jobs against the planner, by phase (benchmarks/memory_trace.py)
5. a stream-race check under ``TORCH_CUDA_SANITIZER=1`` (benchmarks/stream_race.py)
6. the CUDA path's correctness tests (tests/test_cuda.py)
7. one rank of a 256-GPU job with shard groups over 2 nodes, 405B-shaped units cut to the layers that
   fit the GPU (benchmarks/big_rank_nodes.py)

Each command's whole output is kept in ``build/gpu-check-logs/step<N>-<k>.log``. Without a CUDA
device every step prints ``step N (<name>): skipped: <why>`` and the driver exits 0.

    python benchmarks/gpu_check.py                      # every step
    GPU_CHECK_STEPS=1,3 python benchmarks/gpu_check.py  # a subset, still in this order
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PYTEST_SUMMARY = re.compile(r"^\d+ (passed|failed|skipped|error)")


@dataclass(frozen=True)
class Step:
    number: int
    name: str
    budget_s: int
    """Wall-clock seconds the step's processes may take together (the driver kills them after)."""
    commands: tuple[tuple[str, ...], ...]
    """Each an argv after the Python interpreter; run one after the other."""
    env: tuple[tuple[str, str], ...] = ()


def _torchrun(nproc: int, script: str, *args: str) -> tuple[str, ...]:
    return ("-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", script, *args)


STEPS = (
    Step(1, "host syncs on the device", 90, (("benchmarks/host_sync_check.py",),)),
    Step(2, "one-GPU step vs FSDP2", 100, (("benchmarks/gpu_step.py",),
                                           ("benchmarks/gpu_step.py", "--dtype", "bf16"))),
    Step(3, "one rank of a 64-GPU job", 110, (("benchmarks/big_rank.py",),)),
    Step(4, "peak memory vs planner by phase", 70, (_torchrun(1, "benchmarks/memory_trace.py", "--backend", "nccl"),
                                                    _torchrun(2, "benchmarks/memory_trace.py", "--backend", "gloo"))),
    Step(5, "stream races under the CUDA sanitizer", 80, (_torchrun(2, "benchmarks/stream_race.py"),),
         env=(("TORCH_CUDA_SANITIZER", "1"),)),
    Step(6, "CUDA path against the CPU reference", 140,
         (("-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "tests/test_cuda.py"),)),
    Step(7, "one rank of a 256-GPU job, shard groups over 2 nodes", 100, (("benchmarks/big_rank_nodes.py",),)),
)
TOTAL_BUDGET_S = sum(s.budget_s for s in STEPS)


def selected(spec: str | None) -> list[Step]:
    """The steps ``GPU_CHECK_STEPS`` names (``"1,3"``; empty or unset: all), in the fixed order."""
    if not spec or not spec.strip():
        return list(STEPS)
    known = {s.number: s for s in STEPS}
    try:
        wanted = {int(part) for part in spec.split(",") if part.strip()}
    except ValueError:
        wanted = set()
    if not wanted or not wanted <= set(known):
        raise ValueError(f"GPU_CHECK_STEPS must be step numbers from {sorted(known)} separated by commas "
                         f"(e.g. 1,3); found {spec!r}. Unset it to run every step")
    return [known[n] for n in sorted(wanted)]


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def run_step(step: Step, python: str = sys.executable, logs: str | None = None) -> bool:
    """Run one step's commands within its budget; print their figure lines (prefixed) and a closing
    line. Each command's whole output goes to ``<logs>/step<N>-<k>.log``."""
    head = f"step {step.number} ({step.name})"
    env = {**os.environ, **dict(step.env), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    # Last: an installed hybridshard (make gpu-check's site beside the node's torch) comes first; the
    # checkout adds tests/ (hybridshard.topology exists only installed).
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH", ""), ROOT) if p)
    logs = logs or os.path.join(ROOT, "build", "gpu-check-logs")
    os.makedirs(logs, exist_ok=True)
    start = time.monotonic()
    ok = True
    for k, argv in enumerate(step.commands):
        what = " ".join(argv[:4])
        left = step.budget_s - (time.monotonic() - start)
        if left <= 1:
            print(f"{head}: out of its {step.budget_s} s budget before {what}", flush=True)
            return False
        # A session of its own, so that a stopped step takes its children (torchrun's ranks) with it.
        proc = subprocess.Popen([python, *argv], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=left)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            _save(logs, step, k, argv, out, err)
            _figures(head, out)
            print(f"{head}: stopped at its {step.budget_s} s budget in {what}", flush=True)
            return False
        log = _save(logs, step, k, argv, out, err)
        _figures(head, out)
        if proc.returncode != 0:
            ok = False
            tail = "\n    ".join((out + err).strip().splitlines()[-15:])
            print(f"{head}: FAILED (exit {proc.returncode}) in {what} (whole output: {log}):\n    {tail}", flush=True)
    print(f"{head}: {'done' if ok else 'failed'} in {time.monotonic() - start:.0f} s "
          f"(budget {step.budget_s} s; output in {logs})", flush=True)
    return ok


def _save(logs: str, step: Step, k: int, argv: tuple[str, ...], out: str, err: str) -> str:
    path = os.path.join(logs, f"step{step.number}-{k}.log")
    with open(path, "w") as f:
        f.write(f"$ python {' '.join(argv)}\n{out}\n--- stderr ---\n{err}")
    return path


def _figures(head: str, stdout: str) -> None:
    """The lines a step's scripts mark as figures (``figures: ...``), under the step's name."""
    for line in stdout.splitlines():
        if line.startswith("figures: "):
            print(f"{head}: {line[len('figures: '):]}", flush=True)
        elif _PYTEST_SUMMARY.match(line):
            print(f"{head}: tests/test_cuda.py: {line.strip()}", flush=True)


def main() -> int:
    try:
        steps = selected(os.environ.get("GPU_CHECK_STEPS"))
    except ValueError as e:
        print(f"gpu_check: {e}", file=sys.stderr)
        return 2
    if not cuda_available():
        for step in steps:
            print(f"step {step.number} ({step.name}): skipped: no CUDA device on this machine")
        return 0
    print(f"gpu_check: steps {[s.number for s in steps]}, budget {sum(s.budget_s for s in steps)} s "
          f"(all steps: {TOTAL_BUDGET_S} s)", flush=True)
    failed = [s.number for s in steps if not run_step(s)]
    if failed:
        print(f"gpu_check: steps {failed} failed or ran out of time")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
