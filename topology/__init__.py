"""Topology discovery and group planning for hybrid sharding.

probe one node (:mod:`hybridshard.topology.probe`) -> gather every rank's probe (:mod:`hybridshard.topology.cluster`) ->
plan shard and replicate groups (:mod:`hybridshard.topology.planner`, a pure function) -> build the
``torch.distributed`` groups and a 2-D ``DeviceMesh`` (:mod:`hybridshard.topology.groups`).
"""

from hybridshard.topology.records import (
    ClusterNode,
    ClusterView,
    GpuInfo,
    NetInterface,
    NodeProbe,
    NumaNode,
    NvLink,
    RankEntry,
    RankProbe,
)

__all__ = [
    "ClusterNode",
    "ClusterView",
    "GpuInfo",
    "NetInterface",
    "NodeProbe",
    "NumaNode",
    "NvLink",
    "RankEntry",
    "RankProbe",
]
