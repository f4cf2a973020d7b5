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
Sent straight to rank 0, the parts and node probes make rank 0 receive O(W) (7.0 MB at 4,096
ranks). :func:`gather_summary` goes through block leaders instead, with point-to-point object
messages on the given group (creating subgroups at init would itself cost O(W)):

1. the ranks are cut into :func:`blocks` of consecutive group ranks, about sqrt(W) each (see
   :func:`block_size`); a block's first rank leads it;
2. each member sends its leader its part; each leader sends rank 0, which leads block 0, the
   distinct (node name, digest) of its block (:func:`node_keys`, compressed: a few bytes each);
3. rank 0 picks, for each distinct (node name, digest), the one block that sends its probe
   (:func:`assign_senders`, [Note: one sender per node]) and tells each leader which of its keys;
   the leader tells every member whether it is the first of such a key, those send their node probe;
4. each leader packs its block's parts and the node probes it was given into one compressed blob
   (:func:`pack`) for rank 0;
5. rank 0 puts the view together (:func:`view_from_parts`) and broadcasts it, or the error every
   rank raises alike.

Rank 0 receives W/B key lists and blobs and B parts, a leader B parts: O(sqrt W) messages each.
``docs/scale.md`` has the figures.

[Note: one sender per node]
Rank ranges know nothing of nodes: in SLURM's cyclic order every block of B consecutive ranks meets
B nodes, so a probe sent by every block holding one of its node's ranks would reach rank 0 up to
W/B times. Rank 0, holding every block's keys after step 2, names one block per key: a leader's own
node goes with the first block it leads (no message); any other with the least-loaded block holding
it, block 0 last (there each probe is one uncompressed message to rank 0, elsewhere packed with others).
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

__all__ = ["assign_senders", "block_size", "blocks", "decode_view", "encode_view", "gather_summary", "gather_with",
           "node_digest", "node_key", "node_keys", "pack", "rank_part", "sender_positions", "unpack",
           "view_from_parts"]

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
    # A UUID of one of the node's GPUs goes as its position there: in cyclic order the parts a leader packs
    # come from different nodes, and their UUIDs (random to zlib) would not compress.
    position = {g.uuid: i for i, g in enumerate(probe.node.gpus)}
    d["visible_gpu_uuids"] = [position.get(u, u) for u in d["visible_gpu_uuids"]]
    d["gpu_uuid"] = position.get(d["gpu_uuid"], d["gpu_uuid"])
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


def node_keys(parts: Sequence[dict[str, Any]]) -> list[NodeKey]:
    """The distinct (node name, digest) of a block's parts, in order of first appearance (its leader's first)."""
    return list(dict.fromkeys(node_key(part) for part in parts))


def assign_senders(block_keys: Sequence[Sequence[NodeKey]]) -> list[list[int]]:
    """For each block (its :func:`node_keys`), the indices of the keys whose node probe it sends: one
    block per distinct (node name, digest). See [Note: one sender per node]."""
    offers: dict[NodeKey, dict[int, int]] = {}  # key -> {block: its index there}
    for b, keys in enumerate(block_keys):
        for k, key in enumerate(keys):
            offers.setdefault(key, {})[b] = k
    load, chosen = [0] * len(block_keys), [[] for _ in block_keys]
    for by_block in offers.values():  # in rank order of first appearance: deterministic
        b = min(by_block, key=lambda c: (by_block[c] != 0, c == 0 and by_block[c] != 0, load[c], c))
        chosen[b].append(by_block[b])
        load[b] += by_block[b] != 0
    return [sorted(c) for c in chosen]


def sender_positions(parts: Sequence[dict[str, Any]], chosen: Sequence[int]) -> list[int]:
    """The positions in a block (its ``parts``) that send the node probes of its ``chosen`` keys: each
    key's first."""
    first = {key: i for i, key in reversed(list(enumerate(map(node_key, parts))))}
    keys = node_keys(parts)
    return [first[keys[k]] for k in chosen]


def _uuid(uuids: list[str | None], value: int | str | None) -> str | None:
    """A GPU UUID of a part: given as its position on the node (see :func:`rank_part`), or as itself."""
    return uuids[value] if isinstance(value, int) else value


