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
import torch

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
        yield request.param, pool.run(_sweep_job, SWEEP), pool.run(_memory_job), pool.run(_order_job)


@pytest.mark.parametrize("index", range(len(SWEEP)), ids=[_label(c) for c in SWEEP])
def test_parity_with_one_process(sweep, index):
    """Losses, gradient norms and parameters equal one process on the global batch."""
    RM.check_ranks(SWEEP[index], sweep[1], index, WORLD, counts=False)


def test_two_hops_equal_the_flat_collectives_and_use_the_hops(sweep):
    """Two hops give the flat collectives' results to 1e-6; they issue their collectives on the node and
    across-nodes groups, never on the whole shard group."""
    results = sweep[1]
    for index, cfg in enumerate(SWEEP):
        if cfg.two_hop is not True or cfg.micro_steps > 1 or cfg.executor or cfg.checkpoint:
            continue
        flat = SWEEP.index(dataclasses.replace(cfg, two_hop=False))
        for rank in range(WORLD):
            RM.compare(results[rank][flat], results[rank][index], atol=1e-6, rtol=1e-6, label=f"{_label(cfg)} rank {rank}")
            two, one = results[rank][index]["counts"][-1], results[rank][flat]["counts"][-1]
            assert not any(group == "shard" for _, group in two), two
            # the hop inside the node is one call per node's row of the buffer: K = 2 calls per gathered unit
            assert two[("all_gather", "shard_node")] == 2 * two[("all_gather", "shard_across")] \
                == 2 * one[("all_gather", "shard")], two
            assert two[("reduce_scatter", "shard_node")] == 2 * two[("reduce_scatter", "shard_across")] \
                == 2 * one[("reduce_scatter", "shard")], two


def test_the_secondary_shard_gathers_backward_inside_the_node(sweep):
    """reshard_after_forward="node": backward's gathers of the resharded units run inside the node only."""
    results = sweep[1]
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


def _order_job() -> list[list[tuple]]:
    """The forward of a second step (the first records the order prefetching follows), as a log of the
    shard group's all-gathers (group, async) and of each unit's compute starting ("compute")."""
    import torch.distributed as dist

    import hybridshard as hs
    from hybridshard.runtime.comm import collectives as C
    from hybridshard.topology import groups as G

    groups = hs.init_groups(shard_size=4)
    model = RM.make_model(num_blocks=4)
    hs.shard(model, strategy="HYBRID_SHARD", groups=groups, wrap={RM.Block})
    log: list[tuple] = []
    for module in (model, *model.blocks):  # after the runtime's pre-hooks: its unit is gathered by then
        module.register_forward_pre_hook(lambda *_: log.append(("compute",)))
    real = C.all_gather

    def logged(out, tensor, group, *args, **kwargs):
        log.append((G.group_name(group), bool(kwargs.get("async_op"))))
        return real(out, tensor, group, *args, **kwargs)

    logs = []
    C.all_gather = logged
    try:
        for step in range(2):
            log.clear()
            tokens = RM.batch(step, 0, dist.get_rank(), 2)
            loss = RM.lm_loss(model(tokens), tokens)
            logs.append(list(log))
            loss.backward()
    finally:
        C.all_gather = real
    return logs


def test_a_prefetched_gathers_hop_across_nodes_runs_behind_compute(sweep):
    """[Note: a deferred inner hop]: on the thread executor a prefetched unit's hop across nodes is
    issued asynchronously before the unit in front of it computes, and its hops inside the node only once
    that compute is done (the root, first, has no unit in front)."""
    code = {("shard_across", True): "A", ("shard_across", False): "a", ("shard_node", True): "N", ("compute",): "C"}
    for rank, (_, forward) in enumerate(sweep[3]):
        log = "".join(code.get(e, "?") for e in forward)  # A/a: across, async or not; N: inside; C: compute
        assert log.count("A") + log.count("a") == 5 and log.count("C") == 5 and "?" not in log, (rank, log)
        across = [i for i, c in enumerate(log) if c in "Aa"]  # unit u's hop across: the u-th, in issue order
        inner = [i for i, c in enumerate(log) if c == "N"][::2]  # unit u's first hop inside the node
        compute = [i for i, c in enumerate(log) if c == "C"]
        for u in range(1, 5):  # each block: prefetched across before the unit in front computes, inside after
            assert log[across[u]] == "A" and across[u] < compute[u - 1] < inner[u], (rank, u, log)


