"""hybridshard: hybrid sharded data parallel training on process groups built from the discovered
cluster topology.

Parameters, gradients and optimizer state are sharded inside a fast domain (normally one node) and
replicated across domains. The groups come from :func:`init_groups`, which probes every rank's node,
gathers the probes and plans the shard and replicate groups (see :mod:`topology`).
"""

from hybridshard.groups import ShardGroups, init_groups

# -- runtime exports (flat-parameter runtime) --------------------------------------------------
# -- end runtime exports ----------------------------------------------------------------------

__version__ = "0.1.0"

__all__ = [
    "ShardGroups",
    "init_groups",
]
