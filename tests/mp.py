"""Multi-process test harness: a pool of gloo ranks that runs many test functions.

Starting ranks costs seconds, so a test module creates one :class:`RankPool` (usually a
module-scoped fixture) and runs every check through it::

    pool = RankPool(4, num_nodes=2, layout="block")
    results = pool.run(check_something, 3, flag=True)    # one result per rank, in rank order

``fn`` must be a module-level function (it is pickled by reference) and runs on every rank with the
default process group initialised (gloo over a file store). Each rank sees ``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``LOCAL_WORLD_SIZE`` and ``HYBRIDSHARD_NODE_NAME`` as torchrun plus a simulated node
would set them. ``layout="block"`` places ranks ``[0, 1]`` on node0 and ``[2, 3]`` on node1;
``layout="cyclic"`` places them round-robin (SLURM ``--distribution=cyclic``): node0 gets ``[0, 2]``.

A rank that raises fails the run with its traceback. A run in which no rank makes progress for
``stall_s`` seconds kills every rank and raises ``TimeoutError`` (then the pool restarts on its next
use), so a hang fails fast; see [Note: progress, not wall-clock].

[Note: progress, not wall-clock]
A fixed deadline per run either flakes on a loaded machine (two cores shared by several test runs
stretch a 20 s job past any bound chosen on an idle one) or, set wide enough never to flake, makes a
hang cost minutes. So the pool's deadline moves with progress. Each rank runs a sampler thread that,
every ``SAMPLE_S``, looks at its main thread and bumps the rank's tick in a shared array when the
thread used CPU time (its own clock, ``pthread_getcpuclockid``) or its stack changed (code objects
and line numbers, ``sys._current_frames``). The CPU clock is what a tight loop shows: the sampler
gets the GIL at the same bytecode of each iteration, so the stack alone can look frozen. A rank
blocked in a collective, a store wait or a ``sleep`` uses no CPU on its main thread and sits in one
frame, so it stops ticking; a rank that computes, however slowly, moves. The run fails once no rank ticked (and no result arrived) for
``stall_s`` seconds; after a rank failed, the others get ``AFTER_FAILURE_S`` without progress to
finish before the pool restarts. A hang that spins (a Python loop polling forever) keeps ticking:
``max_s``, a ceiling far above any healthy run, catches that (pytest-timeout's per-test limit, 300 s
unless a test's mark says more, may come first). The sampler starts before the rank
initialises its process group, so a slow start-up counts as progress too.
"""

from __future__ import annotations

import contextlib
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from typing import Any, Callable, Iterator, NamedTuple

SAMPLE_S = 0.2
"""How often each rank's sampler looks at its main thread."""
MIN_CPU_S = 0.005
"""CPU seconds the main thread must have used since the last tick to count as moving."""
STALL_S = 60.0
"""Default: seconds without progress on any rank before a run fails as hung."""
MAX_S = 1200.0
"""Default ceiling on one run, for hangs that spin (see [Note: progress, not wall-clock])."""
AFTER_FAILURE_S = 5.0
"""Seconds without progress granted to the other ranks once one rank failed."""


PRELOAD = ["torch", "torch.distributed", "hybridshard", "tests.mp"]
"""Imported once by the fork server that every rank of this process's pools is forked from."""


def _context():
    """The fork-server context of [Note: ranks forked from a fork server]."""
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # takes effect when the server starts, at the first pool
    return ctx


# [Note: ranks forked from a fork server]
# A spawned rank is a fresh interpreter that imports torch and hybridshard again (about 3 s of CPU on
# an idle core, more under load), and every test module's pool starts its own. The pools' ranks are
# instead forked from multiprocessing's fork server, started once per test process, which imported
# PRELOAD and nothing else: single-threaded, no process group, no OpenMP pool, so forking it is safe.
# Each rank still starts from that clean state, never from the test process. What a fork server does
# not give a rank, :class:`RankPool` gives it explicitly: the test process's environment as it is now
# (the server's is from when it started) and the rank's own variables. Jobs that test a process's whole
# life, exits included, run as plain processes instead (:func:`run_rank_processes`).