# -- FULL_SHARD and SHARD_GRAD_OP: the whole job as one shard group over the two nodes -------------------
# No init_groups(): shard() learns each rank's node with one gather ([Note: the whole job in two hops]).

WORLD_SWEEP = [RM.Config(strategy=s, two_hop=two, **SGD) for s in ("FULL_SHARD", "SHARD_GRAD_OP") for two in (None, False)]
WORLD_SWEEP += [RM.Config(strategy="FULL_SHARD", reshard_after_forward="node", **SGD),
                RM.Config(strategy="SHARD_GRAD_OP", two_hop=True, checkpoint=True, micro_steps=2, **SGD),
                RM.Config(strategy="FULL_SHARD", two_hop=True, executor="emulate", **SGD)]
HOPS = {"block": [0, 1, 2, 3], "cyclic": [0, 2, 1, 3]}  # node-major members: node0's ranks, then node1's


def _world_job(configs: list[RM.Config], root: str) -> dict:
    import torch.distributed as dist

    from hybridshard.topology.groups import group_ranks
    from hybridshard.topology.world_hops import world_groups

    RM._GROUPS["groups"] = None  # shard(groups=None): FULL_SHARD and SHARD_GRAD_OP need no init_groups()
    try:
        results = RM.run_configs(configs)
    finally:
        RM._GROUPS.clear()
    groups = world_groups(two_hop=None)
    place = {"members": group_ranks(groups.shard), "shard_rank": groups.shard_rank,
             "default": groups.shard is dist.group.WORLD}
    return {"results": results, "place": place, "bytes": _world_bytes(), "checkpoints": _checkpoint_job(root)}


def _world_bytes() -> dict:
    """Ring bytes of one FULL_SHARD step per (kind, group), flat and in two hops."""
    import torch.distributed as dist

    import hybridshard as hs

    out = {}
    for name, two in (("flat", False), ("two", None)):
        model = RM.make_model()
        hs.shard(model, strategy="FULL_SHARD", wrap={RM.Block}, two_hop=two)
        tokens = RM.batch(0, 0, dist.get_rank(), 2)
        with hs.count_collectives() as counts:
            RM.lm_loss(model(tokens), tokens).backward()
        out[name] = dict(counts.ring_bytes)
    return out


def _checkpoint_job(root: str) -> dict:
    """A FULL_SHARD run in two hops saves; the flat FULL_SHARD loads it and saves; SHARD_GRAD_OP and
    FULL_SHARD in two hops load that. Each records its full model and optimizer state after loading
    and after one more step."""
    import os

    import torch
    import torch.distributed as dist

    import hybridshard as hs

    rank = dist.get_rank()

    def build(strategy: str, two_hop: bool | None):
        model = RM.make_model(seed=7)
        hs.shard(model, strategy=strategy, wrap={RM.Block}, two_hop=two_hop)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step(model, opt, i: int) -> None:
        opt.zero_grad(set_to_none=True)
        tokens = RM.batch(i, 0, rank, 2)
        RM.lm_loss(model(tokens), tokens).backward()
        opt.step()

    out = {}
    chain = [("two", "FULL_SHARD", None, None), ("flat", "FULL_SHARD", False, "two"),
             ("zero2", "SHARD_GRAD_OP", None, "flat"), ("back", "FULL_SHARD", None, "flat")]
    for name, strategy, two_hop, load in chain:
        model, opt = build(strategy, two_hop)
        if load is None:
            step(model, opt, 0)
        else:
            hs.load_checkpoint(os.path.join(root, load), model, optimizer=opt)
        out[name] = {"hops": model.hybridshard_runtime.shard_two_hop, "state": hs.full_state_dict(model),
                     "optim": hs.full_optim_state_dict(model, opt)}
        if name in ("two", "flat"):
            hs.save_checkpoint(os.path.join(root, name), model, optimizer=opt)
        step(model, opt, 1)
        out[name]["next"] = hs.full_state_dict(model)
    return out


@pytest.fixture(scope="module", params=["block", "cyclic"])
def world_sweep(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"world-{request.param}")
    with RankPool(WORLD, num_nodes=2, layout=request.param) as pool:
        yield request.param, pool.run(_world_job, WORLD_SWEEP, str(root))


@pytest.mark.parametrize("index", range(len(WORLD_SWEEP)), ids=[_label(c) for c in WORLD_SWEEP])
def test_whole_job_parity_with_one_process(world_sweep, index):
    """FULL_SHARD and SHARD_GRAD_OP over 2 nodes x 2 ranks, in two hops or flat: losses, norms and
    parameters equal one process on the global batch."""
    RM.check_ranks(WORLD_SWEEP[index], [got["results"] for got in world_sweep[1]], index, WORLD, counts=False)


