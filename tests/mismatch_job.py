"""One rank of a control-plane fault that leaves every rank alive, run per rank by ``tests/test_mismatch.py``.

Trains the runtime tests' model for one step, then, as the scenario says:

- ``entry_alone``: rank 0 calls ``hs.full_state_dict`` alone, then every rank calls ``dist.barrier()``;
- ``late``: ``ROUNDS`` times, rank 3 sleeps ``LATE_SECONDS`` outside any collective before
  ``hs.full_state_dict`` and again before a barrier, which every rank calls; then every rank trains
  one more step: nothing may be reported;
- ``host_raises``: rank 0 hosts the job's store (``JOB_STORE_ON_RANK0=1``, no agent store) and raises at step 1
  before its forward, so its exit takes the store down while the others wait in the forward.

Every rank prints ``RESULT {json}`` when it ends on its own (finished, or an error raised); a rank
stopped by the watchdog prints none and exits with status 1, its message in its log.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import hybridshard as hs  # noqa: E402
from tests import runtime_models as RM  # noqa: E402
from tests.mp import print_result  # noqa: E402


def main() -> None:
    scenario = sys.argv[1]
    timeout = timedelta(seconds=float(os.environ.get("JOB_PG_TIMEOUT", "60")))
    if os.environ.get("JOB_STORE_ON_RANK0") == "1":
        # Rank 0 hosts the job's store (no agent store), on a port the kernel picks as it binds it; the
        # others learn the port through the test's store at MASTER_PORT, so no port is probed and re-bound.
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        side = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                             timeout=timeout)
        if rank == 0:
            store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, timeout=timeout, wait_for_workers=False)
            side.set("job_store_port", str(store.port))
        else:
            store = dist.TCPStore("127.0.0.1", int(side.get("job_store_port")), is_master=False, timeout=timeout)
        os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"  # the store lives in rank 0's process
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    else:
        dist.init_process_group("gloo", timeout=timeout)
    rank = dist.get_rank()
    torch.set_num_threads(1)
    model = RM.make_model(num_blocks=2)
    hs.shard(model, strategy="HYBRID_SHARD", groups=hs.init_groups(), wrap={RM.Block})
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    t0 = time.monotonic()
    try:
        for step in range(2):
            opt.zero_grad()
            tokens = RM.batch(step, 0, rank, 2)
            if step == 1:
                t0 = time.monotonic()
                print(f"STEP1 {time.time()}", flush=True)
            if step == 1 and scenario == "entry_alone":
                if rank == 0:
                    hs.full_state_dict(model)  # a job-wide call on rank 0 only
                dist.barrier()
            if step == 1 and scenario == "late":
                for _ in range(int(os.environ.get("ROUNDS", "1"))):
                    if rank == 3:
                        time.sleep(float(os.environ["LATE_SECONDS"]))  # late: outside any collective
                    hs.full_state_dict(model)  # the others wait inside it
                    if rank == 3:
                        time.sleep(float(os.environ["LATE_SECONDS"]))
                    dist.barrier()  # the others wait in the user's barrier
            if step == 1 and scenario == "host_raises" and rank == 0:
                raise ValueError("a bad batch on rank 0")
            RM.lm_loss(model(tokens), tokens).backward()
            opt.step()
    except Exception as err:  # noqa: BLE001 - report, then fail as a real job would
        _report("error", err, t0)
        raise
    _report("ok", None, t0)


def _report(outcome: str, err: BaseException | None, t0: float) -> None:
    record = {"rank": dist.get_rank(), "outcome": outcome, "seconds": round(time.monotonic() - t0, 2),
              "type": type(err).__name__ if err else None, "message": str(err) if err else None}
    print_result(record)


if __name__ == "__main__":
    main()
