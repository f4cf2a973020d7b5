"""The group-creation phase of the control-plane harness (``control_plane_scale.py``): W ranks as
threads, each creating every shard and replicate group with the project's real
:func:`~hybridshard.topology.groups.build_groups`, over one real TCPStore.

What runs for real: ``init_process_group`` and ``new_group`` of torch.distributed, on torch's
threaded process group (``torch.testing._internal.distributed.multi_threaded_pg``: one world per
thread), each rank with its own TCPStore client; :func:`build_groups` creating the plan's groups in
plan order on every rank, members or not, then the 2-D DeviceMesh. The threaded backend makes each
new group's members meet at a store barrier (an ``add``, a ``wait``, a ``set`` by the last one),
as a real backend's members meet once through the store to connect (NCCL: one rank publishes the
communicator's id, the others read it). What it does not show: the connections themselves (gloo's
full mesh per group, NCCL's rings), which need the real backend and real hosts.

[Note: which creation path]
Users on NCCL with a bound default group take ``split_group``, one call per kind of group (see
[Note: scalable creation] in :mod:`hybridshard.topology.groups`). It needs NCCL and a GPU per rank;
the threaded group cannot split, so this phase measures the other path, ``new_group`` once per
group on every rank (gloo, and NCCL without a bound device), the slower of the two in Python calls:
each rank makes W/8 + 8 calls, and each call checks its rank list, so a rank's own work grows like W.
"""

from __future__ import annotations

import concurrent.futures
import gc
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["groups_phase"]


