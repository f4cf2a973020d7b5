"""Checks that the ranks are doing the same thing: one small check per forward and per backward (on
by default), and the opt-in check of every collective.

[Note: step check]
Ranks that run a different number of forwards or backwards, a different ``no_sync`` pattern, or
units in a different order (a data-dependent branch, so that prefetching gathers other units) issue
collectives that pair up by order: same-size ones silently mix unrelated tensors, the others fail
or hang. Each forward (issued at the root's pre-hook, before any gather) and each backward (issued
at its first hook, before any gather) all-gathers a fingerprint over the whole job: which pass, the
step (syncing backwards so far), the forwards in this step, the ``no_sync`` mode, the number of
units and a digest of the unit orders recorded so far. The checks always pair with each other (a
forward's with a backward's when one rank ran an extra forward), so a difference raises a
``ValueError`` naming what each rank was doing, before any gradient is reduced: no weight changes.
Neither check stops the step to wait: the forward's all-gather runs while the forward computes and
is compared at the next check; the backward's runs while the first unit's backward computes and is
compared before the backward's first gradient reduction (the gathers before it are all-gathers,
which cannot reduce anything). Ranks out of step may meanwhile pair gathers wrongly; a collective
that fails in that window first waits (up to 3 s) for the check in flight and raises its
``ValueError`` instead, the cause rather than the consequence. A rank that skipped a whole step
(forward included) cannot be told apart from the others until it finishes early; see [Note:
finishing together] in :mod:`hybridshard.runtime.faults.exits`. Cost: two all-gathers of six integers per
step, off the critical path (docs/runtime.md has the measured figure);
``shard(..., check_steps=False)`` turns it off.

[Note: step check without a host sync]
On CUDA neither building a fingerprint nor reading the gathered ones may make the host wait for the
device (that drains its queue, three times a step). A fingerprint goes to the device from pinned
memory, non-blocking; a collected check's result is copied to pinned memory, non-blocking, with an
event after it (:class:`~hybridshard.runtime.trace.host_syncs.HostCopy`), and is compared once that event
has completed, asked at each later check without waiting. The backward check's collection before
the first gradient reduction also compares every check of *earlier* steps, waiting for it if the
device is that far behind. So a mismatch is found within one step, and the job stops (``ValueError``
on every rank) before the next step reduces a gradient, so before the next optimizer step changes a
weight; the step in which ranks parted may itself have stepped. Nothing goes through the store on a
healthy step. On CPU the gathered tensor is host memory: compared at once, as the Note above says.

[Note: debug agreement check]
Ranks that run a different number of forwards or backwards in a step, or a different ``no_sync``
pattern, issue different collectives; paired up by order they silently mix unrelated tensors of the
same size or wait forever. With ``HYBRIDSHARD_DEBUG=1`` (or ``shard(..., debug=True)``), each
collective is preceded by an all-gather of a small fingerprint in the same group: the kind, element
count, dtype, and where the rank is (step, forward, phase, unit; see
:mod:`hybridshard.runtime.trace.position`). The fingerprints always pair (same size), so a disagreement
raises a ``ValueError`` on every member naming what each rank was doing. It doubles the number of
collectives (each one tiny), so it is for finding such a bug, not for production runs.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from hybridshard.runtime.comm.handoff import hand_off
from hybridshard.runtime.faults import errors, watchdog
from hybridshard.runtime.trace import issue_order
from hybridshard.runtime.trace.host_syncs import HostCopy, to_device
from hybridshard.runtime.trace.position import PHASES, current_where
from hybridshard.topology.groups import collective_device, group_ranks

logger = logging.getLogger(__name__)

__all__ = ["StepCheck", "check", "enabled", "issue_step_check", "raise_if_out_of_step", "set_debug"]

# Newer torch renames the tensor-in/tensor-out all-gather; the semantics are the same.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_DEBUG = {"on": os.environ.get("HYBRIDSHARD_DEBUG", "") not in ("", "0")}
_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "all_to_all")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.uint8)


def enabled() -> bool:
    return _DEBUG["on"]


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
_ARRIVING: list[tuple[int, int, HostCopy]] = []
"""``(step, world, copy)`` of collected checks whose fingerprints are on their way to the host."""


class StepCheck:
    """One step check in flight: issued with :func:`issue_step_check`, collected by :meth:`verify`."""

    def __init__(self, everyone: torch.Tensor, work: Any, token: int, world: int, step: int) -> None:
        self._everyone, self._work, self._token, self._world, self._step = everyone, work, token, world, step
        _CHECKS.append(self)

    def verify(self, *, before_step: float | None = None) -> None:
        """Collect the all-gather (on NCCL the current stream waits for it) and start copying it to
        the host; then compare every collected check that arrived, and those of steps before
        ``before_step`` even if that means waiting for them. ``ValueError`` on every rank if the
        ranks differ. See [Note: step check without a host sync]."""
        if self in _CHECKS:
            _CHECKS.remove(self)
        try:
            self._work.wait()
        except RuntimeError as err:
            raise errors.collective_failed("step check (all_gather)", "world", dist.group.WORLD, err) from err
        finally:
            watchdog.end(self._token)
        _ARRIVING.append((self._step, self._world, HostCopy(self._everyone)))
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
        step, world, copy = _ARRIVING[0]
        if not copy.ready() and (before_step is None or step >= before_step):
            return
        _ARRIVING.pop(0)
        flat = copy.tolist()
        width = len(flat) // world
        rows = [flat[r * width : (r + 1) * width] for r in range(world)]
        if any(row != rows[0] for row in rows):
            _ARRIVING.clear()
            _raise_out_of_step(rows)


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
    """Start the all-gather of this rank's step fingerprint over the job; see [Note: step check].

    ``None`` in a one-rank job. Every rank must :meth:`~StepCheck.verify` it before its next step
    check and before any gradient reduction.
    """
    world = dist.get_world_size()
    if world == 1:
        return None
    w = current_where()
    mine = to_device([_PASSES.index(pass_name), w.step, w.forward, _MODES.index(mode), num_units, order_digest],
                     collective_device())
    everyone = torch.empty(world * mine.numel(), dtype=torch.int64, device=mine.device)
    token = watchdog.begin("step check", "world", dist.group.WORLD, mine.numel())
    issue_order.note("world", "all_gather", mine)
    try:
        out, inp = hand_off(everyone, mine)  # see [Note: tensors handed to a backend thread]
        work = _ALL_GATHER(out, inp, async_op=True)  # the default group: the whole job
    except RuntimeError as err:
        watchdog.end(token)
        raise errors.collective_failed("step check (all_gather)", "world", dist.group.WORLD, err) from err
    return StepCheck(everyone, work, token, world, w.step)


def _raise_out_of_step(rows: list[list[int]]) -> None:
    world = len(rows)
    groups: dict[tuple, list[int]] = {}
    for rank, row in enumerate(rows):
        groups.setdefault(tuple(row), []).append(rank)
    majority = max(groups.values(), key=len)
    odd = [r for r in range(world) if r not in majority] or majority
    described = "; ".join(f"rank{'s' if len(ranks) > 1 else ''} {ranks}: {_describe(row)}"
                          for row, ranks in sorted(groups.items(), key=lambda kv: kv[1][0]))
    message = (
        f"rank{'s' if len(odd) > 1 else ''} {', '.join(map(str, odd))} {'are' if len(odd) > 1 else 'is'} out of step "
        f"with the others: {described}. Every rank must run the same forwards and backwards per step, with the "
        "same no_sync blocks and the same units in the same order; look for a batch skipped on some ranks after "
        "its forward, a data-dependent branch, or a micro-batch count that differs by rank. No gradient of this "
        "step was reduced"
    )
    error = ValueError(message)
    errors.announce(error)
    raise error


def _describe(row: list[int]) -> str:
    pass_code, step, forward, mode, num_units, digest = row
    what = f"forward {forward} of step {step}" if pass_code == 0 else f"backward of step {step} after {forward} forward(s)"
    extra = "" if mode == 0 else f", inside no_sync ({_MODES[mode]})"
    return f"{what}{extra}, {num_units} units, unit order #{digest:08x}"

