"""One rank of a fault scenario, run as a plain process per rank by ``tests/test_faults.py``.

Trains the runtime tests' model for a few steps; at step 1 rank 1 misbehaves as the scenario says.
Every rank prints one ``RESULT {json}`` line: what it ended with, and how many seconds after the
misbehaviour. An uncaught error then exits non-zero, as in a real job.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import hybridshard as hs  # noqa: E402
from tests import runtime_models as RM  # noqa: E402

SCENARIOS = ("kill", "raise", "zero2_one_rank", "extra_forward", "extra_forward_debug")


def main() -> None:
    if os.environ.get("FAULT_DUMP"):
        import faulthandler

        faulthandler.dump_traceback_later(float(os.environ["FAULT_DUMP"]), exit=True)
    scenario = sys.argv[1]
    assert scenario in SCENARIOS, scenario
    dist.init_process_group("gloo", timeout=timedelta(seconds=float(os.environ.get("FAULT_PG_TIMEOUT", "10"))))
    rank = dist.get_rank()
    torch.set_num_threads(1)
    strategy = "HYBRID_SHARD_ZERO2" if scenario == "zero2_one_rank" else "HYBRID_SHARD"
    model = RM.make_model()
    hs.shard(model, strategy=strategy, groups=hs.init_groups(), wrap={RM.Block},
             debug=scenario == "extra_forward_debug")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    t0 = None
    try:
        for step in range(3):
            opt.zero_grad()
            tokens = RM.batch(step, 0, rank, 2)
            bad = step == 1 and rank == 1
            if bad and scenario.startswith("extra_forward"):
                with hs.no_sync(model):  # one micro-batch more than the other ranks
                    RM.lm_loss(model(tokens), tokens).backward()
            if step == 1:
                t0 = time.monotonic()
            loss = RM.lm_loss(model(tokens), tokens)
            if bad and scenario == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if bad and scenario == "raise":
                raise ValueError("a bad batch on rank 1")
            if bad and scenario == "zero2_one_rank":
                with torch.no_grad():
                    model.blocks[0].fc1.weight.add_(1.0)
            loss.backward()
            opt.step()
    except Exception as err:  # noqa: BLE001 - report, then fail as a real job would
        _report("error", err, t0)
        raise
    _report("ok", None, t0)


def _report(outcome: str, err: BaseException | None, t0: float | None) -> None:
    seconds = time.monotonic() - t0 if t0 is not None else 0.0
    record = {"rank": dist.get_rank(), "outcome": outcome, "seconds": round(seconds, 2),
              "type": type(err).__name__ if err else None, "message": str(err) if err else None}
    print("RESULT " + json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