def test_whole_job_uses_the_hops_unless_two_hop_is_false(world_sweep):
    """The shard group is the whole job in node-major order (the default group itself in a block
    launch); two hops issue every gather and reduce-scatter on ``world_node``/``world_across`` and
    none on the world, give the flat results to 1e-6, and ``two_hop=False`` stays flat."""
    layout, per_rank = world_sweep
    for rank, got in enumerate(per_rank):
        assert got["place"] == {"members": HOPS[layout], "shard_rank": HOPS[layout].index(rank),
                                "default": layout == "block"}, (rank, got["place"])
        results = got["results"]
        for index, cfg in enumerate(WORLD_SWEEP):
            calls = results[index]["calls"][-1]
            if cfg.two_hop is False:
                assert {group for _, group in calls} == {"world"}, (_label(cfg), calls)
                two = results[WORLD_SWEEP.index(dataclasses.replace(cfg, two_hop=None))]
                RM.compare(results[index], two, atol=1e-6, rtol=1e-6, label=f"{_label(cfg)} rank {rank}")
                assert two["calls"][-1][("all_gather", "world_node")] == 2 * calls[("all_gather", "world")]
                continue
            assert not any(group == "world" for _, group in calls), (_label(cfg), calls)
            # inside the node: one call per node's row of the buffer (2 nodes)
            assert calls[("reduce_scatter", "world_node")] == 2 * calls[("reduce_scatter", "world_across")] > 0, calls
            across, inside = calls[("all_gather", "world_across")], calls[("all_gather", "world_node")]
            # the secondary shard: each of the 2 blocks gathers inside the node alone in backward
            assert inside // 2 - across == (2 if cfg.reshard_after_forward else 0), (_label(cfg), calls)


def test_whole_job_bytes_across_nodes(world_sweep):
    """Out of each node per step: the flat node-major ring over the job sends (S-1)/S of each buffer,
    two hops send g members' (k-1)/k shares, (k-1)/k of each buffer: 0.50 against 0.75."""
    g, k, S = 2, 2, 4
    for rank, got in enumerate(world_sweep[1]):
        flat, two = got["bytes"]["flat"], got["bytes"]["two"]
        assert {group for _, group in flat} == {"world"} and ("all_gather", "world_across") in two, (flat, two)
        crossing_flat = sum(v for (_, group), v in flat.items() if group == "world")
        crossing_two = g * sum(v for (_, group), v in two.items() if group == "world_across")
        assert crossing_two / crossing_flat == pytest.approx(((k - 1) / k) / ((S - 1) / S), rel=1e-9), (rank, two, flat)


def test_checkpoints_load_across_the_hops_exactly(world_sweep):
    """Saved in two hops (node-major shard ranks), loaded flat (world order) and back, and into
    SHARD_GRAD_OP: the full model and optimizer state are bit-identical, the next step equal to 1e-6."""
    for rank, got in enumerate(world_sweep[1]):
        runs = got["checkpoints"]
        assert [runs[n]["hops"] for n in ("two", "flat", "zero2", "back")] == [True, False, True, True], rank
        for name in ("flat", "zero2", "back"):
            assert runs[name]["optim"]["param_groups"] == runs["two"]["optim"]["param_groups"], (rank, name)
            pairs = (("state", runs[name]["state"], runs["two"]["state"], 0.0),
                     ("optim", runs[name]["optim"]["state"], runs["two"]["optim"]["state"], 0.0),
                     ("next", runs[name]["next"], runs["two"]["next"], 1e-6))  # the step sums in another order
            for key, got_state, ref_state, tol in pairs:
                torch.testing.assert_close(got_state, ref_state, atol=tol, rtol=tol,
                                           msg=lambda m: f"rank {rank} {name} {key}: {m}")


