"""The cluster view through the gather tree (topology/summary.py, [Note: the gather tree]) is the view
the flat assembly of every probe gives: for several world sizes, rank orders and block sizes, nodes
split over two blocks, a node whose ranks probed different things, one node; by threads standing in
for ranks (every message pickled), then over gloo on 4 ranks. Each node's probe is sent once, so the
bytes a rank receives stay bounded in SLURM's cyclic order too ([Note: one sender per node])."""

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
from tests.test_control_plane_scale import harness  # noqa: F401 - the benchmark, loaded by its path


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
    receiver), every object pickled on the way as the real ones are. ``sent`` logs (src, dst, object);
    ``received`` counts each rank's bytes as the object collectives move them (an 8-byte size, the pickle)."""

    def __init__(self, world: int) -> None:
        self.world, self.local, self.sent = world, threading.local(), []
        self.received = collections.Counter()
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

    def _take(self, key):
        data = self._queue(key).get(timeout=60)
        with self._lock:
            self.received[self.local.rank] += 8 + len(data)
        return pickle.loads(data)

    def recv_object_list(self, box, src, group=None):
        box[0] = self._take(("p2p", src, self.local.rank))

    def broadcast_object_list(self, objs, src, group=None):
        if self.local.rank == src:
            for r in range(self.world):
                if r != src:
                    self._queue(("bcast", src, r)).put(pickle.dumps(objs[0]))
        else:
            objs[0] = self._take(("bcast", src, self.local.rank))


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
    "128 ranks, cyclic over 16 nodes, blocks of 16": (job_probes([8] * 16, rank_order(16, 8, "cyclic")), None),
    "cyclic, two digests on a node, blocks of 6": (job_probes([8] * 4, rank_order(4, 8, "cyclic"),
                                                              second_digest={1, 4, 13, 22}), 6),
    "cyclic over nodes of 4 and 8": (job_probes([4, 8, 4, 8], [(n, k) for k in range(8) for n in range(4)
                                                               if k < (4, 8)[n % 2]]), 8),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_tree_view_is_the_flat_assembly(name):
    probes, per_block = LAYOUTS[name]
    views, _ = run_tree(probes, per_block)
    flat = assemble_cluster(probes)
    assert all(v == flat for v in views), (name, [type(v).__name__ for v in views])
    assert views[0].nodes and sum(len(n.ranks) for n in views[0].nodes) == len(probes)


def node_probes_sent(comm):
    """Every node probe that travelled: (sender, receiver, node name), raw or inside a leader's blob."""
    out = []
    for src, dst, obj in comm.sent:
        if isinstance(obj, dict) and "gpus" in obj:
            out.append((src, dst, obj["node_name"]))
        elif isinstance(obj, bytes):
            blob = summary.unpack(obj)
            if isinstance(blob, tuple):  # (parts, node probes); a list is a block's keys
                out += [(src, dst, node["node_name"]) for node in blob[1]]
    return out


@pytest.mark.parametrize("name", [n for n in LAYOUTS if "cyclic" in n or "digests" in n])
def test_each_node_probe_is_sent_once(name):
    probes, per_block = LAYOUTS[name]
    _, comm = run_tree(probes, per_block)
    tree = summary.blocks(len(probes), per_block)
    # To rank 0, once a (node name, digest): a node with two digests twice, the name of rank 0's never.
    to_rank0 = collections.Counter(n for _, dst, n in node_probes_sent(comm) if dst == 0)
    keys = collections.Counter(name for name, _ in {summary.node_key(summary.rank_part(p)) for p in probes})
    keys[probes[0].node.node_name] -= 1  # rank 0's own, unless the node has a second digest
    assert to_rank0 == +keys, (to_rank0, keys)
    # Each leader sends rank 0 its keys and one blob, and nothing else reaches rank 0 from outside block 0.
    leaders = [b[0] for b in tree[1:]]
    blobs = collections.Counter(src for src, dst, obj in comm.sent if dst == 0 and isinstance(obj, bytes))
    assert blobs == dict.fromkeys(leaders, 2), blobs
    assert {src for src, dst, _ in comm.sent if dst == 0} <= set(leaders) | set(tree[0]), comm.sent


def test_senders_are_one_block_per_node_and_spread():
    # 4 nodes of 8 in cyclic order, blocks of 8: every block holds every node, its leader on node 0.
    parts = [summary.rank_part(p) for p in job_probes([8] * 4, rank_order(4, 8, "cyclic"))]
    block_parts = [parts[b.start:b.stop] for b in summary.blocks(32, 8)]
    block_keys = [summary.node_keys(ps) for ps in block_parts]
    assert all(keys == block_keys[0] and len(keys) == 4 for keys in block_keys)
    chosen = summary.assign_senders(block_keys)
    # Rank 0's node goes with rank 0 (no message); the other three, one a block, none from block 0.
    assert chosen == [[0], [1], [2], [3]], chosen
    assert [summary.sender_positions(ps, c) for ps, c in zip(block_parts, chosen)] == [[0], [1], [2], [3]]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout,world", [("cyclic", 256), ("block", 64)])
def test_bytes_received_are_bounded_and_the_harness_counts_them(harness, layout, world):
    """The real messages of W threads over the harness's probes (the 8-GPU DGX fixture): at 256 ranks in
    SLURM's cyclic order no rank receives more than 64 KB (each node's probe sent by one block: every
    block sending each of its nodes gave rank 0 300 KB); the harness counts exactly these bytes."""
    probes = harness._probes(world, layout)
    views, comm = run_tree(probes)
    flat = assemble_cluster(probes)
    assert all(v == flat for v in views)
    received = [comm.received[r] for r in range(world)]
    assert max(received) <= 64 * 1024, (layout, max(received), received.index(max(received)))
    counted = harness.init_and_checkpoint(world, layout, probes)
    tree = summary.blocks(world)
    members = [r for r in range(world) if r not in {b[0] for b in tree}]
    assert counted["init_bytes_rank0"] == received[0], (counted, received[0])
    assert counted["init_bytes_leader"] == max(received[b[0]] for b in tree[1:]), counted
    assert counted["init_bytes_per_rank"] == max(received[r] for r in members), counted
    assert counted["init_bytes_max_rank"] == max(received), counted


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


def test_an_unexpected_failure_on_rank0_reaches_every_rank(monkeypatch):
    """Not only a ValueError: any failure assembling the view is sent, so no rank waits for a view
    that never comes (a process-group timeout later)."""
    def broken(parts, nodes):
        raise KeyError("gpus")

    monkeypatch.setattr(summary, "view_from_parts", broken)
    outcomes, _ = run_tree(job_probes([8] * 2), 8)
    assert all(isinstance(o, RuntimeError) for o in outcomes), outcomes
    assert all(str(o) == "assembling the cluster view on rank 0 failed: KeyError: 'gpus'" for o in outcomes), outcomes


def test_a_node_probe_missing_is_named():
    probes = job_probes([8] * 2)
    parts = [summary.rank_part(p) for p in probes]
    with pytest.raises(ValueError, match=r"rank 8's node 'n1' \(digest [0-9a-f]{16}\) was not sent; expected one"):
        summary.view_from_parts(parts, {summary.node_key(parts[0]): probes[0].node.to_dict()})


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
