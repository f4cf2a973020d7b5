"""``hybridshard.debug``: seeing what a sharded model communicates, and checking that ranks agree.

- :func:`comm_stats` (what one model moved, per group and collective, and its hook times),
  :func:`count_collectives` (every collective issued inside a block), :func:`record_issue_order`
  (the order collectives were issued in, per communicator).
- :func:`check_replicas` / :func:`maybe_check_replicas` (replicas hold the same shards, else
  :class:`ReplicaDivergence`); :func:`set_debug` (check every collective, as ``HYBRIDSHARD_DEBUG=1``).

Those that were top-level names before (``hybridshard.record_issue_order`` ...) stay importable there.
"""

from hybridshard.runtime.comm.agreement import set_debug
from hybridshard.runtime.trace.counters import CollectiveCounts, count_collectives
from hybridshard.runtime.trace.issue_order import IssueLog, record_issue_order
from hybridshard.runtime.engine import comm_stats
from hybridshard.state.replicas import ReplicaDivergence, check_replicas, maybe_check_replicas

__all__ = ["CollectiveCounts", "IssueLog", "ReplicaDivergence", "check_replicas", "comm_stats", "count_collectives",
           "maybe_check_replicas", "record_issue_order", "set_debug"]