def test_plan_world_is_node_major_in_network_order_and_declines_what_it_cannot_hop():
    from hybridshard.topology.world_hops import plan_world

    plan, why = plan_world(["a", "b", "a", "b"])  # cyclic: a holds 0 and 2
    assert why == "" and plan.shard_groups == ((0, 2, 1, 3),) and (plan.shard_nodes, plan.ranks_per_node) == (2, 2)
    assert plan.replicate_size == 1 and plan.shard_group_hosts == (("a", "b"),)
    plan, _ = plan_world(["a", "a", "b", "b", "c", "c"], {"a": ("r1",), "b": ("r0",), "c": ("r0",)})
    assert plan.shard_groups == ((2, 3, 4, 5, 0, 1),)  # rack r0's nodes first: a ring leaves each rack once
    for nodes, reason in ((["a"] * 4, "one node"), (["a", "a", "a", "b"], "different numbers"),
                          (["a", "b", "c", "d"], "one rank per node")):
        plan, why = plan_world(nodes)
        assert plan is None and reason in why, (nodes, why)


def test_two_hop_resolution_covers_every_strategys_groups():
    """The engine's switch is on when any sharded unit's groups (hybrid or the whole job's) have hops;
    asking for hops (or the secondary shard) where none has them is refused."""
    from types import SimpleNamespace as NS

    import hybridshard as hs
    from hybridshard.runtime.setup.rack_reduce import resolve_shard_hops

    flat, world = NS(shard_size=4, shard_hops=None), NS(shard_size=8, shard_hops=object())
    assert resolve_shard_hops(hs.CommConfig(), [flat, world]) == (True, False)
    assert resolve_shard_hops(hs.CommConfig(reshard_after_forward="node"), [world]) == (True, True)
    assert resolve_shard_hops(hs.CommConfig(two_hop=False), [world]) == (False, False)
    assert resolve_shard_hops(hs.CommConfig(), [flat]) == (False, False)
    for comm in (hs.CommConfig(two_hop=True), hs.CommConfig(reshard_after_forward="node")):
        with pytest.raises(ValueError, match=r"expects a shard group that spans several nodes .* found shard groups "
                                             r"without two hops \(4 ranks\)"):
            resolve_shard_hops(comm, [flat])
    with pytest.raises(ValueError, match="found two_hop=False"):
        resolve_shard_hops(hs.CommConfig(two_hop=False, reshard_after_forward="node"), [world])


def _one_node_job() -> dict:
    """FULL_SHARD on one node: no gather of node identities, the default group, no hops."""
    import torch.distributed as dist

    import hybridshard as hs

    real, asked = dist.all_gather_object, []
    dist.all_gather_object = lambda *a, **k: asked.append(a) or real(*a, **k)
    try:
        model = RM.make_model()
        hs.shard(model, strategy="FULL_SHARD", wrap={RM.Block})
        try:
            hs.shard(RM.make_model(), strategy="FULL_SHARD", two_hop=True)
            refused = ""
        except ValueError as err:
            refused = str(err).splitlines()[0]
    finally:
        dist.all_gather_object = real
    units = model.hybridshard_runtime.units
    return {"gathers": len(asked), "world": all(u.groups.shard is dist.group.WORLD for u in units),
            "hops": any(u.groups.shard_hops is not None for u in units), "refused": refused}


def test_one_node_keeps_the_flat_world_at_no_cost():
    with RankPool(WORLD, num_nodes=1) as pool:
        per_rank = pool.run(_one_node_job)
    for got in per_rank:
        assert got["gathers"] == 0 and got["world"] and not got["hops"], got
        assert "CommConfig(two_hop=True) expects a shard group that spans several nodes" in got["refused"], got


def test_fake_backend_gathers_nothing():
    """torch's fake backend (benchmarks/big_rank*.py) answers every collective with this rank's data:
    a job of 16 "ranks" on 2 "nodes" stays flat, and shard() does not ask for node identities."""
    import os
    import pathlib
    import subprocess
    import sys

    script = (
        "import os, torch.distributed as dist\n"
        "from torch.testing._internal.distributed.fake_pg import FakeStore\n"
        "dist.init_process_group('fake', store=FakeStore(), rank=0, world_size=16)\n"
        "dist.all_gather_object = None  # any call fails\n"
        "import hybridshard as hs\n"
        "from tests import runtime_models as RM\n"
        "model = hs.shard(RM.make_model(), strategy='FULL_SHARD', wrap={RM.Block})\n"
        "units = model.hybridshard_runtime.units\n"
        "print('flat', all(u.groups.shard is dist.group.WORLD and u.groups.shard_hops is None for u in units))\n")
    root = pathlib.Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240, cwd=str(root),
                          env={**os.environ, "HYBRIDSHARD_NODE_NAME": "n0", "LOCAL_WORLD_SIZE": "8"})
    assert done.returncode == 0 and "flat True" in done.stdout, done.stderr[-2000:]
