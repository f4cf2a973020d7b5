"""The scale harness's ranks spread over worker processes (``control_plane_scale.py --processes N``).

One interpreter cannot run thousands of rank threads on time: each rank's watchdog takes a fraction
of a millisecond of interpreter time a second, and at 4,096 ranks one interpreter lock has less time
than they need (see docs/scale.md). Here the job's store (a libuv TCPStore server) stays in the main
process, and each of N spawned workers hosts a contiguous share of the ranks as threads, with the
same :class:`~control_plane_ranks.Ranks` as the one-process form; the main process runs the phases
and forwards each call to every worker over a pipe. The workers still share this machine's cores.
"""

from __future__ import annotations

import logging
import multiprocessing
import sys
import threading
from datetime import timedelta
from typing import Any

import torch.distributed as dist


def _serve(conn: Any, world: int, port: int, lo: int, hi: int, interval: float) -> None:
    """A worker: ranks ``lo``..``hi - 1`` as threads, answering the main process's calls until ``close``."""
    from control_plane_ranks import Ranks  # noqa: PLC0415 - imported in the worker

    threading.stack_size(512 * 1024)  # as the main process: hundreds of watchdog threads
    logging.getLogger("hybridshard").setLevel(logging.CRITICAL + 1)  # reports are read from what ranks published
    sys.setswitchinterval(interval)  # see [Note: a thousand ranks under one lock] in control_plane_ranks
    ranks = Ranks(world, port, lo, hi)
    conn.send(("ready", None))
    while True:
        name, args = conn.recv()
        try:
            result = getattr(ranks, name)(*args)
        except Exception as e:  # noqa: BLE001 - the main process reports it
            conn.send(("error", f"{type(e).__name__}: {e}"))
            continue
        conn.send(("ok", result))
        if name == "close":
            return


class ProcessJob:
    """W ranks over ``processes`` worker processes, with :class:`~control_plane_ranks.Job`'s calls."""

    def __init__(self, world: int, processes: int, interval: float) -> None:
        self.world = world
        self.server = dist.TCPStore("127.0.0.1", 0, is_master=True, use_libuv=True, wait_for_workers=False,
                                    timeout=timedelta(seconds=60))
        ctx = multiprocessing.get_context("spawn")  # no fork of a process with the store's threads
        bounds = [(world * i // processes, world * (i + 1) // processes) for i in range(processes)]
        self._conns, self._procs = [], []
        for lo, hi in bounds:
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(theirs, world, self.server.port, lo, hi, interval), daemon=True)
            proc.start()
            self._conns.append(mine)
            self._procs.append(proc)
        for conn in self._conns:
            self._answer(conn, timeout=600)

    def _answer(self, conn: Any, timeout: float = 300) -> Any:
        if not conn.poll(timeout):
            raise RuntimeError(f"a harness worker did not answer within {timeout:.0f}s")
        status, value = conn.recv()
        if status == "error":
            raise RuntimeError(f"a harness worker failed: {value}")
        return value

    def _all(self, name: str, *args: Any) -> list[Any]:
        for conn in self._conns:
            conn.send((name, args))
        return [self._answer(conn) for conn in self._conns]

    def start(self) -> None:
        self._all("start")

    def cpu(self) -> dict[int, float]:
        return {r: v for part in self._all("cpu") for r, v in part.items()}

    def counts(self) -> tuple[int, int, int, int]:
        parts = self._all("counts")
        return tuple(sum(p[i] for p in parts) for i in range(4))  # type: ignore[return-value]

    def beat_rates(self, since: float, until: float) -> list[tuple[int, float]]:
        return [r for part in self._all("beat_rates", since, until) for r in part]

    def begin_all(self, ranks: range) -> None:
        self._all("begin_all", ranks)

    def end_all(self) -> None:
        self._all("end_all")

    def asking(self) -> int:
        return sum(self._all("asking"))

    def checks(self) -> int:
        return sum(self._all("checks"))

    def kill(self, rank: int) -> None:
        self._all("kill", rank)

    def stopped(self, clear: bool = False) -> dict[int, tuple[float, str, float]]:
        return {r: v for part in self._all("stopped", clear) for r, v in part.items()}

    def set_limits(self, fault_s: float | None) -> None:
        self._all("set_limits", fault_s)

    def lag(self) -> float:
        return max(self._all("lag"))

    def close(self) -> None:
        try:
            self._all("close")
        finally:
            for proc in self._procs:
                proc.join(timeout=30)
                if proc.is_alive():
                    proc.kill()
