"""One rank of a fault scenario, run as a plain process per rank by ``tests/test_faults.py``.

Trains the runtime tests' model for a few steps; at step 1 rank 1 misbehaves as the scenario says.
Every rank prints one ``RESULT {json}`` line: what it ended with, how many seconds after the
misbehaviour, and whether its weights still equal those after the last complete step. An uncaught
error then exits non-zero, as in a real job.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import hybridshard as hs  # noqa: E402
from tests import runtime_models as RM  # noqa: E402
from tests.mp import print_result  # noqa: E402

SCENARIOS = (
    "kill", "raise", "zero2_one_rank", "extra_forward", "extra_forward_debug", "extra_forward_unchecked",
    "skip_backward", "skip_step", "reverse_order", "one_rank_collective", "hang",
)


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
    model = RM.make_model(num_blocks=3)
    hs.shard(model, strategy=strategy, groups=hs.init_groups(), wrap={RM.Block},
             debug=scenario == "extra_forward_debug", check_steps=scenario != "extra_forward_unchecked")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    t0 = None
    state = {"saved": _weights(opt)}
    try:
        for step in range(3):
            opt.zero_grad()
            tokens = RM.batch(step, 0, rank, 2)
            bad = step == 1 and rank == 1
            if step == 1:
                t0 = time.monotonic()
            if step == 1 and scenario == "one_rank_collective":
                if rank == 0:
                    _signal_on_hang_report()
                    hs.full_state_dict(model)  # a collective on rank 0 only: the others never join
                else:
                    _evaluate_until_hang_report(float(os.environ.get("FAULT_SLEEP", "120")))
                break
            if bad and scenario == "hang":  # frozen: its sockets stay open, its watchdog answers nothing
                print(f"HUNG {time.monotonic()}", flush=True)
                subprocess.Popen(["sh", "-c", f"sleep {os.environ.get('FAULT_SLEEP', '25')}; kill -9 {os.getpid()}"])
                os.kill(os.getpid(), signal.SIGSTOP)
            if bad and scenario == "skip_step":
                continue  # the whole step, forward included
            if bad and scenario.startswith("extra_forward"):
                with hs.no_sync(model):  # one micro-batch more than the other ranks
                    RM.lm_loss(model(tokens), tokens).backward()
            if bad and scenario == "reverse_order":
                model.blocks = torch.nn.ModuleList(reversed(list(model.blocks)))  # a data-dependent branch
            loss = RM.lm_loss(model(tokens), tokens)
            if bad and scenario == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if bad and scenario == "raise":
                raise ValueError("a bad batch on rank 1")
            if bad and scenario == "skip_backward":
                continue  # a non-finite loss, say: skipped after its forward
            if bad and scenario == "zero2_one_rank":
                with torch.no_grad():
                    model.blocks[0].fc1.weight.add_(1.0)
            loss.backward()
            opt.step()
            state["saved"] = _weights(opt)
    except Exception as err:  # noqa: BLE001 - report, then fail as a real job would
        _report("error", err, t0, opt, state["saved"])
        raise
    _report("ok", None, t0, opt, state["saved"])


HANG_REPORT_KEY = "fault_job/hang-report-written"


def _side_store() -> dist.TCPStore:
    """A connection of its own to the job's store (the runtime's threads keep using theirs)."""
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=timedelta(seconds=30))


class _HangReportSeen(logging.StreamHandler):
    """Prints warnings to stderr as Python does for a library without handlers (this handler takes
    that place), and sets ``HANG_REPORT_KEY`` once the watchdog's hang report is out."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)
        self.setLevel(logging.WARNING)
        self.store = _side_store()

    def emit(self, record: logging.LogRecord) -> None:
        super().emit(record)
        if "has been in" in record.getMessage():
            self.flush()
            self.store.set(HANG_REPORT_KEY, "1")


def _signal_on_hang_report() -> None:
    logging.getLogger("hybridshard").addHandler(_HangReportSeen())


def _evaluate_until_hang_report(at_most_s: float) -> None:
    """Stay outside any collective ("evaluating") until rank 0's hang report, which asks this rank where
    it is, has been written: not for a fixed time a loaded machine may not leave the report."""
    try:
        _side_store().wait([HANG_REPORT_KEY], timedelta(seconds=at_most_s))
    except (RuntimeError, dist.DistError) as err:  # the report never came: the test says so
        print(f"no hang report within {at_most_s:.0f}s: {err}", flush=True)


def _weights(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """This rank's weights: the optimizer's parameters (the master shards, also mid-step)."""
    return [p.detach().clone() for g in opt.param_groups for p in g["params"]]


def _report(outcome: str, err: BaseException | None, t0: float | None, opt, saved) -> None:
    seconds = time.monotonic() - t0 if t0 is not None else 0.0
    unchanged = all(torch.equal(a, b) for a, b in zip(_weights(opt), saved))
    record = {"rank": dist.get_rank(), "outcome": outcome, "seconds": round(seconds, 2),
              "type": type(err).__name__ if err else None, "message": str(err) if err else None,
              "weights_unchanged": unchanged}
    print_result(record)


if __name__ == "__main__":
    main()
