"""One line per change of the live replica groups, for the console of a fault-tolerant job.

[Note: membership lines]
torchft logs every quorum of every step; a user needs to know when the set of live replica groups
changed. Each group sees every change, so only the group that was participating rank 0 in the
step before a group came back, or is now after a group was lost (and there, only process rank 0)
says it: a group that was lost and has just come back never does. At the first committed step with fewer groups: ``step S: replica groups 3 ->
2 (1 lost); 1 step retried, 2.1 s lost``. At the first with more: ``step S: replica groups 2 -> 3 (1
back, healed from the live groups' state; it missed steps L..S-1)``. The lines go to the
``hybridshard.ft.membership`` logger; under ``hybridshard launch --fault-tolerant``
(``HYBRIDSHARD_FT_CONSOLE=1``) also to stdout, which the launcher shows while torchft's own logging
stays in each rank's log file.
"""

from __future__ import annotations

import logging
import os
import sys
import time

logger = logging.getLogger(__name__)

__all__ = ["Membership", "CONSOLE_ENV"]

CONSOLE_ENV = "HYBRIDSHARD_FT_CONSOLE"


def _console_handler() -> None:
    if os.environ.get(CONSOLE_ENV) != "1" or any(getattr(h, "hybridshard_console", False) for h in logger.handlers):
        return
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("[hybridshard.ft] %(message)s"))
    handler.hybridshard_console = True  # type: ignore[attr-defined]
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)


class Membership:
    """Watches each step's outcome and live groups; see [Note: membership lines]."""

    def __init__(self, speaks: bool) -> None:
        self.speaks = speaks
        """This process may speak (process rank 0 of its group)."""
        self.live: int | None = None
        self.was_first = False
        self.lost_at: int | None = None
        self.retried = 0
        self.failing_since: float | None = None
        if speaks:
            _console_handler()

    def observe(self, *, committed: bool, live: int, step: int, first: bool, now: float | None = None) -> str | None:
        """Record one step: ``committed``, ``live`` groups in its quorum, ``step`` (committed steps after it),
        whether this group is participating rank 0. Returns the line said, if any."""
        now = time.monotonic() if now is None else now
        if not committed:
            self.retried += 1
            self.failing_since = self.failing_since if self.failing_since is not None else now
            return None
        line = None
        if self.live is not None and live != self.live and (first if live < self.live else self.was_first):
            if live < self.live:
                lost_s = now - self.failing_since if self.failing_since is not None else 0.0
                line = (f"step {step}: replica groups {self.live} -> {live} ({self.live - live} lost); "
                        f"{self.retried} step{'s' if self.retried != 1 else ''} retried, {lost_s:.1f} s lost")
                self.lost_at = step
            else:
                missed = f"; it missed steps {self.lost_at}..{step - 1}" if self.lost_at is not None else ""
                line = (f"step {step}: replica groups {self.live} -> {live} ({live - self.live} back, healed from "
                        f"the live groups' state{missed})")
        self.live, self.was_first, self.retried, self.failing_since = live, first, 0, None
        if line is not None and self.speaks:
            logger.info("%s", line)
        return line
