"""Every collective the runtime issues, as stateless functions that take their group explicitly.

Each call is counted per ``(kind, group name)`` (see :mod:`hybridshard.runtime.trace.counters`) so tests
and benchmarks can check how many collectives a step issued and how many bytes crossed each group.
A group of one rank, or ``None`` (no group; see [Note: None means no group] in
:mod:`hybridshard.topology.groups`), needs no communication: the functions then copy locally and
count nothing. The whole job is ``dist.group.WORLD``, always passed explicitly. A collective that
fails raises a ``RuntimeError`` naming the group and the lost ranks (:mod:`hybridshard.runtime.faults.errors`),
and with ``HYBRIDSHARD_DEBUG=1`` each one first checks that its group agrees on it
(:mod:`hybridshard.runtime.comm.agreement`).
"""

from __future__ import annotations

import logging
import time
import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist

from hybridshard.runtime.comm import agreement
from hybridshard.runtime.comm.handoff import hand_off, sweep
from hybridshard.runtime.faults import errors, watchdog
from hybridshard.runtime.trace import issue_order, step_timing
from hybridshard.runtime.trace.counters import CollectiveCounts, record
from hybridshard.topology.groups import group_name

logger = logging.getLogger(__name__)

__all__ = ["DONE", "Pending", "all_gather", "all_reduce", "all_to_all", "broadcast", "group_size", "reduce_scatter"]

# Newer torch renames the tensor-in/tensor-out collectives; the semantics are the same.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


EMULATED: list[Any] = []
"""The emulated device whose side stream is current, if any: collectives are queued on it (see
[Note: emulated device] in :mod:`hybridshard.runtime.comm.executors.emulate`)."""


def group_size(group: dist.ProcessGroup | None) -> int:
    """Ranks in ``group``; ``None`` is no group, one rank (see [Note: None means no group])."""
    if group is None:
        return 1
    try:  # the group's own size(): what dist.get_world_size returns for a member, without its lookups
        return group.size()
    except AttributeError:
        return dist.get_world_size(group)


class Pending:
    """A collective issued with ``async_op=True``: :meth:`wait` blocks until it finished (then runs
    the local step that completes it, if any) and raises the named error if it failed."""

    __slots__ = ("_work", "_kind", "_name", "_group", "_then", "_done", "_token", "_op")

    def __init__(self, work: Any = None, kind: str = "", name: str = "", group: Any = None,
                 then: Callable[[], None] | None = None, token: int | None = None,
                 op: step_timing.TimedOp | None = None) -> None:
        self._work, self._kind, self._name, self._group, self._then = work, kind, name, group, then
        self._done = work is None
        self._token = token
        """This collective in the watchdog's registry (see [Note: hang report])."""
        self._op = op
        """Its timing while stragglers are looked for (see [Note: step timing])."""

    def is_completed(self) -> bool:
        return self._done or self._work is None or self._work.is_completed()

    def wait(self) -> None:
        if self._done:
            return
        op = self._op
        if op is not None:
            started, was_done = time.perf_counter(), self._work.is_completed()
        try:
            self._work.wait()
        except RuntimeError as err:
            watchdog.end(self._token)
            agreement.raise_if_out_of_step()
            raise errors.collective_failed(self._kind, self._name, self._group, err) from err
        if self._work.is_completed():  # on NCCL the device may still run it: the watchdog polls it
            watchdog.end(self._token)
        else:
            watchdog.settle(self._token)
        if op is not None:
            op.waited(started, was_done)
            step_timing.end_op(op)
            step_timing.CLOCK.blocked(started)
        self._done = True
        self._work = None  # the work holds its input and output tensors: let them go now
        sweep()  # and the aliases of earlier collectives the backend let go of (see hybridshard.runtime.comm.handoff)
        if self._then is not None:
            self._then()


DONE = Pending()
"""What an ``async_op=True`` call returns when it needed no communication."""


def _run(
    kind: str,
    group: dist.ProcessGroup | None,
    tensor: torch.Tensor,
    collective: Callable[[bool], Any],
    *,
    stats: CollectiveCounts | None = None,
    async_op: bool = False,
    then: Callable[[], None] | None = None,
    touched: tuple[torch.Tensor, ...] = (),
    written: int = 1,
) -> Pending | None:
    """Count, optionally check agreement, then run ``collective(async_op)``; a failure names the group.

    ``then`` is a local step that completes the collective (run after it, or by ``wait()``).
    ``touched``: the aliases ``collective`` and ``then`` hold, every tensor the collective reads or
    writes (what the emulated device checks); the first ``written`` of them are its outputs.
    """
    assert group is not None, f"{kind}: no group means no communication; see [Note: None means no group]"
    name = group_name(group)
    record(kind, name, group_size(group), tensor, stats)
    stream = EMULATED[-1].current.name if EMULATED else ""
    issue = issue_order.note(name, kind, tensor, stream)  # see [Note: one issue order per communicator]
    if logger.isEnabledFor(logging.DEBUG):  # the byte count is computed only when it is logged
        logger.debug("%s on %s: %d bytes", kind, name, tensor.numel() * tensor.element_size())
    if agreement.enabled():
        try:
            agreement.check(kind, name, group, tensor)
        except RuntimeError as err:
            raise errors.collective_failed(kind, name, group, err) from err
    token = watchdog.begin(kind, name, group, tensor.numel())
    op = step_timing.CLOCK.issued(kind, name, group, tensor) if step_timing.enabled() else None
    if EMULATED:
        return _queue(EMULATED[-1], kind, name, group, collective, then, touched, written, token, async_op, issue, op)
    try:
        # Issued asynchronously either way: the handle tells the watchdog when it completed (on NCCL,
        # when the device did). A blocking call waits on it right away.
        work = collective(True)
    except RuntimeError as err:
        watchdog.end(token)
        agreement.raise_if_out_of_step()
        raise errors.collective_failed(kind, name, group, err) from err
    watchdog.attach_work(token, work)
    pending = Pending(work, kind, name, group, then, token, op)
    if async_op:
        return pending
    pending.wait()
    return None