def node_placement(world_size: int, num_nodes: int, layout: str) -> list[tuple[str, int]]:
    """``(node name, local rank)`` for each global rank."""
    if world_size % num_nodes:
        raise ValueError(f"world size {world_size} does not divide into {num_nodes} nodes")
    per_node = world_size // num_nodes
    if layout == "block":
        return [(f"node{r // per_node}", r % per_node) for r in range(world_size)]
    if layout == "cyclic":
        return [(f"node{r % num_nodes}", r // num_nodes) for r in range(world_size)]
    raise ValueError(f"layout must be 'block' or 'cyclic', got {layout!r}")


def _stack_key(frame: Any) -> tuple:
    """Where a thread is: (code object id, line) of every frame of its stack."""
    key = []
    while frame is not None:
        key.append((id(frame.f_code), frame.f_lineno))
        frame = frame.f_back
    return tuple(key)


def _sample_progress(ticks: Any, rank: int, main_ident: int) -> None:
    """Bump ``ticks[rank]`` whenever the main thread's stack changed or it used CPU since the last tick."""
    clock = time.pthread_getcpuclockid(main_ident)
    last_key, last_cpu = None, time.clock_gettime(clock)
    while True:
        time.sleep(SAMPLE_S)
        key, cpu = _stack_key(sys._current_frames().get(main_ident)), time.clock_gettime(clock)
        if key != last_key or cpu - last_cpu >= MIN_CPU_S:
            ticks[rank] += 1
            last_key, last_cpu = key, cpu


def _worker(rank: int, world_size: int, store_path: str, env: dict[str, str], tasks, results, ticks) -> None:
    threading.Thread(target=_sample_progress, args=(ticks, rank, threading.get_ident()), daemon=True,
                     name="progress-sampler").start()
    os.environ.clear()  # the test process's environment now, not the fork server's from its start
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    try:
        while True:
            task = tasks.get()
            if task is None:
                break
            fn, args, kwargs = task
            try:
                out = fn(*args, **kwargs)
                results.put((rank, True, out))
            except BaseException:  # noqa: BLE001 - report every failure to the parent
                results.put((rank, False, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


class RankPool:
    """``world_size`` gloo ranks on ``num_nodes`` simulated nodes (see [Note: ranks forked from a fork server]).

    ``stall_s``: a run fails when no rank made progress for this long; ``max_s``: the ceiling on one
    run (see [Note: progress, not wall-clock]). ``timeout`` is an older name for ``max_s``.
    """

    def __init__(
        self,
        world_size: int,
        *,
        num_nodes: int = 2,
        layout: str = "block",
        stall_s: float = STALL_S,
        max_s: float = MAX_S,
        timeout: float | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.world_size = world_size
        self.num_nodes = num_nodes
        self.layout = layout
        self.stall_s = stall_s
        self.max_s = max_s if timeout is None else timeout
        self.placement = node_placement(world_size, num_nodes, layout)
        self._extra_env = dict(env or {})
        self._procs: list = []
        self._tmp: str | None = None
        self._start()

    def _start(self) -> None:
        self._tmp = tempfile.mkdtemp(prefix="hs-pool-")
        store_path = os.path.join(self._tmp, "store")
        ctx = _context()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._results = ctx.Queue()
        self._ticks = ctx.Array("q", self.world_size, lock=False)
        per_node = self.world_size // self.num_nodes
        self._procs = []
        for rank, (node, local_rank) in enumerate(self.placement):
            env = {
                **os.environ,
                "RANK": str(rank),
                "LOCAL_RANK": str(local_rank),
                "WORLD_SIZE": str(self.world_size),
                "LOCAL_WORLD_SIZE": str(per_node),
                "HYBRIDSHARD_NODE_NAME": node,
                "OMP_NUM_THREADS": "1",
                "MASTER_ADDR": "127.0.0.1",
                **self._extra_env,
            }
            p = ctx.Process(
                target=_worker,
                args=(rank, self.world_size, store_path, env, self._tasks[rank], self._results, self._ticks),
                daemon=True,
            )
            p.start()
            self._procs.append(p)

    def _kill(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(timeout=5)
        self._procs = []
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def run(
        self, fn: Callable[..., Any], *args: Any, stall_s: float | None = None, max_s: float | None = None, **kwargs: Any
    ) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order. ``stall_s`` and
        ``max_s`` override the pool's for this run (see [Note: progress, not wall-clock])."""
        if not self._procs:
            self._start()
        for q in self._tasks:
            q.put((fn, args, kwargs))
        stall = stall_s or self.stall_s
        start = time.monotonic()
        ceiling = start + (max_s or self.max_s)
        last_ticks, last_progress = list(self._ticks), start
        out: dict[int, Any] = {}
        failures: dict[int, str] = {}
        while len(out) + len(failures) < self.world_size:
            try:
                rank, ok, value = self._results.get(timeout=0.5)
            except queue.Empty:
                now, ticks = time.monotonic(), list(self._ticks)
                if ticks != last_ticks:
                    last_ticks, last_progress = ticks, now
                dead = [i for i, p in enumerate(self._procs) if not p.is_alive()]
                if dead or now - last_progress > stall or now > ceiling:
                    self._kill()
                    if failures:
                        break
                    if dead:
                        what = f"ranks {dead} died"
                    elif now > ceiling:
                        what = f"still running at the ceiling of {now - start:.0f}s"
                    else:
                        what = f"no rank made progress for {stall:.0f}s (hung after {now - start:.0f}s)"
                    raise TimeoutError(f"{fn.__name__}: {what}; ranks done: {sorted(out)}")
                continue
            last_progress = time.monotonic()
            if ok:
                out[rank] = value
            else:
                failures[rank] = value
                # The other ranks may now wait forever in a collective: once they stop moving, restart
                # the pool rather than hang.
                stall = min(stall, AFTER_FAILURE_S)
        if failures:
            if len(out) + len(failures) < self.world_size:
                self._kill()
            first = min(failures)
            raise AssertionError(f"{fn.__name__} failed on rank {first}:\n{failures[first]}")
        return [out[r] for r in range(self.world_size)]

    def close(self) -> None:
        for q in self._tasks:
            try:
                q.put(None)
            except Exception:  # noqa: BLE001
                pass
        for p in self._procs:
            p.join(timeout=10)
        self._kill()

    def __enter__(self) -> "RankPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def print_result(record: dict[str, Any]) -> None:
    """Print ``RESULT {json}`` for :func:`read_results`, in one write: under ``PYTHONUNBUFFERED=1``,
    ``print`` writes the text and its newline separately, and a C++ warning on stderr (the same pipe)
    can land between them, on the result's line."""
    import json

    sys.stdout.write(f"RESULT {json.dumps(record)}\n")
    sys.stdout.flush()


def read_results(text: str) -> list[dict[str, Any]]:
    """The records of every ``RESULT {json}`` line of a rank's output, in order; text after a record on
    its line (another thread's output, written between a record and its newline) is not part of it."""
    import json

    decoder = json.JSONDecoder()
    return [decoder.raw_decode(line[len("RESULT "):])[0] for line in text.splitlines() if line.startswith("RESULT ")]


class RankExit(NamedTuple):
    """How one rank process of :func:`run_rank_processes` ended."""

    code: int | None
    """Exit status, or None if it was killed at the timeout."""
    text: str
    """Its stdout and stderr."""
    seconds: float
    """Seconds from the spawn of the ranks until its end was seen."""
    ended: float
    """``time.time()`` when its end was seen, to compare with wall-clock times the rank printed. (A start
    the caller takes before the call would also count this process's first import of torch.distributed,
    seconds under load, and make a rank's time after its own mark look shorter than it was.)"""


def run_rank_processes(
    argv: list[str], world_size: int, *, num_nodes: int = 2, timeout: float = 60.0, env: dict[str, str] | None = None
) -> list[RankExit]:
    """Run ``python argv...`` once per rank as plain processes (``env://`` rendezvous on loopback),
    as torchrun would but without its agent killing the others when one fails: the survivors'
    own behaviour is what a fault test looks at. Returns each rank's :class:`RankExit`."""
    # This process hosts the job's store, as torchrun's agent does, so it outlives any rank.
    with held_store() as store:
        return _run_ranks(argv, world_size, store.port, num_nodes=num_nodes, timeout=timeout, env=env)


@contextlib.contextmanager
def held_store(host: str = "127.0.0.1") -> Iterator[Any]:
    """A TCP store this process hosts, on a port the kernel chose as it bound it; it lives as long as
    the caller holds it (``with held_store() as store:`` keeps it until the function returns).

    Hand its port to the processes of a job (``MASTER_PORT``, or ``--rdzv-endpoint HOST:PORT`` of a
    c10d rendezvous, whose agents then find the port taken and connect as clients): a port probed
    free and bound later by someone else may have been taken in between by any process on the host.
    """
    import torch.distributed as dist

    store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
    try:
        yield store
    finally:
        del store


def _run_ranks(
    argv: list[str], world_size: int, port: int, *, num_nodes: int, timeout: float, env: dict[str, str] | None
) -> list[RankExit]:
    per_node = world_size // num_nodes
    procs = []
    start = time.monotonic()
    for rank, (node, local_rank) in enumerate(node_placement(world_size, num_nodes, "block")):
        rank_env = {
            **os.environ, "RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(per_node), "HYBRIDSHARD_NODE_NAME": node, "OMP_NUM_THREADS": "1",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True",
            **(env or {}),
        }
        procs.append(subprocess.Popen([sys.executable, *argv], env=rank_env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    out: list[RankExit] = []
    for p in procs:
        left = max(0.1, timeout - (time.monotonic() - start))
        try:
            text, _ = p.communicate(timeout=left)
            out.append(RankExit(p.returncode, text, time.monotonic() - start, time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
            text, _ = p.communicate()
            out.append(RankExit(None, text, time.monotonic() - start, time.time()))
    return out
