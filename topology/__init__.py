"""Topology discovery and group planning for hybrid sharding.

probe one node (:mod:`topology.probe`) -> gather every rank's probe (:mod:`topology.cluster`) ->
plan shard and replicate groups (:mod:`topology.planner`, a pure function) -> build the
``torch.distributed`` groups and a 2-D ``DeviceMesh`` (:mod:`topology.groups`).
"""

from topology.records import (
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