def _queue(device: Any, kind: str, name: str, group: Any, collective: Callable[[bool], Any],
           then: Callable[[], None] | None, touched: tuple[torch.Tensor, ...], written: int, token: int,
           async_op: bool, issue: Any, op: step_timing.TimedOp | None = None) -> Any:
    """Queue a collective on the emulated device's current side stream; it stays in flight (the
    watchdog) until the stream runs it (and is timed then)."""

    def run() -> None:
        if op is not None:
            op.issued = time.perf_counter()
        try:
            work = collective(True)
            work.wait()
        except RuntimeError as err:
            agreement.raise_if_out_of_step()
            raise errors.collective_failed(kind, name, group, err) from err
        finally:
            watchdog.end(token)
            if op is not None:
                op.done = time.perf_counter()
        if then is not None:
            then()

    pending = device.defer_collective(f"{kind} on the {name} group", run, touched, touched[:written], issue)
    if async_op:
        return pending
    pending.wait()
    return None


def _local(async_op: bool) -> Pending | None:
    return DONE if async_op else None


def all_gather(output: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup | None, *,
               stats: CollectiveCounts | None = None, async_op: bool = False) -> Pending | None:
    """Concatenate every rank's ``shard`` into ``output`` (``group_size * shard.numel()`` elements)."""
    if group_size(group) == 1:
        output.copy_(shard)
        return _local(async_op)
    out, inp = hand_off(output, shard)  # see [Note: tensors handed to a backend thread]
    return _run("all_gather", group, shard, lambda a: _ALL_GATHER(out, inp, group=group, async_op=a),
                stats=stats, async_op=async_op, touched=(out, inp))


# [Note: reduce-scatter on gloo]
# gloo has no reduce-scatter: ``reduce_scatter_tensor`` runs a full all-reduce and keeps one chunk
# (twice the ring-minimum bytes). For CPU tensors on gloo an ``all_to_all_single`` (chunk i to rank
# i) and a local sum of the received chunks send exactly (S-1)/S of the input (measured in
# docs/runtime.md, "Reduce-scatter on gloo"); everything else keeps ``reduce_scatter_tensor``.
# The local sum runs in the input dtype in the order gloo's ring adds (chunk c: rank c-1, c-2, ...,
# then c), so results match the native ones bit for bit except where gloo orders tiny messages or
# segment boundaries otherwise. A rank's own chunk never travels (it sends 0 elements to itself):
# in a pair the other chunk lands in ``output`` and the own one is added after; with more ranks the
# own chunk is copied to ``output`` first and the others' chunks must be contiguous, which a middle
# rank gets by moving the chunks after its own one place down, only when the caller is done with
# the input (``consume=True``, the gradient path). The others' sum is built first, the own chunk
# added last. A reduce-scatter in flight thus holds (S-1)/S of its input as receive buffer, none in
# a pair.

def _sums_locally(output: torch.Tensor, full: torch.Tensor, group: dist.ProcessGroup | None, n: int) -> bool:
    """Whether this reduce-scatter runs as an all-to-all plus a local sum; see [Note: reduce-scatter on gloo]."""
    return (
        full.is_cpu
        and output.is_cpu
        and output.dtype == full.dtype
        and not full.dtype.is_complex
        and full.dtype != torch.bool
        and full.is_contiguous()
        and output.is_contiguous()
        and full.numel() == n * output.numel()
        and _is_gloo(group)
    )


_GLOO: "weakref.WeakKeyDictionary[Any, bool]" = weakref.WeakKeyDictionary()
"""Per process group, whether its backend is gloo: asked of torch.distributed once per group, not per call."""


def _is_gloo(group: dist.ProcessGroup) -> bool:
    try:
        return _GLOO[group]
    except KeyError:
        gloo = _GLOO[group] = "gloo" in str(dist.get_backend(group))
        return gloo
    except TypeError:  # a group object that takes no weak reference: ask every time
        return "gloo" in str(dist.get_backend(group))


