"""The cluster view gathered through one rank: every node's probe once, a compressed summary to all.

[Note: one probe per node]
Every rank's probe holds its node's probe (an 8-GPU node's pickles to about 9 KB), so gathering
every rank's probe on every rank (``all_gather_object``) gives each rank W of them: 38 MB at 4,096
ranks. Instead (:func:`gather_summary`):

1. each rank sends rank 0 its own part of its probe and a digest of its node probe
   (``gather_object``: only rank 0 receives them);
2. rank 0 names one rank per distinct (node name, digest): ranks on one node that probed the same
   node send it once (``broadcast_object_list`` of that short list);
3. those ranks send rank 0 their node probe (``send_object_list``);
4. rank 0 assembles the view (:func:`~hybridshard.topology.cluster.assemble_cluster`, exactly as
   from every probe) and broadcasts it pickled and zlib-compressed: the nodes of a job repeat each
   other but for names and GPU ids, which compression keeps and the rest it folds.

Every rank ends with the view the all-gather gave, from a few bytes per node; rank 0 receives the
node probes once. ``docs/scale.md`` has the figures.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import zlib
from typing import Any, Sequence

from hybridshard.topology.cluster import assemble_cluster
from hybridshard.topology.records import ClusterView, NodeProbe, RankProbe

__all__ = ["decode_view", "encode_view", "gather_summary", "node_digest", "rank_part", "senders", "view_from_parts"]


def node_digest(node: NodeProbe) -> str:
    return hashlib.sha1(json.dumps(node.to_dict(), sort_keys=True).encode()).hexdigest()[:16]


def rank_part(probe: RankProbe) -> dict[str, Any]:
    """What rank 0 needs of this rank's probe: all of it but the node, named by its digest."""
    d = probe.to_dict()
    d["node"] = {"node_name": probe.node.node_name, "digest": node_digest(probe.node)}
    return d


def senders(parts: Sequence[dict[str, Any]]) -> list[int]:
    """The lowest rank of each distinct (node name, digest): the ranks that send their node probe."""
    first: dict[tuple[str, str], int] = {}
    for part in sorted(parts, key=lambda p: p["rank"]):
        first.setdefault((part["node"]["node_name"], part["node"]["digest"]), part["rank"])
    return sorted(first.values())


def view_from_parts(parts: Sequence[dict[str, Any]], nodes: dict[int, dict[str, Any]]) -> ClusterView:
    """The view from every rank's part and the node probes of :func:`senders` (sender rank -> node dict)."""
    by_key = {(parts_by["node"]["node_name"], parts_by["node"]["digest"]): nodes[parts_by["rank"]]
              for parts_by in parts if parts_by["rank"] in nodes}
    probes = []
    for part in parts:
        key = (part["node"]["node_name"], part["node"]["digest"])
        if key not in by_key:
            raise ValueError(f"rank {part['rank']}'s node {key[0]!r} (digest {key[1]}) was not sent; expected one "
                             "probe per distinct node from senders()")
        probes.append(RankProbe.from_dict({**part, "node": by_key[key]}))
    return assemble_cluster(probes)


def encode_view(view: ClusterView) -> bytes:
    return zlib.compress(pickle.dumps(view, protocol=pickle.HIGHEST_PROTOCOL), 6)


def decode_view(data: bytes) -> ClusterView:
    return pickle.loads(zlib.decompress(data))


def gather_summary(rank_probe: RankProbe, group: Any = None) -> ClusterView:
    """See [Note: one probe per node]; collective over ``group`` (the default group if ``None``)."""
    import torch.distributed as dist

    root = dist.get_global_rank(group, 0) if group is not None else 0
    me = dist.get_rank()
    part = rank_part(rank_probe)
    parts: list[Any] | None = [None] * dist.get_world_size(group) if me == root else None
    dist.gather_object(part, parts, dst=root, group=group)
    chosen: list[Any] = [senders(parts) if parts is not None else None]
    dist.broadcast_object_list(chosen, src=root, group=group)
    mine = rank_probe.node.to_dict()
    if me != root and me in chosen[0]:
        dist.send_object_list([mine], dst=root, group=group)
    summary: list[Any] = [None]
    if me == root:
        nodes = {root: mine} if root in chosen[0] else {}
        for sender in chosen[0]:
            if sender != root:
                box: list[Any] = [None]
                dist.recv_object_list(box, src=sender, group=group)
                nodes[sender] = box[0]
        try:
            summary[0] = ("view", encode_view(view_from_parts(parts, nodes)))
        except ValueError as err:  # raised on every rank alike, as when each rank assembled the view
            summary[0] = ("error", str(err))
    dist.broadcast_object_list(summary, src=root, group=group)
    kind, payload = summary[0]
    if kind == "error":
        raise ValueError(payload)
    return decode_view(payload)
