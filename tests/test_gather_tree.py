"""The cluster view through the gather tree (topology/summary.py, [Note: the gather tree]) is the view
the flat assembly of every probe gives: for several world sizes, rank orders and block sizes, nodes
split over two blocks, a node whose ranks probed different things, one node; by threads standing in
for ranks (every message pickled), then over gloo on 4 ranks."""

from __future__ import annotations

import collections
import dataclasses
import pickle
import queue
import threading

import pytest

from hybridshard.topology import summary
from hybridshard.topology.cluster import assemble_cluster
from hybridshard.topology.records import RankProbe
from hybridshard.topology.synthetic import rank_order, synthetic_node
from tests.mp import RankPool


def job_probes(counts, order=None, *, second_digest=()):
    """One probe per rank on nodes of ``counts`` GPUs (one rank a GPU), in ``order`` ((node, local
    rank) per global rank; nodes in turn by default). Ranks in ``second_digest`` see one NUMA node
    less than their node's other ranks: a node with two digests."""
    nodes = [synthetic_node(f"n{i}", gpus_per_node=c) for i, c in enumerate(counts)]
    order = order or [(n, k) for n, c in enumerate(counts) for k in range(c)]
    probes = []
    for rank, (n, local) in enumerate(order):
        node = nodes[n]
        if rank in second_digest:
            node = dataclasses.replace(node, numa_nodes=node.numa_nodes[:1])
        uuids = tuple(g.uuid for g in node.gpus)
        probes.append(RankProbe(rank=rank, local_rank=local, world_size=len(order), node=node,
                                visible_gpu_uuids=uuids, gpu_uuid=uuids[local % len(uuids)]))
    return probes


class ThreadComm:
    """``torch.distributed``'s object messages between threads (one per rank): a FIFO per (sender,
    receiver), every object pickled on the way as the real ones are. ``sent`` logs (src, dst, object)."""

    def __init__(self, world: int) -> None:
        self.world, self.local, self.sent = world, threading.local(), []
        self._queues = collections.defaultdict(queue.Queue)
        self._lock = threading.Lock()

    def _queue(self, key):
        with self._lock:
            return self._queues[key]

    def get_world_size(self, group=None):
        return self.world

    def get_rank(self, group=None):
        return self.local.rank

    def send_object_list(self, objs, dst, group=None):
        with self._lock:
            self.sent.append((self.local.rank, dst, objs[0]))
        self._queue(("p2p", self.local.rank, dst)).put(pickle.dumps(objs[0]))

    def recv_object_list(self, box, src, group=None):
        box[0] = pickle.loads(self._queue(("p2p", src, self.local.rank)).get(timeout=60))

    def broadcast_object_list(self, objs, src, group=None):
        if self.local.rank == src:
            for r in range(self.world):
                if r != src:
                    self._queue(("bcast", src, r)).put(pickle.dumps(objs[0]))
        else:
            objs[0] = pickle.loads(self._queue(("bcast", src, self.local.rank)).get(timeout=60))


