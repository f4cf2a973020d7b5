"""DeviceMesh in and out: FSDP2 on ``init_groups().mesh``, and ``hybridshard.shard(mesh=...)``.

4 ranks on 2 simulated nodes, in block and cyclic rank order. Every training run is checked
against the single-process reference (losses and parameters; in the SGD run, whose update shows a
gradient off by a constant factor, the gradient norms too), and against each other:

- out: PyTorch FSDP2 ``fully_shard(module, mesh=groups.mesh)`` (HSDP on the 2-D mesh that
  ``init_groups`` built from the discovered topology) trains like hybridshard's HYBRID_SHARD;
- in: ``shard(mesh=groups.mesh)`` is ``shard(groups=groups)``, down to the collectives it issues;
  a mesh from ``init_device_mesh`` (2-D and 1-D) trains like the reference; bad meshes raise.
"""

from __future__ import annotations

import pytest
import torch

from tests import runtime_models as RM
from tests.mp import RankPool

pytestmark = pytest.mark.multiprocess

WORLD = 4
FP32_TOL = dict(atol=1e-5, rtol=1e-5)
BF16_TOL = dict(atol=2e-3, rtol=2e-3)
CONFIGS = {"fp32": RM.Config(steps=4), "bf16": RM.Config(steps=4, bf16=True),
           # SGD (momentum) and a clip that never binds: a gradient off by a constant factor shows in
           # the parameters and the norms, which AdamW alone would hide.
           "sgd": RM.Config(steps=4, optimizer="sgd", clip=1e6)}


def _train(model: torch.nn.Module, cfg: RM.Config, full_state, clip) -> dict:
    """The reference loop on this rank's share of the global batch, for an already-wrapped model;
    ``clip(model, max_norm)`` clips and returns the total norm (with ``cfg.clip``)."""
    import torch.distributed as dist

    import hybridshard as hs

    rank, world = dist.get_rank(), dist.get_world_size()
    opt = RM.make_optimizer(cfg, model.parameters())
    losses, counts, norms = [], [], []
    for step in range(cfg.steps):
        opt.zero_grad(set_to_none=True)
        tokens = RM.batch(step, 0, rank, cfg.micro_batch)
        with hs.count_collectives() as c:
            loss = RM.lm_loss(model(tokens), tokens)
            loss.backward()
        counts.append(dict(c.calls))
        total = loss.detach().float().reshape(1)
        dist.all_reduce(total)
        losses.append(total.item() / world)
        if cfg.clip is not None:
            norms.append(float(clip(model, cfg.clip)))
        opt.step()
    return {"losses": losses, "norms": norms, "state": full_state(model), "counts": counts}


def _hs_clip(model, max_norm):
    import hybridshard as hs

    return hs.clip_grad_norm_(model, max_norm)


def _fsdp2_clip(model, max_norm):
    from torch.distributed.tensor import DTensor

    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)  # over DTensor gradients: the full norm
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def _hs_state(model):
    import hybridshard as hs

    return hs.full_state_dict(model)


def _fsdp2_state(model):
    from torch.distributed.tensor import DTensor

    out = {}
    for key, value in model.state_dict().items():  # full_tensor() is collective: same key order on every rank
        out[key] = (value.full_tensor() if isinstance(value, DTensor) else value).detach().clone()
    return out


def fsdp2_run(cfg: RM.Config) -> dict:
    """FSDP2 HSDP: ``fully_shard`` on each block, then the root, over ``init_groups().mesh``."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = RM.groups().mesh
    assert mesh is not None and mesh.mesh_dim_names == ("replicate", "shard") and mesh.ndim == 2
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if cfg.bf16 else MixedPrecisionPolicy()
    model = RM.make_model()
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    out = _train(model, cfg, _fsdp2_state, _fsdp2_clip)
    out["shard_group"] = torch.distributed.get_process_group_ranks(mesh.get_group("shard"))
    return out


def hybridshard_run(cfg: RM.Config, *, via: str) -> dict:
    """hybridshard over the same groups, given as ``groups=``, ``mesh=groups.mesh``, or a fresh mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    import hybridshard as hs

    model = RM.make_model()
    mp = hs.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if cfg.bf16 else None
    where = {
        "groups": lambda: {"groups": RM.groups()},
        "mesh": lambda: {"mesh": RM.groups().mesh},
        "init_device_mesh": lambda: {"mesh": init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))},
        "mesh_1d": lambda: {"mesh": init_device_mesh("cpu", (WORLD,), mesh_dim_names=("shard",))},
    }[via]()
    hs.shard(model, strategy=cfg.strategy, wrap={RM.Block}, mixed_precision=mp, **where)
    out = _train(model, cfg, _hs_state, _hs_clip)
    pair = model.hybridshard_runtime.units[0].groups
    out["sizes"] = (pair.shard_size, pair.replicate_size)
    from hybridshard.topology.groups import group_name

    out["shard_group_name"] = group_name(pair.shard)
    return out


