"""Everything that moves a sharded model's state in or out: full state dicts, optimizer state,
DCP checkpoints and replica checks.

- ``access``: what every state module needs from the runtime: sharded or not, idle or not, one
  unit gathered, and each parameter's range on this rank.
- ``full``: full (unsharded) model state dicts; ``optim``: optimizer state keyed by name.
- ``checkpoint``: sharded DCP checkpoints, with ``planner`` (flat ranges as DCP chunks) and
  ``progress`` (bytes written, logged).
- ``replicas``: replicas of a shard still agree.
"""