def _sum_received(output: torch.Tensor, received: torch.Tensor, n: int, rank: int, own: torch.Tensor | None) -> None:
    """Sum the chunks into ``output`` in gloo's ring order, this rank's own chunk last (see the Note).

    ``own is None``: ``received`` holds all ``n`` chunks. Otherwise it holds the other ranks' chunks
    in rank order and their sum is built in place; then the own chunk is added: ``own`` itself when
    ``received`` is ``output`` (a pair), else ``output`` already holds it (``own is output``) and the
    others' sum is added to it. ``a + b`` is ``b + a`` bit for bit, so the order is the Note's.
    """
    chunks = received.view(-1, output.numel())

    def sent_by(k: int) -> torch.Tensor:  # the chunk rank (rank - k) sent
        src = (rank - k) % n
        return chunks[src if own is None or src < rank else src - 1]

    with torch.no_grad():
        out = output.view(-1)
        if own is None:
            out.copy_(sent_by(1))
            for k in range(2, n + 1):
                out.add_(sent_by(k))
            return
        theirs = sent_by(1)
        for k in range(2, n):
            theirs.add_(sent_by(k))
        out.add_(theirs if own is output else own.view(-1))


def reduce_scatter(output: torch.Tensor, full: torch.Tensor, group: dist.ProcessGroup | None, *,
                   stats: CollectiveCounts | None = None, async_op: bool = False,
                   consume: bool = False) -> Pending | None:
    """Sum ``full`` over the group and keep this rank's chunk in ``output``.

    With ``async_op=True`` on gloo the local sum runs in ``wait()``: read ``output`` after it.
    ``consume``: the caller is done with ``full``, whose values the call may then overwrite.
    """
    n = group_size(group)
    if n == 1:
        output.copy_(full)
        return _local(async_op)
    if not _sums_locally(output, full, group, n):
        out, inp = hand_off(output, full)
        return _run("reduce_scatter", group, full,
                    lambda a: _REDUCE_SCATTER(out, inp, op=dist.ReduceOp.SUM, group=group, async_op=a),
                    stats=stats, async_op=async_op, touched=(out, inp))
    # Counted as the reduce-scatter it is (input: the full tensor), not as an all-to-all.
    rank = group.rank()  # this rank's place in the group (dist.get_rank(group), without its lookups)
    chunks = full.view(n, -1)
    sizes = [0 if r == rank else output.numel() for r in range(n)]
    if n == 2:
        # The other rank's chunk is received into ``output``, this rank's own added from ``full`` after.
        send, received, own = chunks[1 - rank], output, chunks[rank]
    elif consume or rank in (0, n - 1):
        # The own chunk goes to ``output`` now; the others' chunks, contiguous (a middle rank moves
        # the ones after its own one place down), travel, into a buffer of (n-1)/n of the input.
        with torch.no_grad():
            output.view(-1).copy_(chunks[rank])
            if 0 < rank < n - 1:
                for k in range(rank, n - 1):
                    chunks[k].copy_(chunks[k + 1])
        send = (chunks[1:] if rank == 0 else chunks[: n - 1]).view(-1)
        received, own = torch.empty_like(send), output
    else:  # a middle rank that may not move the caller's chunks: every chunk travels
        send, received, own, sizes = full, torch.empty_like(full), None, None
    out, inp = hand_off(received, send)  # the receive buffer may be a temporary: see the Note
    # The local sum holds aliases too (the same storages), so the runtime's tensors never change hands.
    own_is_output, pair = own is output, received is output
    result = output.detach()
    got = result if pair else received.detach()
    mine = None if own is None or own_is_output else own.detach()
    return _run("reduce_scatter", group, full,
                lambda a: dist.all_to_all_single(out, inp, sizes, sizes, group=group, async_op=a),
                stats=stats, async_op=async_op,
                then=lambda: _sum_received(result, got, n, rank, result if own_is_output else mine),
                touched=tuple(t for t in (result, out, inp, got, mine) if t is not None), written=2)


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None, op=dist.ReduceOp.SUM, *,
               stats: CollectiveCounts | None = None, async_op: bool = False) -> Pending | None:
    """Reduce ``tensor`` in place over the group (``op`` defaults to a sum)."""
    if group_size(group) == 1:
        return _local(async_op)
    (alias,) = hand_off(tensor)
    return _run("all_reduce", group, tensor, lambda a: dist.all_reduce(alias, op=op, group=group, async_op=a),
                stats=stats, async_op=async_op, touched=(alias,))


def all_to_all(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None, *,
               stats: CollectiveCounts | None = None, async_op: bool = False) -> Pending | None:
    """Send chunk ``i`` of ``input`` to the group's rank ``i``; chunk ``j`` of ``output`` comes from rank ``j``."""
    if group_size(group) == 1:
        output.copy_(input)
        return _local(async_op)
    out, inp = hand_off(output, input)
    return _run("all_to_all", group, input,
                lambda a: dist.all_to_all_single(out, inp, group=group, async_op=a),
                stats=stats, async_op=async_op, touched=(out, inp))


def broadcast(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None) -> None:
    """Copy global rank ``src``'s ``tensor`` to every member of the group."""
    if group_size(group) == 1:
        return
    (alias,) = hand_off(tensor)
    _run("broadcast", group, tensor, lambda a: dist.broadcast(alias, src=src, group=group, async_op=a),
         touched=(alias,))
