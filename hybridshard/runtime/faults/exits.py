"""How a rank leaves: an uncaught exception is told to the other ranks, and a finished rank checks
that the others finished the same steps.

[Note: finishing together]
A rank that skipped a whole step (forward included) runs the same collectives as the others, one
step ahead in the data, until it runs out of steps: nothing in the step can tell. So a process that
trained a sharded model publishes ``rank R finished after S steps`` in the job's store at exit and
waits (at most ``HYBRIDSHARD_EXIT_WAIT`` seconds, 10 by default) until every rank finished, raised,
or is blocked in a collective ([Note: heartbeats] in :mod:`hybridshard.runtime.faults.peers`). All
after the same steps: it exits as it was going to. Otherwise it logs which ranks are where and exits
with status 1, and the blocked ranks' collectives then fail naming it. Ranks running outside any
collective (rank 0 evaluating alone), or in one for less than ``BLOCKED_SECONDS`` (a GPU finishing
its last step), are not waited for past the limit.

An uncaught exception (in any thread) is published as ``rank R raised ValueError: ...`` before the
process dies, so the peers' failing collectives lead with it, and is written to torchrun's error
file for the launcher's summary ([Note: run directory] in :mod:`hybridshard.launcher.runlog`).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Any

from hybridshard.runtime.faults import causes, errors, peers
from hybridshard.runtime.faults.rank_state import current
from hybridshard.runtime.faults.watchdog import my_status
from hybridshard.runtime.trace.position import where

logger = logging.getLogger(__name__)

__all__ = ["exit_wait_seconds", "install"]

_INSTALLED: dict[str, Any] = {}
"""The hooks this module replaced: ``sys.excepthook`` and ``atexit`` are one per process."""


def exit_wait_seconds() -> float:
    return peers.env_seconds("HYBRIDSHARD_EXIT_WAIT", 10.0)


def install() -> None:
    """Hook uncaught exceptions and the process's exit (once per process; called by ``shard``)."""
    if _INSTALLED:
        return
    peers.store()  # found now, while the process group exists
    _INSTALLED["excepthook"] = sys.excepthook
    _INSTALLED["threading"] = threading.excepthook
    sys.excepthook = _excepthook
    threading.excepthook = _thread_excepthook
    import atexit

    atexit.register(_at_exit)


def _publish_raised(error: BaseException) -> None:
    if isinstance(error, (KeyboardInterrupt, SystemExit)):
        return
    current().raised = True  # no "finished" check at exit: this rank did not finish
    errors.write_error_file(error, consequence=isinstance(error, errors.CollectiveError))
    try:
        errors.announce(error)
        causes.wait_until_seen()  # before the exit can take the store away: [Note: keeping the causes]
    except Exception:  # noqa: BLE001 - never hide the user's own error
        logger.debug("could not publish the uncaught exception", exc_info=True)


def _excepthook(kind: type, error: BaseException, tb: Any) -> None:
    _publish_raised(error)
    _INSTALLED["excepthook"](kind, error, tb)


def _thread_excepthook(args: Any) -> None:
    if args.exc_value is not None:
        _publish_raised(args.exc_value)
    _INSTALLED["threading"](args)


def _at_exit() -> None:
    """See [Note: finishing together]."""
    if current().raised or where.step == 0 or peers.store() is None:
        return
    me, world = peers.identity()
    if world == 1:
        return
    same_steps = f"done-after-{where.step}"
    peers.tally(same_steps, 1)  # before "done": a rank counted as done is already counted under its steps
    peers.publish("done", f"rank {me} finished after {where.step} steps")
    deadline = time.monotonic() + exit_wait_seconds()
    while time.monotonic() < deadline:
        # [Note: finishing at scale] Three counts, one store operation each, tell whether every rank
        # finished or raised and whether the finished ones all took this rank's steps; only a job whose
        # counts disagree reads every rank's heartbeat (W keys) to say who finished where. A rank adds
        # to its steps' count before the done count and the counts are read the other way round, so a
        # rank counted done is always counted under its steps too: ``same >= done`` when they agree.
        # The heartbeats have the last word before anyone is stopped.
        done, raised, same = peers.tally("done"), peers.tally("raised"), peers.tally(same_steps)
        if done is None or raised is None or same is None:
            return  # the store is gone (its host exited): nothing more to learn
        if done + raised >= world:
            if same >= done:
                return
            texts = peers.published("done", list(range(world)))
            if texts is None:
                return
            if len({text.rsplit(" after ", 1)[-1] for text in texts.values()}) > 1:
                _leave_out_of_step("the ranks finished after different numbers of steps", sorted(texts.values()))
        reports = peers.ask_everyone(my_status(), seconds=2.0)
        if reports is None:
            return
        blocked = blocked_on_me(reports, me)
        if blocked:
            _leave_out_of_step(
                f"ranks {[r.rank for r in blocked]} are still in training collectives", [peers.table(reports)]
            )
        time.sleep(0.5)
    logger.info("rank %d: exiting while some ranks have not finished yet (waited %.0fs)", me, exit_wait_seconds())


BLOCKED_SECONDS = 3.0
"""How long a peer's training collective must have been in flight to count as waiting for this rank."""


def blocked_on_me(reports: list[Any], me: int) -> list[Any]:
    """The peers blocked in a training collective of a group this rank belongs to, so waiting for it.

    A collective counts only after :data:`BLOCKED_SECONDS` in flight: on NCCL a collective stays
    registered until the device has run it, so a peer whose GPU is still finishing the last step
    shows one for a moment and then finishes too.
    """
    return [r for r in reports if me in r.ranks and not r.call
            and (r.state == "failed" or (r.state == "collective" and r.seconds >= BLOCKED_SECONDS))]


def _leave_out_of_step(why: str, details: list[str]) -> None:
    me, _ = peers.identity()
    logger.error(
        "rank %d finished after %d steps, but %s: the ranks ran different numbers of steps (a batch skipped on "
        "some ranks?), so this rank's weights are not the others'.\n%s",
        me, where.step, why, "\n".join(details),
    )
    errors.stop_now(1)