def run_tree(probes, ranks_per_block=None):
    """Every rank's outcome of the gather (a view or the exception it raised), and the comm."""
    comm, out = ThreadComm(len(probes)), {}

    def rank_main(rank):
        comm.local.rank = rank
        try:
            out[rank] = summary.gather_with(comm, probes[rank], None, ranks_per_block)
        except Exception as err:  # noqa: BLE001 - every rank's outcome is compared
            out[rank] = err

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(len(probes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(out) == len(probes), f"ranks {sorted(set(range(len(probes))) - set(out))} never finished"
    return [out[r] for r in range(len(probes))], comm


LAYOUTS = {
    # name: (probes, ranks per block)
    "64 ranks, whole nodes of 8 per block": (job_probes([8] * 8), None),
    "48 ranks, blocks of 12 split nodes of 8": (job_probes([8] * 6), 12),
    "40 ranks, cyclic: every block meets every node": (job_probes([8] * 5, rank_order(5, 8, "cyclic")), None),
    "nodes of 4 and 8, blocks of 5": (job_probes([4, 8, 4, 8]), 5),
    "a node split over two blocks with two digests": (job_probes([8] * 4, second_digest={5, 9, 10}), 6),
    "a node with two digests, first rank the odd one": (job_probes([8] * 2, second_digest={0}), None),
    "one node": (job_probes([8]), None),
    "one rank": (job_probes([1]), None),
    "every rank its own block": (job_probes([2] * 3, rank_order(3, 2, "cyclic")), 1),
    "200 ranks, default blocks of 16": (job_probes([8] * 25), None),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_tree_view_is_the_flat_assembly(name):
    probes, per_block = LAYOUTS[name]
    views, _ = run_tree(probes, per_block)
    flat = assemble_cluster(probes)
    assert all(v == flat for v in views), (name, [type(v).__name__ for v in views])
    assert views[0].nodes and sum(len(n.ranks) for n in views[0].nodes) == len(probes)


def test_each_block_sends_a_node_probe_once_and_rank_0_one_blob_a_block():
    probes = job_probes([8] * 4, second_digest={5, 9, 10})
    _, comm = run_tree(probes, 6)
    tree = summary.blocks(len(probes), 6)
    nodes_sent = collections.Counter(dst for _, dst, obj in comm.sent if isinstance(obj, dict) and "gpus" in obj)
    for block in tree:
        keys = {(probes[r].node.node_name, summary.node_digest(probes[r].node)) for r in block}
        # The leader's own node is not sent; every other distinct (name, digest) of the block once.
        assert nodes_sent[block[0]] == len(keys) - 1, (block, nodes_sent)
    blobs = [src for src, dst, obj in comm.sent if isinstance(obj, bytes)]
    assert blobs == [b[0] for b in tree[1:]] and all(dst == 0 for _, dst, obj in comm.sent if isinstance(obj, bytes))


def test_blocks_cover_every_rank_once_in_order():
    for world in [1, 2, 7, 8, 9, 63, 64, 65, 255, 256, 1000, 1024, 4096]:
        tree = summary.blocks(world)
        assert [r for b in tree for r in b] == list(range(world)), world
        size = summary.block_size(world)
        assert all(len(b) == size for b in tree[:-1]) and 1 <= len(tree[-1]) <= size, world
        assert size == world or size % summary.NODE_MULTIPLE == 0, (world, size)
    assert [len(summary.blocks(w)) for w in (64, 256, 1024, 4096)] == [8, 16, 32, 64]
    assert summary.blocks(10, 4) == [range(0, 4), range(4, 8), range(8, 10)]


def test_a_bad_job_raises_the_same_error_on_every_rank():
    probes = job_probes([8] * 4)
    probes[13] = dataclasses.replace(probes[13], world_size=31)
    outcomes, _ = run_tree(probes, 8)
    assert all(isinstance(o, ValueError) for o in outcomes), outcomes
    assert len({str(o) for o in outcomes}) == 1
    assert "expected one probe for each rank 0..31 with world size 32" in str(outcomes[0])


def test_a_node_probe_missing_from_a_blob_is_named():
    probes = job_probes([8] * 2)
    parts = [summary.rank_part(p) for p in probes]
    blob = summary.pack_block(parts, {summary.node_key(parts[0]): probes[0].node.to_dict()})
    with pytest.raises(ValueError, match=r"rank 8's node 'n1' \(digest [0-9a-f]{16}\) was not sent; expected one"):
        summary.view_from_blocks([blob])


def test_bad_block_sizes_are_refused():
    with pytest.raises(ValueError, match="expected at least 1 rank per block; found 0. Pass ranks_per_block"):
        summary.blocks(8, 0)
    with pytest.raises(ValueError, match="expected a world size of at least 1; found 0"):
        summary.block_size(0)


# -- over gloo, 4 ranks ---------------------------------------------------------------------------------

GLOO_PROBES = job_probes([2, 2], rank_order(2, 2, "cyclic"), second_digest={3})


def gather_on_rank(probes, ranks_per_block):
    import torch.distributed as dist

    try:
        return summary.gather_summary(probes[dist.get_rank()], ranks_per_block=ranks_per_block)
    except ValueError as err:
        return err


@pytest.fixture(scope="module")
def pool():
    with RankPool(4, num_nodes=2, layout="cyclic") as p:
        yield p


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_gather_summary_over_gloo(pool):
    flat = assemble_cluster(GLOO_PROBES)
    for per_block in (None, 1, 3):  # one block; every rank a leader; a node split and a short last block
        views = pool.run(gather_on_rank, GLOO_PROBES, per_block)
        assert all(v == flat for v in views), (per_block, views)
    bad = [dataclasses.replace(p, world_size=5) if p.rank == 2 else p for p in GLOO_PROBES]
    errors = pool.run(gather_on_rank, bad, 3)
    assert all(isinstance(e, ValueError) for e in errors) and len({str(e) for e in errors}) == 1, errors