class _CountingStore(dist.Store):
    """A rank's store client as torch.distributed sees it, counting the operations it makes and
    the bytes it moves (keys and values out, values in)."""

    def __init__(self, inner: dist.Store) -> None:
        super().__init__()
        self.inner, self.ops, self.sent, self.received, self.timeouts = inner, 0, 0, 0, 0

    def _count(self, sent: int, received: int = 0) -> None:
        self.ops += 1
        self.sent += sent
        self.received += received

    def set(self, key: str, value: Any) -> None:
        value = value.encode() if isinstance(value, str) else bytes(value)
        self._count(len(key) + len(value))
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        value = self.inner.get(key)
        self._count(len(key), len(value))
        return value

    def add(self, key: str, amount: int) -> int:
        self._count(len(key) + 8, 8)
        return self.inner.add(key, amount)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        value = self.inner.compare_set(key, expected, desired)
        self._count(len(key) + len(expected) + len(desired), len(value))
        return value

    def check(self, keys: list[str]) -> bool:
        self._count(sum(map(len, keys)), 1)
        return self.inner.check(keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._count(sum(map(len, keys)))
        try:
            if timeout is None:
                self.inner.wait(keys)
            else:
                self.inner.wait(keys, timeout)
        except RuntimeError:
            self.timeouts += 1  # torch's store barrier waits 10 s at a time, then counts again and waits on
            raise

    def delete_key(self, key: str) -> bool:
        self._count(len(key), 1)
        return self.inner.delete_key(key)

    def num_keys(self) -> int:
        self._count(0, 8)
        return self.inner.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        self.inner.set_timeout(timeout)


def groups_phase(plan: Any, port: int | None = None) -> dict[str, float]:
    """Every rank of ``plan`` (a :class:`~hybridshard.topology.planner.GroupPlan`) creates its groups
    with :func:`build_groups`; figures per rank and for the whole job. ``port``: a store server's, or
    a new libuv server here."""
    from torch.testing._internal.distributed import multi_threaded_pg

    from hybridshard.topology.groups import build_groups

    world = plan.world_size
    server = None
    if port is None:
        server = dist.TCPStore("127.0.0.1", 0, is_master=True, use_libuv=True, wait_for_workers=False,
                               timeout=timedelta(seconds=300))
        port = server.port
    # See [Note: connecting in parallel] in control_plane_ranks.py.
    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        clients = list(pool.map(lambda _: dist.TCPStore("127.0.0.1", port, is_master=False, use_libuv=True,
                                                        timeout=timedelta(seconds=300)), range(world)))
    stores = [_CountingStore(c) for c in clients]
    start, errors = threading.Barrier(world + 1), []
    cpu_s, done_at, shapes = [0.0] * world, [0.0] * world, [None] * world
    inits = [0] * world  # store ops of init_process_group, apart from the groups'

    def rank_main(rank: int) -> None:
        try:
            dist.init_process_group("threaded", rank=rank, world_size=world, store=stores[rank],
                                    timeout=timedelta(seconds=300))
            inits[rank] = stores[rank].ops
            start.wait()
            t = time.thread_time()
            groups = build_groups(plan)
            cpu_s[rank] = time.thread_time() - t
            done_at[rank] = time.monotonic()
            shapes[rank] = (groups.shard_size, groups.replicate_size, groups.mesh is not None)
        except BaseException as err:  # noqa: BLE001 - reported by the caller
            errors.append((rank, err))
            start.abort()
        finally:
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a rank that failed before init has nothing to destroy
                pass

    multi_threaded_pg._install_threaded_pg()
    torch._C._distributed_c10d._set_thread_isolation_mode(True)  # each thread its own group names
    # [Note: one heap for W ranks] A garbage collection walks the whole process's objects, W ranks'
    # groups and worlds at once, and its CPU is charged to the thread that triggered it: at 4,096
    # ranks the median rank's CPU was 631 ms with it on, 382 ms off (one run each; one rank alone,
    # 7.2 ms). A real rank collects its own heap only.
    gc.collect()
    gc.disable()
    try:
        threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(world)]
        for thread in threads:
            thread.start()
        try:
            start.wait()
        except threading.BrokenBarrierError:
            pass
        began = time.monotonic()
        for thread in threads:
            thread.join(600)
    finally:
        gc.enable()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
        multi_threaded_pg._uninstall_threaded_pg()
    if errors or any(t.is_alive() for t in threads):
        rank, err = errors[0] if errors else (None, "a rank did not finish within 600 s")
        raise RuntimeError(f"group creation failed at W={world} (rank {rank}): {err}")
    expected = (plan.shard_size, plan.replicate_size, True)
    wrong = [r for r, s in enumerate(shapes) if s != expected]
    if wrong:
        raise RuntimeError(f"ranks {wrong[:8]} got groups {shapes[wrong[0]]}, expected {expected}")
    ops = [s.ops - i for s, i in zip(stores, inits)]
    received, timeouts = max(s.received for s in stores), max(s.timeouts for s in stores)
    cpu_sorted = sorted(cpu_s)
    del clients, stores
    return {
        "groups_path": "new_group",
        "groups_calls_per_rank": len(plan.shard_groups) + len(plan.replicate_groups),
        "groups_s": max(done_at) - began,
        "groups_cpu_ms_per_rank": 1e3 * cpu_sorted[len(cpu_sorted) // 2],
        "groups_cpu_ms_max_rank": 1e3 * cpu_sorted[-1],
        "groups_store_ops_per_rank": max(ops),
        "groups_store_bytes_per_rank": received,
        "groups_store_wait_timeouts_max_rank": timeouts,
        "groups_alone_cpu_ms": alone_ms(plan),
    }


def alone_ms(plan: Any, repeats: int = 3) -> float:
    """CPU milliseconds of :func:`build_groups` for one rank of ``plan`` alone in this process (best of
    ``repeats``), on torch's ``fake`` process group: every ``new_group`` call and the mesh, no store
    and no other rank's threads."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from hybridshard.topology.groups import build_groups

    best = float("inf")
    for _ in range(repeats):
        dist.init_process_group("fake", store=FakeStore(), rank=plan.world_size // 2 + 1, world_size=plan.world_size)
        try:
            t = time.thread_time()
            build_groups(plan)
            best = min(best, time.thread_time() - t)
        finally:
            dist.destroy_process_group()
    return 1e3 * best
