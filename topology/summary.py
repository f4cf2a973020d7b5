"""The cluster view gathered through a two-level tree: every node's probe once, a compressed summary to all.

[Note: one probe per node]
Every rank's probe holds its node's probe (an 8-GPU node's pickles to about 9 KB), so gathering
every rank's probe on every rank (``all_gather_object``) gives each rank W of them: 38 MB at 4,096
ranks. Instead every rank sends its probe less the node (its *part*: the node named by its node
name and a digest of its probe), and a node's probe travels once per (node name, digest); ranks of
one node that probed different things (two digests) send both. :func:`view_from_parts` puts the
probes back together, exactly as :func:`~hybridshard.topology.cluster.assemble_cluster` would have
had them, and the view goes to every rank pickled and zlib-compressed: the nodes of a job repeat
each other but for names and GPU ids, which compression keeps and the rest it folds.

[Note: the gather tree]
Sent straight to rank 0, the parts and node probes make rank 0 receive O(W) (7.3 MB at 4,096
ranks). :func:`gather_summary` goes through block leaders instead, with point-to-point object
messages on the given group (creating subgroups at init would itself cost O(W)):

1. the ranks are cut into :func:`blocks` of consecutive group ranks, about sqrt(W) each (see
   :func:`block_size`); a block's first rank leads it;
2. each member sends its leader its part; the leader names the first member of each distinct
   (node name, digest) of its block (:func:`senders`) and tells every member whether it is one;
   those send their node probe;
3. each leader packs its block's parts and node probes into one compressed blob
   (:func:`pack_block`) and sends it to rank 0, which leads block 0;
4. rank 0 unpacks the blobs (:func:`view_from_blocks`) and broadcasts the view, or the error every
   rank raises alike.

A node split over two blocks (rank ranges know nothing of nodes) has its probe sent by each; rank 0
keeps one per (node name, digest). Rank 0 receives W/B blobs and B parts, a leader B parts: O(sqrt W)
each. ``docs/scale.md`` has the figures.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import pickle
import zlib
from typing import Any, Sequence

from hybridshard.topology.cluster import assemble_cluster
from hybridshard.topology.records import ClusterView, NodeProbe, RankProbe

logger = logging.getLogger(__name__)

__all__ = ["block_size", "blocks", "decode_view", "encode_view", "gather_summary", "gather_with", "node_digest",
           "node_key", "pack_block", "rank_part", "senders", "view_from_blocks", "view_from_parts"]

NODE_MULTIPLE = 8
"""Blocks are a multiple of this many ranks: whole nodes of 8, 4, 2 or 1 ranks in torchrun's order."""

NodeKey = tuple[str, str]
"""(node name, digest of the node probe)."""


def node_digest(node: NodeProbe) -> str:
    return hashlib.sha1(json.dumps(node.to_dict(), sort_keys=True).encode()).hexdigest()[:16]


def rank_part(probe: RankProbe) -> dict[str, Any]:
    """What the view needs of this rank's probe: all of it but the node, named by its digest."""
    d = probe.to_dict()
    d["node"] = {"node_name": probe.node.node_name, "digest": node_digest(probe.node)}
    return d


def node_key(part: dict[str, Any]) -> NodeKey:
    return part["node"]["node_name"], part["node"]["digest"]


def block_size(world_size: int) -> int:
    """Ranks per block: sqrt(W) rounded up to a multiple of :data:`NODE_MULTIPLE`, at most W."""
    if world_size < 1:
        raise ValueError(f"expected a world size of at least 1; found {world_size}. Gather over a group with ranks")
    return min(world_size, NODE_MULTIPLE * math.ceil(math.sqrt(world_size) / NODE_MULTIPLE))


def blocks(world_size: int, size: int | None = None) -> list[range]:
    """Consecutive ranges of ``size`` ranks (default :func:`block_size`) covering ``0..world_size-1``."""
    size = block_size(world_size) if size is None else size
    if size < 1:
        raise ValueError(f"expected at least 1 rank per block; found {size}. Pass ranks_per_block >= 1 or None")
    return [range(start, min(start + size, world_size)) for start in range(0, world_size, size)]


def senders(parts: Sequence[dict[str, Any]]) -> list[int]:
    """Positions in ``parts`` of the first part of each distinct (node name, digest): who sends its node."""
    first: dict[NodeKey, int] = {}
    for i, part in enumerate(parts):
        first.setdefault(node_key(part), i)
    return sorted(first.values())