def all_runs(cfg: RM.Config) -> dict:
    return {
        "fsdp2": fsdp2_run(cfg),
        **{via: hybridshard_run(cfg, via=via) for via in ("groups", "mesh", "init_device_mesh", "mesh_1d")},
    }


def _error_of(fn) -> str | None:
    try:
        fn()
    except ValueError as err:
        return str(err)
    return None


def bad_meshes() -> dict[str, str | None]:
    """Each misuse of ``mesh=`` raises a ValueError on every rank, before any collective."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    import hybridshard as hs

    groups = RM.groups()
    named_wrong = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "fsdp"))
    three_d = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("pp", "replicate", "shard"))
    replicate_1d = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("replicate",))
    half = DeviceMesh("cpu", [0, 1], mesh_dim_names=("shard",))
    cases = {
        "both": dict(groups=groups, mesh=groups.mesh),
        "names": dict(mesh=named_wrong),
        "ndim": dict(mesh=three_d),
        "replicate_1d": dict(mesh=replicate_1d),
        "size": dict(mesh=half),
        "type": dict(mesh="replicate,shard"),
    }
    return {name: _error_of(lambda kw=kw: hs.shard(RM.make_model(), wrap={RM.Block}, **kw)) for name, kw in cases.items()}


@pytest.fixture(scope="module", params=["block", "cyclic"])
def pool(request):
    with RankPool(WORLD, num_nodes=2, layout=request.param) as p:
        yield p


@pytest.mark.parametrize("precision", sorted(CONFIGS))
def test_fsdp2_on_init_groups_mesh_matches_hybrid_shard(pool, precision):
    cfg = CONFIGS[precision]
    tol = BF16_TOL if cfg.bf16 else FP32_TOL
    ref = RM.reference_run(cfg, WORLD)
    per_rank = pool.run(all_runs, cfg)
    node_of = [node for node, _ in pool.placement]
    for rank, runs in enumerate(per_rank):
        # FSDP2 shards over the ranks of this rank's (simulated) node, as topology found them.
        assert runs["fsdp2"]["shard_group"] == [r for r in range(WORLD) if node_of[r] == node_of[rank]]
        for name, got in runs.items():
            RM.compare(ref, got, label=f"{pool.layout} {precision} {name} rank {rank}", **tol)
        # FSDP2 and hybridshard agree with each other at least as closely as each with the reference.
        RM.compare(runs["groups"], runs["fsdp2"], label=f"fsdp2 vs hybridshard rank {rank}", **tol)
        assert runs["groups"]["sizes"] == runs["mesh"]["sizes"] == runs["init_device_mesh"]["sizes"] == (2, 2)
        assert runs["mesh_1d"]["sizes"] == (WORLD, 1)


def test_shard_mesh_equals_shard_groups(pool):
    cfg = CONFIGS["fp32"]
    per_rank = pool.run(all_runs, cfg)
    for rank, runs in enumerate(per_rank):
        by_groups, by_mesh = runs["groups"], runs["mesh"]
        assert by_mesh["losses"] == by_groups["losses"], f"rank {rank}"
        for key, value in by_groups["state"].items():
            assert torch.equal(by_mesh["state"][key], value), f"rank {rank} {key}"
        expected = RM.expected_counts(cfg)
        assert by_mesh["counts"] == by_groups["counts"] == [expected] * cfg.steps
        # 1-D mesh: sharded over all four ranks, no cross-group all-reduce. (A 1-D mesh over the
        # whole job may reuse the default group, which keeps its name "world".)
        name = runs["mesh_1d"]["shard_group_name"]
        assert name in ("world", "shard")
        one_d = {(kind, name): n for (kind, group), n in expected.items() if group != "replicate"}
        assert runs["mesh_1d"]["counts"] == [one_d] * cfg.steps


def test_bad_meshes_raise_value_errors(pool):
    per_rank = pool.run(bad_meshes, stall_s=60)
    for rank, errors in enumerate(per_rank):
        assert "either groups= or mesh=, not both" in errors["both"], errors
        assert "('replicate', 'shard')" in errors["names"] and "('dp', 'fsdp')" in errors["names"], errors
        assert "3-D mesh" in errors["ndim"] and "init_device_mesh" in errors["ndim"], errors
        assert "NO_SHARD" in errors["replicate_1d"], errors
        assert "(2 ranks) but the job has 4 ranks" in errors["size"], errors
        assert "must be a torch.distributed.device_mesh.DeviceMesh; got str" in errors["type"], errors
