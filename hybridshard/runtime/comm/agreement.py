"""Checks that the ranks are doing the same thing: one small check per forward and per backward (on
by default), and the opt-in check of every collective.

[Note: step check]
Ranks that run a different number of forwards or backwards, a different ``no_sync`` pattern, or
units in a different order (a data-dependent branch) issue collectives that pair up by order:
same-size ones silently mix unrelated tensors, the others fail or hang. Each forward (at the root's
pre-hook) and each backward (at its first hook), before any gather, reduces a fingerprint over the
job: the pass, the step, the forwards in this step, the ``no_sync`` mode, the number of units and a
digest of the unit orders so far. The checks always pair with each other, so a difference raises a
``ValueError`` naming what each rank was doing before any gradient is reduced. Neither check waits:
the forward's is compared at the next check, the backward's before the backward's first gradient
reduction (the gathers before it cannot reduce anything). A collective that fails meanwhile first
waits (up to 3 s) for the check in flight and raises its ``ValueError``: the cause, not the
consequence. A rank that skipped a whole step is found when it finishes early ([Note: finishing
together] in :mod:`hybridshard.runtime.faults.exits`). Cost (docs/runtime.md): two small
all-reduces per step, off the critical path; ``shard(..., check_steps=False)`` turns it off.

[Note: step check at scale]
The check is one fixed-size all-reduce (MAX) whatever the world size W: each of the six fields f goes
in twice, as ``f * W + rank`` and as ``-f * W + rank``, so the maximum over the job holds each field's
largest and smallest value, each with a rank that has it (a tree or ring reduction of 96 bytes: its
cost grows as log W, where an all-gather of every rank's fields grows as W; docs/scale.md). The
ranks agree when every field's largest equals its smallest. Only when they do not does each rank
leave its fingerprint in the job's store and read the others' (:func:`hybridshard.runtime.faults.peers.exchange`,
up to 5 s), to name the ranks out of step as before; that goes through the store, not a collective,
because ranks find the disagreement at different points of their streams. A rank that does not say
in time (stuck in a collective paired wrongly) is described from the extremes it holds.

[Note: step check without a host sync]
On CUDA neither building a fingerprint nor reading the reduced one may make the host wait for the
device (that drains its queue, three times a step). A fingerprint goes to the device from pinned
memory, non-blocking; a collected check's result is copied to pinned memory, non-blocking, with an
event after it (:class:`~hybridshard.runtime.trace.host_syncs.HostCopy`), and is compared once that event
has completed, asked at each later check without waiting. The backward check's collection before
the first gradient reduction also compares every check of *earlier* steps, waiting for it if the
device is that far behind. So a mismatch is found within one step, and the job stops (``ValueError``
on every rank) before the next step reduces a gradient, so before the next optimizer step changes a
weight; the step in which ranks parted may itself have stepped. Nothing goes through the store on a
healthy step. On CPU the reduced tensor is host memory: compared at once, as the Note above says.

[Note: debug agreement check]
For the mismatches of [Note: step check] inside a step: with ``HYBRIDSHARD_DEBUG=1`` (or
``shard(..., debug=True)``) each collective is preceded by an all-gather, in the same group, of a
small fingerprint: the kind, element count, dtype and where the rank is (step, forward, phase, unit;
:mod:`hybridshard.runtime.trace.position`). The fingerprints always pair (same size), so a
disagreement raises a ``ValueError`` on every member naming what each rank was doing. It doubles the
number of collectives (each one tiny): for finding such a bug, not for production runs.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from hybridshard.runtime.comm.handoff import hand_off
from hybridshard.runtime.faults import errors, peers, watchdog
from hybridshard.runtime.trace import issue_order, step_timing
from hybridshard.runtime.trace.host_syncs import HostCopy, to_device
from hybridshard.runtime.trace.position import PHASES, current_where
from hybridshard.topology.groups import collective_device, group_ranks

logger = logging.getLogger(__name__)

__all__ = ["StepCheck", "check", "enabled", "issue_step_check", "raise_if_out_of_step", "set_debug"]

# Newer torch renames the tensor-in/tensor-out all-gather; the semantics are the same.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_DEBUG: dict[str, bool | None] = {"on": None}  # None: read HYBRIDSHARD_DEBUG at the first collective
_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "all_to_all")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.uint8)


def enabled() -> bool:
    on = _DEBUG["on"]
    if on is None:  # read when first needed, not at import: a process may set it after importing us
        on = _DEBUG["on"] = os.environ.get("HYBRIDSHARD_DEBUG", "") not in ("", "0")
    return on


def set_debug(on: bool) -> None:
    _DEBUG["on"] = bool(on)


def check(kind: str, group_label: str, group: dist.ProcessGroup, tensor: torch.Tensor) -> None:
    """All-gather this collective's fingerprint in ``group`` and raise if the members disagree."""
    w = current_where()
    dtype_code = _DTYPES.index(tensor.dtype) if tensor.dtype in _DTYPES else len(_DTYPES)
    mine = torch.tensor(
        [_KINDS.index(kind), tensor.numel(), dtype_code, w.step, w.forward, PHASES.index(w.phase), w.unit],
        dtype=torch.int64,
        device=tensor.device,
    )
    size = dist.get_world_size(group)
    everyone = torch.empty(size * mine.numel(), dtype=torch.int64, device=tensor.device)
    issue_order.note(group_label, "all_gather", mine)
    _ALL_GATHER(*hand_off(everyone, mine), group=group)  # temporaries: [Note: tensors handed to a backend thread]
    rows = everyone.view(size, -1).tolist()
    if all(row == rows[0] for row in rows):
        return
    ranks = group_ranks(group)
    described = "; ".join(
        f"rank {r}: {_KINDS[k]} of {n} elements at step {s}, forward {f}, {PHASES[p]}, unit {u}"
        for r, (k, n, _, s, f, p, u) in zip(ranks, rows)
    )
    message = (
        f"ranks disagree on the next collective in the {group_label} group: {described}. Every rank must run "
        "the same number of forwards and backwards per step, with the same no_sync blocks and the same "
        "units taking part; look for a data-dependent branch or a micro-batch count that differs by rank"
    )
    error = ValueError(message)
    errors.announce(error)  # ranks outside this group learn it when their own collectives fail
    raise error


