"""A shard group over two nodes in two hops (``CommConfig(two_hop=..., reshard_after_forward="node")``):
parity with one process and with the flat collectives over the same group, the bytes each hop moves,
and the node-local secondary shard's memory.

4 ranks on 2 simulated nodes, ``init_groups(shard_size=4)``: one shard group of k = 2 nodes x g = 2
ranks. Block and cyclic launches (cyclic: node0 holds ranks 0 and 2, so the group is created in
node-major order, not global order).
"""

from __future__ import annotations

import dataclasses

import pytest

from tests import runtime_models as RM
from tests.mp import RankPool

pytestmark = pytest.mark.multiprocess

WORLD = 4
SGD = dict(optimizer="sgd", clip=1e6)  # a clip that never binds: a constant-factor error shows
SWEEP = [RM.Config(strategy=s, two_hop=two, **SGD) for s in ("HYBRID_SHARD", "HYBRID_SHARD_ZERO2") for two in (True, False)]
SWEEP += [RM.Config(strategy="HYBRID_SHARD", reshard_after_forward="node", **SGD),
          RM.Config(strategy="HYBRID_SHARD", reshard_after_forward="node", checkpoint=True, micro_steps=2, **SGD),
          RM.Config(strategy="HYBRID_SHARD", two_hop=True, micro_steps=3, reduce_scatter_micro=True, clip=1.0),
          RM.Config(strategy="HYBRID_SHARD_ZERO2", two_hop=True, checkpoint=True, micro_steps=2, **SGD),
          RM.Config(strategy="HYBRID_SHARD", reshard_after_forward="node", executor="emulate", **SGD),
          RM.Config(strategy="HYBRID_SHARD", two_hop=True, executor="streams", prefetch=2, **SGD),
          RM.Config(strategy="HYBRID_SHARD", reshard_after_forward="node", checkpoint="reentrant", **SGD),
          RM.Config(strategy="HYBRID_SHARD", two_hop=True, checkpoint="reentrant", **SGD)]


def _label(c: RM.Config) -> str:
    return (f"{c.strategy}-{'flat' if c.two_hop is False else 'two'}" + ("-node" if c.reshard_after_forward else "")
            + ("-ckpt" if c.checkpoint else "") + (f"-micro{c.micro_steps}" if c.micro_steps > 1 else "")
            + ("-rs" if c.reduce_scatter_micro else "") + (f"-{c.executor}" if c.executor else ""))


def _sweep_job(configs: list[RM.Config]) -> list[dict]:
    import hybridshard as hs

    RM._GROUPS["groups"] = hs.init_groups(shard_size=4)
    try:
        return RM.run_configs(configs)
    finally:
        RM._GROUPS.clear()


@pytest.fixture(scope="module", params=["block", "cyclic"])
def sweep(request):
    with RankPool(WORLD, num_nodes=2, layout=request.param) as pool:
        yield request.param, pool.run(_sweep_job, SWEEP), pool.run(_memory_job)


@pytest.mark.parametrize("index", range(len(SWEEP)), ids=[_label(c) for c in SWEEP])
def test_parity_with_one_process(sweep, index):
    """Losses, gradient norms and parameters equal one process on the global batch."""
    RM.check_ranks(SWEEP[index], sweep[1], index, WORLD, counts=False)


def test_two_hops_equal_the_flat_collectives_and_use_the_hops(sweep):
    """Two hops give the flat collectives' results to 1e-6; they issue their collectives on the node and
    across-nodes groups, never on the whole shard group."""
    _, results, _ = sweep
    for index, cfg in enumerate(SWEEP):
        if cfg.two_hop is not True or cfg.micro_steps > 1 or cfg.executor or cfg.checkpoint:
            continue
        flat = SWEEP.index(dataclasses.replace(cfg, two_hop=False))
        for rank in range(WORLD):
            RM.compare(results[rank][flat], results[rank][index], atol=1e-6, rtol=1e-6, label=f"{_label(cfg)} rank {rank}")
            two, one = results[rank][index]["counts"][-1], results[rank][flat]["counts"][-1]
            assert not any(group == "shard" for _, group in two), two
            assert two[("all_gather", "shard_across")] == two[("all_gather", "shard_node")] == one[("all_gather", "shard")]
            assert two[("reduce_scatter", "shard_node")] == two[("reduce_scatter", "shard_across")] \
                == one[("reduce_scatter", "shard")], two


