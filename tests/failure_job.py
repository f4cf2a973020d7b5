"""A 4-rank job that fails in a chosen way, for the launcher's failure summary (tests/test_summary.py).

    python tests/failure_job.py kill|raise|oom|hang|ok

Every rank trains a small sharded model for 4 steps and prints ``rank R step S`` each step; with
``kill`` rank 3 SIGKILLs itself at step 2, with ``raise`` rank 1 raises its own ValueError there,
with ``oom`` rank 2 raises MemoryError (out of host memory, as a test makes it), with ``hang`` rank 1
sleeps there (the others wait in a collective; docs/launching.md shows what each prints).
"""

import datetime
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import hybridshard as hs


def main(mode: str) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = hs.shard(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1)), strategy="HYBRID_SHARD",
                     groups=hs.init_groups())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        if step == 2 and mode == "kill" and rank == 3:
            print(f"rank {rank}: killing myself at step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if step == 2 and mode == "raise" and rank == 1:
            raise ValueError(f"rank {rank} found a bad batch at step {step}")
        if step == 2 and mode == "oom" and rank == 2:
            raise MemoryError("out of host memory allocating the step's activations (raised by the test)")
        if step == 2 and mode == "hang" and rank == 1:
            time.sleep(3600)
        loss = model(torch.randn(4, 8)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"rank {rank} step {step}", flush=True)
        print(f"rank {rank} stderr line {step}", file=sys.stderr, flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
