"""Peak CUDA memory of the CUDA checks' memory runs against the planner, traced by phase and unit.

The job of ``benchmarks/memory_job.py``'s ``memory_run`` (8 linear units of 1024 x 1024, batch 16, the second
AdamW step), per strategy, with marks at every unit's forward, at every unit's backward (a hook on
its output's gradient), before the optimizer step and after it. At each mark the peak since the
previous one is read and reset, so the trace says in which phase and unit the step's peak was and how
much was allocated there; the step's peak is compared with ``sizing.memory`` (target: within 1.10x).

    torchrun --standalone --nproc-per-node 1 benchmarks/memory_trace.py --backend nccl
    torchrun --standalone --nproc-per-node 2 benchmarks/memory_trace.py --backend gloo

Without a CUDA device it prints why and exits 0.
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # after an installed hybridshard

import hybridshard as hs  # noqa: E402
from memory_job import STRATEGIES, memory_model, memory_plan  # noqa: E402  (benchmarks/memory_job.py)

TARGET = 1.10


class Trace:
    """``(mark, peak bytes since the previous mark, allocated at the mark)``, bytes above ``base``."""

    def __init__(self, device: torch.device, base: int) -> None:
        self.device, self.base, self.rows = device, base, []

    def mark(self, label: str) -> None:
        peak = torch.cuda.max_memory_allocated(self.device) - self.base
        self.rows.append((label, peak, torch.cuda.memory_allocated(self.device) - self.base))
        torch.cuda.reset_peak_memory_stats(self.device)


def traced_run(strategy: str, groups: hs.ShardGroups, show: bool = True) -> tuple[int, int, tuple[str, int, int]]:
    device = groups.device
    base, model, opt, x = memory_model(strategy, groups)
    trace = Trace(device, base)
    def on_output(i: int):
        def hook(module: nn.Module, args: object, out: torch.Tensor) -> None:
            out.register_hook(lambda grad: trace.mark(f"backward unit {i}"))  # unit i's backward starts
        return hook

    for i, layer in enumerate(model.layers):
        layer.register_forward_pre_hook(lambda m, a, i=i: trace.mark(f"forward unit {i}"))
        layer.register_forward_hook(on_output(i))
    for step in range(2):
        torch.cuda.synchronize(device)
        trace.rows.clear()
        torch.cuda.reset_peak_memory_stats(device)
        opt.zero_grad(set_to_none=True)
        loss = model(x).square().mean()
        trace.mark("loss")
        loss.backward()
        trace.mark("end of backward")
        opt.step()
        torch.cuda.synchronize(device)
        trace.mark("optimizer step")
    plan = memory_plan(strategy, groups, model)
    # The peak since a mark is read at the next one: row k's peak happened between marks k-1 and k.
    labels = ["start"] + [r[0] for r in trace.rows]
    at = max(range(len(trace.rows)), key=lambda k: trace.rows[k][1])
    measured = trace.rows[at][1]
    if show and dist.get_rank() == 0:  # the whole second step: where each phase's peak and allocation stood
        print(f"  {strategy} trace (MiB, peak since the previous mark / allocated at the mark): "
              + ", ".join(f"{label} {peak / 2**20:.0f}/{alloc / 2**20:.0f}" for label, peak, alloc in trace.rows),
              flush=True)
    del model, opt, x
    return measured, plan.total, (f"{labels[at]} -> {labels[at + 1]}", trace.rows[at - 1][2] if at else 0,
                                  trace.rows[at][2])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=["nccl", "gloo"], required=True)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("memory_trace: skipped: no CUDA device on this machine")
        return 0
    dist.init_process_group(args.backend, timeout=timedelta(seconds=60))
    groups = hs.init_groups()
    world, worst, parts = dist.get_world_size(), 0.0, []
    # A first run, not counted: the process's one-time allocations (cuBLAS's workspace for each thread
    # that multiplies: the main thread's forward, autograd's backward) outlive it, and the planner
    # leaves them out with the CUDA context. Measured in the first strategy, they read as its peak.
    traced_run(STRATEGIES[0], groups, show=False)
    for strategy in STRATEGIES:
        measured, plan, (where, before, after) = traced_run(strategy, groups)
        ratio = measured / plan
        worst = max(worst, ratio)
        if dist.get_rank() == 0:
            print(f"  {strategy} ({args.backend}, {world} rank(s)): peak {measured / 2**20:.1f} MiB between "
                  f"{where} (allocated {before / 2**20:.1f} -> {after / 2**20:.1f} MiB), planned "
                  f"{plan / 2**20:.1f} MiB, ratio {ratio:.2f}", flush=True)
        parts.append(f"{strategy} {ratio:.2f} ({where})")
    if dist.get_rank() == 0:
        print(f"figures: peak/planned, {world} rank(s) {args.backend}: {', '.join(parts)}; worst {worst:.2f} "
              f"(target <= {TARGET})", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