def test_the_secondary_shard_gathers_backward_inside_the_node(sweep):
    """reshard_after_forward="node": backward's gathers of the resharded units run inside the node only."""
    _, results, _ = sweep
    pairs = [(4, SWEEP.index(dataclasses.replace(SWEEP[0], two_hop=True))), (len(SWEEP) - 2, len(SWEEP) - 1)]
    for node, two in pairs:  # plain, and with reentrant checkpointing (its forward runs without grad)
        for rank in range(WORLD):
            with_node, without = results[rank][node]["counts"][-1], results[rank][two]["counts"][-1]
            assert with_node[("all_gather", "shard_node")] == without[("all_gather", "shard_node")]
            # every resharded unit (the two blocks) gathers inside the node alone in backward
            assert without[("all_gather", "shard_across")] - with_node[("all_gather", "shard_across")] == 2, \
                (_label(SWEEP[node]), with_node, without)


def _memory_job() -> dict:
    """Bytes each hop moved per step, and what the secondary shards hold between forward and backward."""
    import torch.distributed as dist

    import hybridshard as hs

    groups = hs.init_groups(shard_size=4)
    out = {}
    for name, opts in (("flat", dict(two_hop=False)), ("two", {}), ("node", dict(reshard_after_forward="node"))):
        model = RM.make_model()
        hs.shard(model, strategy="HYBRID_SHARD", groups=groups, wrap={RM.Block}, **opts)
        tokens = RM.batch(0, 0, dist.get_rank(), 2)
        with hs.count_collectives() as counts:
            loss = RM.lm_loss(model(tokens), tokens)
            units = model.hybridshard_runtime.units
            held = sum(u.secondary.numel() for u in units if u.secondary is not None)
            expected = sum(u.flat.layout.padded_numel // 2 for u in units[1:])  # 1/g of every resharded unit
            loss.backward()
        after = sum(u.secondary is not None for u in units)
        out[name] = {"bytes": dict(counts.ring_bytes), "held": held, "expected": expected, "after": after}
    return out


def test_bytes_across_nodes_and_the_secondary_shards_memory(sweep):
    """Out of each node per step (ring model, this rank's collectives): the flat node-major ring over the
    group crosses nodes on one edge per node, ``(S-1)/S`` of each buffer; two hops send ``g`` members'
    ``(k-1)/k`` shares, ``(k-1)/k`` of each buffer: 0.50 against 0.75, a ratio of 2/3. With the
    secondary shard backward sends nothing across nodes for the resharded units. Between forward and
    backward each resharded unit holds 1/g of itself; nothing is held after backward."""
    g, k, S = 2, 2, 4
    for rank, got in enumerate(sweep[2]):
        flat, two, node = got["flat"], got["two"], got["node"]
        crossing_flat = sum(v for (_, group), v in flat["bytes"].items() if group == "shard")  # one edge a node
        crossing_two = g * sum(v for (_, group), v in two["bytes"].items() if group == "shard_across")
        crossing_node = g * sum(v for (_, group), v in node["bytes"].items() if group == "shard_across")
        assert crossing_two / crossing_flat == pytest.approx(((k - 1) / k) / ((S - 1) / S), rel=1e-9), (rank, two, flat)
        assert crossing_node < 0.75 * crossing_two, (rank, node["bytes"], two["bytes"])
        assert node["held"] == node["expected"] > 0 and two["held"] == 0, (rank, node, two)
        assert node["after"] == 0, node