def view_from_parts(parts: Sequence[dict[str, Any]], nodes: dict[NodeKey, dict[str, Any]]) -> ClusterView:
    """The view from every rank's part and one node probe (as a dict) per (node name, digest)."""
    probes = []
    for part in parts:
        key = node_key(part)
        if key not in nodes:
            raise ValueError(f"rank {part['rank']}'s node {key[0]!r} (digest {key[1]}) was not sent; expected one "
                             "probe per distinct node from assign_senders()")
        node = nodes[key]
        uuids = [gpu["uuid"] for gpu in node["gpus"]]
        probes.append(RankProbe.from_dict({**part, "node": node, "gpu_uuid": _uuid(uuids, part["gpu_uuid"]),
                                           "visible_gpu_uuids": [_uuid(uuids, u) for u in part["visible_gpu_uuids"]]}))
    return assemble_cluster(probes)


def pack(obj: Any) -> bytes:
    """A leader's blob (its block's keys, or its parts and node probes): compressed, they repeat each other."""
    return zlib.compress(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), 9)


def unpack(blob: bytes) -> Any:
    return pickle.loads(zlib.decompress(blob))


def encode_view(view: ClusterView) -> bytes:
    return zlib.compress(pickle.dumps(view, protocol=pickle.HIGHEST_PROTOCOL), 6)


def decode_view(data: bytes) -> ClusterView:
    return pickle.loads(zlib.decompress(data))


def _recv(dist: Any, src: int, group: Any) -> Any:
    box: list[Any] = [None]
    dist.recv_object_list(box, src=src, group=group)
    return box[0]


def _lead_block(dist: Any, block: range, parts: list[dict[str, Any]], chosen: Sequence[int],
                node: dict[str, Any], to_global: Any, group: Any) -> list[dict[str, Any]]:
    """Step 3 of [Note: the gather tree] on a block's leader: the node probes of its ``chosen`` keys."""
    senders = sender_positions(parts, chosen)
    for i, r in enumerate(block[1:], start=1):
        dist.send_object_list([i in senders], dst=to_global(r), group=group)
    return [node if i == 0 else _recv(dist, to_global(block[i]), group) for i in senders]


def _gather_on_rank0(dist: Any, tree: list[range], parts0: list[dict[str, Any]], node: dict[str, Any], to_global: Any,
                     group: Any) -> tuple[list[dict[str, Any]], dict[NodeKey, dict[str, Any]]]:
    """Steps 2 to 4 of [Note: the gather tree] on rank 0, which leads block 0: every part and node probe."""
    block_keys = [node_keys(parts0)] + [unpack(_recv(dist, to_global(b[0]), group)) for b in tree[1:]]
    chosen = assign_senders(block_keys)
    for b, block in enumerate(tree[1:], start=1):
        dist.send_object_list([chosen[b]], dst=to_global(block[0]), group=group)
    got = [(parts0, _lead_block(dist, tree[0], parts0, chosen[0], node, to_global, group))]
    got += [unpack(_recv(dist, to_global(block[0]), group)) for block in tree[1:]]
    nodes = {block_keys[b][k]: probe for b, (_, probes) in enumerate(got) for k, probe in zip(chosen[b], probes)}
    return [p for parts, _ in got for p in parts], nodes


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
    summary: list[Any] = [None]
    if me != block[0]:
        dist.send_object_list([part], dst=to_global(block[0]), group=group)
        if _recv(dist, to_global(block[0]), group):
            dist.send_object_list([node], dst=to_global(block[0]), group=group)
    else:
        parts = [part] + [_recv(dist, to_global(r), group) for r in block[1:]]
        if me != 0:
            dist.send_object_list([pack(node_keys(parts))], dst=to_global(0), group=group)
            chosen = _recv(dist, to_global(0), group)
            nodes = _lead_block(dist, block, parts, chosen, node, to_global, group)
            dist.send_object_list([pack((parts, nodes))], dst=to_global(0), group=group)
        else:
            parts, nodes = _gather_on_rank0(dist, tree, parts, node, to_global, group)
            try:
                summary[0] = ("view", encode_view(view_from_parts(parts, nodes)))
            except ValueError as err:  # raised on every rank alike, as when each rank assembled the view
                summary[0] = ("error", str(err))
            except Exception as err:  # noqa: BLE001 - any other failure is still sent, so no rank waits for the view
                summary[0] = ("failure", f"assembling the cluster view on rank 0 failed: {type(err).__name__}: {err}")
            logger.debug("cluster view: %d blocks of up to %d ranks", len(tree), len(tree[0]))
    dist.broadcast_object_list(summary, src=to_global(0), group=group)
    kind, payload = summary[0]
    if kind == "error":
        raise ValueError(payload)
    if kind == "failure":
        raise RuntimeError(payload)
    return decode_view(payload)