_PASSES = ("forward", "backward")
_MODES = ("sync", "local", "shard_only")


_CHECKS: list["StepCheck"] = []
"""Step checks issued and not collected yet (at most two: a forward's and a backward's)."""
_ARRIVING: list[tuple[int, int, HostCopy, list[int], int]] = []
"""``(step, world, copy, row, seq)`` of collected checks whose reductions are on their way to the host."""
_ISSUED = {"n": 0}
"""Step checks issued by this rank: the n-th pairs with every other rank's n-th (collectives pair by order)."""
_DETAIL_SECONDS = 5.0
"""How long a rank that found a disagreement waits for the others' fingerprints (see [Note: step check at scale])."""


def _extremes_of(row: list[int], rank: int, world: int) -> list[int]:
    """See [Note: step check at scale]: each field as ``f * W + rank`` and ``-f * W + rank``; their
    maximum over the job holds the largest and the smallest value of each field and a rank with it."""
    return [f * world + rank for f in row] + [-f * world + rank for f in row]


def _decode(flat: list[int], world: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """``(value, rank)`` of each field's maximum, then of each field's minimum."""
    half = len(flat) // 2
    return ([(v // world, v % world) for v in flat[:half]], [(-(v // world), v % world) for v in flat[half:]])


class StepCheck:
    """One step check in flight: issued with :func:`issue_step_check`, collected by :meth:`verify`."""

    def __init__(self, reduced: torch.Tensor, work: Any, token: int, world: int, step: int, row: list[int],
                 seq: int) -> None:
        self._reduced, self._work, self._token, self._world, self._step = reduced, work, token, world, step
        self._row, self._seq = row, seq
        _CHECKS.append(self)

    def verify(self, *, before_step: float | None = None) -> None:
        """Collect the reduction (on NCCL the current stream waits for it) and start copying it to
        the host; then compare every collected check that arrived, and those of steps before
        ``before_step`` even if that means waiting for them. ``ValueError`` on every rank if the
        ranks differ. See [Note: step check without a host sync]."""
        if self in _CHECKS:
            _CHECKS.remove(self)
        started = time.perf_counter() if step_timing.enabled() else None
        try:
            self._work.wait()
        except RuntimeError as err:
            raise errors.collective_failed("step check (all_reduce)", "world", dist.group.WORLD, err) from err
        finally:
            watchdog.end(self._token)
            if started is not None:  # waiting here for a late rank is not compute (see [Note: step timing])
                step_timing.CLOCK.blocked(started)
        _ARRIVING.append((self._step, self._world, HostCopy(self._reduced), self._row, self._seq))
        compare_arrived(before_step)

    def completed(self) -> bool:
        try:
            return bool(self._work.is_completed())
        except RuntimeError:
            return True


def compare_arrived(before_step: float | None = None) -> None:
    """Compare the collected checks in order, up to the first one that neither arrived nor belongs to
    a step before ``before_step``."""
    while _ARRIVING:
        step, world, copy, row, seq = _ARRIVING[0]
        if not copy.ready() and (before_step is None or step >= before_step):
            return
        _ARRIVING.pop(0)
        highs, lows = _decode(copy.tolist(), world)
        if any(hi[0] != lo[0] for hi, lo in zip(highs, lows)):
            _ARRIVING.clear()
            _raise_out_of_step(_rows(seq, row, world, highs, lows))


def _rows(seq: int, row: list[int], world: int, highs: list[tuple[int, int]],
          lows: list[tuple[int, int]]) -> dict[int, list[int]]:
    """Every rank's fingerprint of check ``seq`` that arrives through the job's store within
    :data:`_DETAIL_SECONDS` (asked only now that the ranks disagree); a rank that did not say (no
    store, or stuck elsewhere) but holds a field's extreme is filled in from the extremes."""
    rank = peers.identity()[0]
    got = peers.exchange(f"stepcheck/{seq}", json.dumps(row).encode(), world, _DETAIL_SECONDS) or {}
    out = {r: json.loads(v) for r, v in got.items()}
    out.setdefault(rank, row)
    for r in {r for _, r in highs + lows} - set(out):
        # Fields where it holds the largest or smallest value are known; the others are taken from this rank.
        out[r] = [hi[0] if hi[1] == r and hi[0] != lo[0] else lo[0] if lo[1] == r and hi[0] != lo[0] else mine
                  for hi, lo, mine in zip(highs, lows, row)]
    return out


def raise_if_out_of_step(seconds: float = 3.0) -> None:
    """A collective failed: if a step check still in flight completes within ``seconds`` and shows
    the ranks out of step, raise that (the cause) instead of the failure (a consequence)."""
    deadline = time.monotonic() + seconds
    for check in list(_CHECKS):
        while not check.completed() and time.monotonic() < deadline:
            time.sleep(0.05)
        if check.completed():
            try:
                check.verify(before_step=float("inf"))
            except ValueError:
                raise
            except RuntimeError:
                pass  # the check failed too: the collective's own error says the rest


def issue_step_check(pass_name: str, *, mode: str, num_units: int, order_digest: int) -> StepCheck | None:
    """Start the all-reduce of this rank's step fingerprint over the job; see [Note: step check].

    ``None`` in a one-rank job. Every rank must :meth:`~StepCheck.verify` it before its next step
    check and before any gradient reduction.
    """
    world = dist.get_world_size()
    if world == 1:
        return None
    w = current_where()
    row = [_PASSES.index(pass_name), w.step, w.forward, _MODES.index(mode), num_units, order_digest]
    _ISSUED["n"] += 1
    reduced = to_device(_extremes_of(row, dist.get_rank(), world), collective_device())
    token = watchdog.begin("step check", "world", dist.group.WORLD, reduced.numel())
    issue_order.note("world", "all_reduce", reduced)
    try:
        (alias,) = hand_off(reduced)  # see [Note: tensors handed to a backend thread]
        work = dist.all_reduce(alias, op=dist.ReduceOp.MAX, async_op=True)  # the default group: the whole job
    except RuntimeError as err:
        watchdog.end(token)
        raise errors.collective_failed("step check (all_reduce)", "world", dist.group.WORLD, err) from err
    return StepCheck(reduced, work, token, world, w.step, row, _ISSUED["n"])


def _raise_out_of_step(rows: dict[int, list[int]]) -> None:
    groups: dict[tuple, list[int]] = {}
    for rank, row in sorted(rows.items()):
        groups.setdefault(tuple(row), []).append(rank)
    majority = max(groups.values(), key=len)
    odd = [r for r in sorted(rows) if r not in majority] or majority
    described = "; ".join(f"rank{'s' if len(ranks) > 1 else ''} {_ranks(ranks, True)}: {_describe(list(row))}"
                          for row, ranks in sorted(groups.items(), key=lambda kv: kv[1][0]))
    message = (
        f"rank{'s' if len(odd) > 1 else ''} {_ranks(odd, False)} {'are' if len(odd) > 1 else 'is'} out of step "
        f"with the others: {described}. Every rank must run the same forwards and backwards per step, with the "
        "same no_sync blocks and the same units in the same order; look for a batch skipped on some ranks after "
        "its forward, a data-dependent branch, or a micro-batch count that differs by rank. No gradient of this "
        "step was reduced"
    )
    error = ValueError(message)
    errors.announce(error)
    raise error


def _ranks(ranks: list[int], bracket: bool) -> str:
    """``0, 2`` (or ``[0, 2]``); a long list cut after 16."""
    text = ", ".join(map(str, ranks[:16])) + (f" and {len(ranks) - 16} more" if len(ranks) > 16 else "")
    return f"[{text}]" if bracket else text


def _describe(row: list[int]) -> str:
    pass_code, step, forward, mode, num_units, digest = row
    what = f"forward {forward} of step {step}" if pass_code == 0 else f"backward of step {step} after {forward} forward(s)"
    extra = "" if mode == 0 else f", inside no_sync ({_MODES[mode]})"
    return f"{what}{extra}, {num_units} units, unit order #{digest:08x}"

