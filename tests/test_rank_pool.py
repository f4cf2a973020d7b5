"""The test harness's own promise (tests/mp.py): a run that keeps moving is not cut off by the stall window
(only by ``max_s`` and pytest-timeout's per-test limit, both far above a healthy run), and a hung run
fails once no rank moved for ``stall_s`` (see [Note: progress, not wall-clock])."""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

from tests.mp import RankPool, print_result, read_results

pytestmark = pytest.mark.multiprocess

STALL_S = 4.0


def compute_for(seconds: float) -> int:
    """Busy in Python for ``seconds``, then a collective: slow, but moving all the time."""
    end, total = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        total += sum(range(1000))
    dist.barrier()
    return total


def hang(rank_to_hold: int) -> None:
    """Rank ``rank_to_hold`` waits on an event nobody sets; the others wait for it in a barrier."""
    if dist.get_rank() == rank_to_hold:
        threading.Event().wait()
    dist.barrier()


def read_env(name: str) -> tuple[str | None, str]:
    import os

    return os.environ.get(name), os.environ["RANK"]


@pytest.fixture(scope="module")
def pool():
    with RankPool(2, num_nodes=1, stall_s=STALL_S) as p:
        p.run(compute_for, 0.0)  # started: the runs below time only themselves
        yield p


def test_a_slow_run_that_moves_is_not_cut_off(pool):
    start = time.monotonic()
    assert all(total > 0 for total in pool.run(compute_for, 3 * STALL_S))
    assert time.monotonic() - start >= 3 * STALL_S  # it outlived any fixed deadline of STALL_S


def test_a_hang_fails_after_the_stall_window(pool):
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=rf"hang: no rank made progress for {STALL_S:.0f}s"):
        pool.run(hang, 1, max_s=120)
    elapsed = time.monotonic() - start
    assert STALL_S <= elapsed < STALL_S + 20, elapsed  # not before the window, and soon after it
    assert pool.run(compute_for, 0.0) == [0, 0]  # the pool restarted


def test_a_new_pool_sees_the_environment_of_now_not_the_fork_servers(pool, monkeypatch):
    # The fork server started with the module's pool, before this variable existed.
    monkeypatch.setenv("HYBRIDSHARD_POOL_PROBE", "set after the server started")
    with RankPool(2, num_nodes=1, stall_s=STALL_S) as fresh:
        assert fresh.run(read_env, "HYBRIDSHARD_POOL_PROBE") == [("set after the server started", "0"),
                                                                  ("set after the server started", "1")]


class _Writes:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def write(self, text: str) -> int:
        self.calls.append(text)
        return len(text)

    def flush(self) -> None:
        pass


def test_a_result_is_one_write_and_reads_back_with_other_output_after_it(monkeypatch):
    out = _Writes()
    monkeypatch.setattr("sys.stdout", out)
    print_result({"rank": 2, "message": "a\nb"})
    assert len(out.calls) == 1 and out.calls[0].endswith("}\n"), out.calls  # nothing can land before the newline
    # A C++ warning written between a record and its newline (seen with PYTHONUNBUFFERED=1 and print()).
    text = "log\n" + out.calls[0].rstrip("\n") + "[W c10d] sendBytes failed: Broken pipe\nRESULT {\"b\": [1]}\n"
    assert read_results(text) == [{"rank": 2, "message": "a\nb"}, {"b": [1]}]
