"""Multi-process test harness: a pool of gloo ranks that runs many test functions.

Spawning ranks costs seconds, so a test module creates one :class:`RankPool` (usually a
module-scoped fixture) and runs every check through it::

    pool = RankPool(4, num_nodes=2, layout="block")
    results = pool.run(check_something, 3, flag=True)    # one result per rank, in rank order

``fn`` must be a module-level function (it is pickled by reference) and runs on every rank with the
default process group initialised (gloo over a file store). Each rank sees ``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``LOCAL_WORLD_SIZE`` and ``HYBRIDSHARD_NODE_NAME`` as torchrun plus a simulated node
would set them. ``layout="block"`` places ranks ``[0, 1]`` on node0 and ``[2, 3]`` on node1;
``layout="cyclic"`` places them round-robin (SLURM ``--distribution=cyclic``): node0 gets ``[0, 2]``.

A rank that raises fails the run with its traceback; a run that exceeds ``timeout`` kills every rank
and raises ``TimeoutError`` (then the pool restarts on its next use), so a hang fails fast.
"""

from __future__ import annotations

import os
import queue
import shutil
import tempfile
import time
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp

_CTX = mp.get_context("spawn")


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


def _worker(rank: int, world_size: int, store_path: str, env: dict[str, str], tasks, results) -> None:
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
    """``world_size`` spawned gloo ranks on ``num_nodes`` simulated nodes."""

    def __init__(
        self,
        world_size: int,
        *,
        num_nodes: int = 2,
        layout: str = "block",
        timeout: float = 120.0,
        env: dict[str, str] | None = None,
    ) -> None:
        self.world_size = world_size
        self.num_nodes = num_nodes
        self.layout = layout
        self.timeout = timeout
        self.placement = node_placement(world_size, num_nodes, layout)
        self._extra_env = dict(env or {})
        self._procs: list = []
        self._tmp: str | None = None
        self._start()

    def _start(self) -> None:
        self._tmp = tempfile.mkdtemp(prefix="hs-pool-")
        store_path = os.path.join(self._tmp, "store")
        self._tasks = [_CTX.Queue() for _ in range(self.world_size)]
        self._results = _CTX.Queue()
        per_node = self.world_size // self.num_nodes
        self._procs = []
        for rank, (node, local_rank) in enumerate(self.placement):
            env = {
                "RANK": str(rank),
                "LOCAL_RANK": str(local_rank),
                "WORLD_SIZE": str(self.world_size),
                "LOCAL_WORLD_SIZE": str(per_node),
                "HYBRIDSHARD_NODE_NAME": node,
                "OMP_NUM_THREADS": "1",
                "MASTER_ADDR": "127.0.0.1",
                **self._extra_env,
            }
            p = _CTX.Process(
                target=_worker,
                args=(rank, self.world_size, store_path, env, self._tasks[rank], self._results),
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

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order."""
        if not self._procs:
            self._start()
        for q in self._tasks:
            q.put((fn, args, kwargs))
        deadline = time.monotonic() + (timeout or self.timeout)
        out: dict[int, Any] = {}
        failures: dict[int, str] = {}
        while len(out) + len(failures) < self.world_size:
            try:
                rank, ok, value = self._results.get(timeout=0.5)
            except queue.Empty:
                dead = [i for i, p in enumerate(self._procs) if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    self._kill()
                    if failures:
                        break
                    what = f"ranks {dead} died" if dead else f"timed out after {timeout or self.timeout:.0f}s"
                    raise TimeoutError(f"{fn.__name__}: {what}; ranks done: {sorted(out)}")
                continue
            if ok:
                out[rank] = value
            else:
                failures[rank] = value
                # The other ranks may now wait forever in a collective: give them a moment, then
                # restart the pool rather than hang.
                deadline = min(deadline, time.monotonic() + 5)
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


def run_rank_processes(
    argv: list[str], world_size: int, *, num_nodes: int = 2, timeout: float = 60.0, env: dict[str, str] | None = None
) -> list[tuple[int | None, str, float]]:
    """Run ``python argv...`` once per rank as plain processes (``env://`` rendezvous on loopback),
    as torchrun would but without its agent killing the others when one fails: the survivors'
    own behaviour is what a fault test looks at. Returns ``(exit code or None if killed at the
    timeout, stdout, seconds)`` per rank."""
    import subprocess
    import sys

    import torch.distributed as dist

    # This process hosts the job's store, as torchrun's agent does, so it outlives any rank; on a port
    # it binds itself (0: the kernel's choice), handed to the ranks, so no other process can take it first.
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    port = store.port
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
    out: list[tuple[int | None, str, float]] = []
    for p in procs:
        left = max(0.1, timeout - (time.monotonic() - start))
        try:
            text, _ = p.communicate(timeout=left)
            out.append((p.returncode, text, time.monotonic() - start))
        except subprocess.TimeoutExpired:
            p.kill()
            text, _ = p.communicate()
            out.append((None, text, time.monotonic() - start))
    del store
    return out