def view_from_parts(parts: Sequence[dict[str, Any]], nodes: dict[NodeKey, dict[str, Any]]) -> ClusterView:
    """The view from every rank's part and one node probe (as a dict) per (node name, digest)."""
    probes = []
    for part in parts:
        key = node_key(part)
        if key not in nodes:
            raise ValueError(f"rank {part['rank']}'s node {key[0]!r} (digest {key[1]}) was not sent; expected one "
                             "probe per distinct node from senders()")
        probes.append(RankProbe.from_dict({**part, "node": nodes[key]}))
    return assemble_cluster(probes)


def pack_block(parts: Sequence[dict[str, Any]], nodes: dict[NodeKey, dict[str, Any]]) -> bytes:
    """One leader's blob: its block's parts and node probes, compressed as one (they repeat each other)."""
    return zlib.compress(pickle.dumps((list(parts), nodes), protocol=pickle.HIGHEST_PROTOCOL), 9)


def view_from_blocks(blobs: Sequence[bytes]) -> ClusterView:
    """The view from every block's blob, in block order; a node sent by two blocks is kept once."""
    parts: list[dict[str, Any]] = []
    nodes: dict[NodeKey, dict[str, Any]] = {}
    for blob in blobs:
        block_parts, block_nodes = pickle.loads(zlib.decompress(blob))
        parts.extend(block_parts)
        nodes.update(block_nodes)
    return view_from_parts(parts, nodes)


def encode_view(view: ClusterView) -> bytes:
    return zlib.compress(pickle.dumps(view, protocol=pickle.HIGHEST_PROTOCOL), 6)


def decode_view(data: bytes) -> ClusterView:
    return pickle.loads(zlib.decompress(data))


def _recv(dist: Any, src: int, group: Any) -> Any:
    box: list[Any] = [None]
    dist.recv_object_list(box, src=src, group=group)
    return box[0]


def _lead_block(dist: Any, block: range, part: dict[str, Any], node: dict[str, Any], to_global: Any,
                group: Any) -> bytes:
    """Steps 2 and 3 of [Note: the gather tree] on a block's leader: its block's blob."""
    parts = [part] + [_recv(dist, to_global(r), group) for r in block[1:]]
    chosen = senders(parts)
    for i, r in enumerate(block[1:], start=1):
        dist.send_object_list([i in chosen], dst=to_global(r), group=group)
    nodes = {node_key(parts[i]): node if i == 0 else _recv(dist, to_global(block[i]), group) for i in chosen}
    return pack_block(parts, nodes)


def gather_summary(rank_probe: RankProbe, group: Any = None, *, ranks_per_block: int | None = None) -> ClusterView:
    """See [Note: the gather tree]; collective over ``group`` (the default group if ``None``).
    ``ranks_per_block`` overrides :func:`block_size` (every rank must pass the same)."""
    import torch.distributed as dist

    return gather_with(dist, rank_probe, group, ranks_per_block)


def gather_with(dist: Any, rank_probe: RankProbe, group: Any, ranks_per_block: int | None) -> ClusterView:
    """:func:`gather_summary` over ``dist``: ``torch.distributed``, or anything with its object
    messages (``send_object_list``, ``recv_object_list``, ``broadcast_object_list``) and ranks."""
    world = dist.get_world_size(group)
    me = dist.get_rank(group)
    tree = blocks(world, ranks_per_block)
    to_global = (lambda r: dist.get_global_rank(group, r)) if group is not None else (lambda r: r)
    block = tree[me // len(tree[0])]
    part, node = rank_part(rank_probe), rank_probe.node.to_dict()
    blob = b""
    if me != block[0]:
        dist.send_object_list([part], dst=to_global(block[0]), group=group)
        if _recv(dist, to_global(block[0]), group):
            dist.send_object_list([node], dst=to_global(block[0]), group=group)
    else:
        blob = _lead_block(dist, block, part, node, to_global, group)
        if me != 0:
            dist.send_object_list([blob], dst=to_global(0), group=group)
    summary: list[Any] = [None]
    if me == 0:
        blobs = [blob] + [_recv(dist, to_global(b[0]), group) for b in tree[1:]]
        try:
            summary[0] = ("view", encode_view(view_from_blocks(blobs)))
        except ValueError as err:  # raised on every rank alike, as when each rank assembled the view
            summary[0] = ("error", str(err))
        logger.debug("cluster view: %d blocks of up to %d ranks", len(tree), len(tree[0]))
    dist.broadcast_object_list(summary, src=to_global(0), group=group)
    kind, payload = summary[0]
    if kind == "error":
        raise ValueError(payload)
    return decode_view(payload)
