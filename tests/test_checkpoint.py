"""Sharded checkpoints: resharding round trips, replicas splitting the writes, saves killed half-way,
errors that change nothing, and replica checksums.

4 ranks on 2 simulated nodes (one pool). The round trip goes 2x2 HYBRID_SHARD -> 1x4 FULL_SHARD ->
4x1 NO_SHARD -> 2x2 HYBRID_SHARD_ZERO2 -> one plain process -> 2x2 HYBRID_SHARD again; every stage
loads the previous stage's checkpoint into a model built from another seed and must hold exactly
the parameters and optimizer state the first run saved, and take the same next step.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import pickle
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import hybridshard as hs
from hybridshard.runtime.engine import get_engine
from hybridshard.state import checkpoint as CK
from hybridshard.state import save_meta as SM
from tests import runtime_models as RM
from tests.live_bytes import LiveTensorBytes
from tests.mp import RankPool

pytestmark = pytest.mark.multiprocess

WORLD = 4
MICRO = 2
NEXT = 7  # the step every stage takes after loading: same data everywhere
TOL = dict(atol=1e-5, rtol=1e-5)
HARNESS = Path(__file__).resolve().parents[1] / "benchmarks" / "control_plane_scale.py"


@pytest.fixture(scope="module")
def pool():
    with RankPool(WORLD, num_nodes=2, layout="block") as p:
        yield p


def _step(model, opt, step: int, rank: int) -> float:
    opt.zero_grad(set_to_none=True)
    tokens = RM.batch(step, 0, rank, MICRO)
    loss = RM.lm_loss(model(tokens), tokens)
    loss.backward()
    opt.step()
    out = loss.detach().reshape(1)
    dist.all_reduce(out)
    return out.item() / dist.get_world_size()


def _sharded(strategy: str, seed: int):
    model = RM.make_model(seed)
    hs.shard(model, strategy=strategy, groups=RM.groups(), wrap={RM.Block})
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)


def stage(strategy: str, *, load: str | None, save: str, seed: int, train_steps: int = 0) -> dict:
    """Build, (train | load), record the full state, save, take one more step."""
    rank = dist.get_rank()
    model, opt = _sharded(strategy, seed)
    for step in range(train_steps):
        _step(model, opt, step, rank)
    extra = hs.load_checkpoint(load, model, optimizer=opt) if load else None
    state, optim = hs.full_state_dict(model), hs.full_optim_state_dict(model, opt)
    on_rank0 = hs.full_state_dict(model, rank0_only=True)
    saved = hs.save_checkpoint(save, model, optimizer=opt, extra={"step": train_steps, "from": strategy})
    loss = _step(model, opt, NEXT, rank)
    return {"extra": extra, "state": state, "optim": optim, "rank0_only": on_rank0, "bytes": saved.bytes_per_rank,
            "loss": loss, "after": hs.full_state_dict(model)}


def _assert_same_optim(got: dict, ref: dict, label: str) -> None:
    assert got["param_groups"] == ref["param_groups"], label
    assert set(got["state"]) == set(ref["state"]), label
    for name, entry in ref["state"].items():
        assert set(got["state"][name]) == set(entry), (label, name)
        for key, value in entry.items():
            assert torch.equal(got["state"][name][key], value), f"{label}: optimizer {name}.{key}"


def _assert_same_state(got: dict, ref: dict, label: str) -> None:
    assert set(got) == set(ref), label
    for key, value in ref.items():
        assert torch.equal(got[key], value), f"{label}: {key}"


def _plain_next_step(model, opt) -> float:
    opt.zero_grad(set_to_none=True)
    tokens = torch.cat([RM.batch(NEXT, 0, r, MICRO) for r in range(WORLD)])
    loss = RM.lm_loss(model(tokens), tokens)
    loss.backward()
    opt.step()
    return loss.item()


def test_resharding_round_trip(pool, tmp_path):
    chain = [("HYBRID_SHARD", 1), ("FULL_SHARD", 2), ("NO_SHARD", 3), ("HYBRID_SHARD_ZERO2", 4)]
    paths = [str(tmp_path / f"ck{i}") for i in range(len(chain))]
    first = pool.run(stage, "HYBRID_SHARD", load=None, save=paths[0], seed=1, train_steps=3)
    ref = first[0]
    assert first[1]["rank0_only"] == {} and first[3]["rank0_only"] == {}
    _assert_same_state(ref["rank0_only"], ref["state"], "rank0_only")
    for i, (strategy, seed) in enumerate(chain[1:], start=1):
        results = pool.run(stage, strategy, load=paths[i - 1], save=paths[i], seed=10 + seed)
        for rank, got in enumerate(results):
            label = f"{strategy} rank {rank}"
            assert got["extra"] == {"step": 3 if i == 1 else 0, "from": chain[i - 1][0]}, label
            _assert_same_state(got["state"], ref["state"], label)
            _assert_same_optim(got["optim"], ref["optim"], label)
            assert got["loss"] == pytest.approx(ref["loss"], rel=1e-6), label
            for key, value in ref["after"].items():
                torch.testing.assert_close(got["after"][key], value, **TOL, msg=lambda m: f"{label} {key}: {m}")

    # One plain process, no process group: the same values, the same next step.
    model = RM.make_model(99)
    opt = torch.optim.AdamW(model.parameters(), lr=1.0)
    extra = hs.load_checkpoint(paths[-1], model, optimizer=opt)
    assert extra == {"step": 0, "from": "HYBRID_SHARD_ZERO2"}
    _assert_same_state(model.state_dict(), ref["state"], "plain")
    _assert_same_optim(_named_optim(model, opt), ref["optim"], "plain")
    assert _plain_next_step(model, opt) == pytest.approx(ref["loss"], rel=1e-6)
    for key, value in ref["after"].items():
        torch.testing.assert_close(model.state_dict()[key], value, **TOL)

    # ... which saves a checkpoint that a sharded job loads again.
    model = RM.make_model(98)
    opt = torch.optim.AdamW(model.parameters(), lr=1.0)
    hs.load_checkpoint(paths[-1], model, optimizer=opt)
    plain_path = str(tmp_path / "plain")
    hs.save_checkpoint(plain_path, model, optimizer=opt, extra={"step": 3, "from": "plain"})
    back = pool.run(stage, "HYBRID_SHARD", load=plain_path, save=str(tmp_path / "back"), seed=5)
    _assert_same_state(back[2]["state"], ref["state"], "plain -> HYBRID_SHARD")
    _assert_same_optim(back[2]["optim"], ref["optim"], "plain -> HYBRID_SHARD")


def _named_optim(model, opt) -> dict:
    names = {id(p): n for n, p in model.named_parameters()}
    osd = opt.state_dict()
    order = [names[id(p)] for g in opt.param_groups for p in g["params"]]
    state = {order[i]: s for i, s in osd["state"].items()}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [order[i] for i in g["params"]]}
              for g in osd["param_groups"]]
    return {"state": state, "param_groups": groups}


def test_replicas_split_the_writing(pool, tmp_path, capsys):
    """Each rank writes a part of the parameters: no replica writes everything, nothing is written twice."""
    path = str(tmp_path / "split")
    results = pool.run(stage, "HYBRID_SHARD", load=None, save=path, seed=1, train_steps=1)
    per_rank = results[0]["bytes"]
    assert len(per_rank) == WORLD and min(per_rank) > 0.5 * max(per_rank), per_rank
    metadata = dcp.FileSystemReader(path).read_metadata()
    writers: dict[str, set[str]] = {}
    for index, info in metadata.storage_data.items():
        writers.setdefault(index.fqn, set()).add(info.relative_path.split("_")[2])
    stored = metadata.state_dict_metadata
    assert "model.head.weight" not in stored  # tied to embed.weight: stored once, under the first name
    for name, value in results[0]["state"].items():
        if name != "head.weight":
            md = stored[f"model.{name}"]
            assert sum(torch.Size(c.sizes).numel() for c in md.chunks) == value.numel(), name  # each element once
    # fc1.weight lies in shard 0 (ranks 0 and 2 hold it), fc2.weight in shard 1 (ranks 1 and 3):
    # both replicas of the shard write a part of it.
    assert writers["model.blocks.0.fc1.weight"] == {"0", "2"}, writers["model.blocks.0.fc1.weight"]
    assert writers["optim.state.blocks.1.fc2.weight.exp_avg"] == {"1", "3"}
    manifest = CK.read_manifest(path)
    assert manifest["strategy"] == "HYBRID_SHARD" and manifest["nodes"] == ["node0", "node0", "node1", "node1"]
    assert manifest["bytes_per_rank"] == list(per_rank)

    # `hybridshard ckpt inspect` tells the same without a process group.
    from hybridshard.cli import main

    assert main(["ckpt", "inspect", str(tmp_path)]) == 0  # a directory of checkpoints: the latest
    out = capsys.readouterr().out
    assert "strategy   HYBRID_SHARD; world size 4" in out and "nodes      node0, node1" in out
    assert f"written    {sum(per_rank):,} bytes" in out
    assert "model.blocks.0.fc1.weight" in out and "32x16" in out and "optim.state.pos.exp_avg_sq" in out
    assert main(["ckpt", "inspect", str(tmp_path / "none")]) == 1
    assert "no complete checkpoint" in capsys.readouterr().err


class _Received:
    """``torch.distributed`` as checkpoint.py calls it (DCP's own collectives are not seen): the bytes
    each collective leaves on this rank (its output buffers, its own piece included) and the calls."""

    def __init__(self) -> None:
        self.bytes, self.calls = 0, []

    TENSOR = ("all_gather_single", "all_gather_into_tensor", "all_reduce", "broadcast")
    LISTS = ("all_gather", "gather", "all_gather_object", "gather_object", "broadcast_object_list")

    def __getattr__(self, name: str):
        real = getattr(dist, name)
        if name not in self.TENSOR + self.LISTS:
            return real

        def counted(*args, **kwargs):
            self.calls.append(name)
            out = real(*args, **kwargs)
            if name in self.TENSOR:
                self.bytes += args[0].numel() * args[0].element_size()
            else:  # the list it fills (gather: the second argument, on the destination only)
                filled = args[0] if name in ("all_gather", "all_gather_object", "broadcast_object_list") else (
                    args[1] if len(args) > 1 else kwargs.get("gather_list", kwargs.get("object_gather_list")))
                for o in filled or ():
                    self.bytes += o.numel() * o.element_size() if torch.is_tensor(o) else 8 + len(pickle.dumps(o))
            return out
        return counted


def save_counted(path: str) -> dict:
    model, _ = _sharded("HYBRID_SHARD", seed=0)
    received = _Received()
    SM.dist = received
    try:
        saved = hs.save_checkpoint(path, model)
    finally:
        SM.dist = dist
    return {"bytes": received.bytes, "calls": received.calls, "per_rank": saved.bytes_per_rank}


def test_save_metadata_names_reach_rank0_only(pool, tmp_path):
    """See [Note: checkpoint metadata at scale]: a rank other than 0 receives 8 bytes a rank and 8 more
    (no node names, no pickles), and the scale harness's count is what a real save's collectives fill."""
    path = str(tmp_path / "meta")
    results = pool.run(save_counted, path)
    manifest = CK.read_manifest(path)
    assert manifest["nodes"] == ["node0", "node0", "node1", "node1"], manifest["nodes"]
    for r in results:
        assert list(r["per_rank"]) == manifest["bytes_per_rank"], (r, manifest["bytes_per_rank"])
        assert not [c for c in r["calls"] if "object" in c], r["calls"]
    spec = importlib.util.spec_from_file_location("control_plane_scale", HARNESS)
    harness = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(harness)
    member, rank0 = harness.ckpt_meta_bytes(manifest["nodes"])
    assert member == 8 * WORLD + 8 and rank0 == member + WORLD * len("node0")
    assert [r["bytes"] for r in results] == [rank0] + [member] * (WORLD - 1), results


def full_state_memory(strategy: str) -> dict:
    """Bytes ``full_state_dict(rank0_only=True, to_cpu=True)`` allocates and holds on this rank."""
    model, _ = _sharded(strategy, seed=0)
    units = get_engine(model).units
    with LiveTensorBytes() as live:
        state = hs.full_state_dict(model, rank0_only=True, to_cpu=True)
    outputs = live.storages_of(state.values())
    return {"extra": live.peak(exclude=outputs), "outputs": sum(live.sizes[i] for i in outputs),
            "unit": max(u.flat.layout.padded_numel * u.flat.sharded.element_size() for u in units),
            "model": sum(t.untyped_storage().nbytes()
                         for t in {t.data_ptr(): t for t in RM.make_model(0).state_dict().values()}.values())}


def test_full_state_dict_holds_one_unit_above_the_shard(pool):
    """Counted as in [Note: counting live tensor bytes] in tests/live_bytes.py: apart from what it
    returns, full_state_dict holds one gathered unit at a time, on every rank that gathers."""
    results = pool.run(full_state_memory, "HYBRID_SHARD")
    largest = results[0]["unit"]
    assert [r["extra"] for r in results] == [largest, largest, 0, 0], (largest, results)  # shard groups (0,1), (2,3)
    assert results[0]["outputs"] == results[0]["model"] and all(r["outputs"] == 0 for r in results[1:])  # tied: once


def corrupt_and_check(strategy: str, corrupt_rank: int | None) -> str:
    model, _ = _sharded(strategy, seed=1)
    if dist.get_rank() == corrupt_rank:
        with torch.no_grad():
            model.hybridshard_runtime.units[1].flat.sharded[3] += 1e-6
    try:
        hs.check_replicas(model)
    except hs.ReplicaDivergence as exc:
        return str(exc)
    return "ok"


def test_check_replicas_names_the_diverging_rank(pool):
    assert pool.run(corrupt_and_check, "HYBRID_SHARD", None) == ["ok"] * WORLD
    no_shard = pool.run(corrupt_and_check, "NO_SHARD", 3)
    assert all("ranks [3] differ from the other replicas" in m and "blocks.0" in m for m in no_shard), no_shard
    hybrid = pool.run(corrupt_and_check, "HYBRID_SHARD", 3)
    # Two replicas: both are named, since neither is in the majority; ranks 0 and 2 are fine but raise too.
    assert all("ranks [1, 3] disagree" in m for m in hybrid), hybrid


def save_then_die(path: str, where: str) -> None:
    import torch.distributed.checkpoint as dcp_mod

    model, opt = _sharded("HYBRID_SHARD", seed=2)
    _step(model, opt, 0, dist.get_rank())
    if where == "write" and dist.get_rank() == 1:
        original = dcp_mod.FileSystemWriter.write_data

        def write_then_die(self, plan, planner):
            original(self, plan, planner).wait()  # this rank's files are on disk, the metadata is not
            os._exit(1)

        dcp_mod.FileSystemWriter.write_data = write_then_die
    if where == "publish" and dist.get_rank() == 0:
        def publish_then_die(partial: str, final: str) -> None:
            os.rename(final, final + CK._OLD)  # the first of the two renames, then the process is gone
            os._exit(1)

        CK._publish = publish_then_die
    hs.save_checkpoint(path, model, optimizer=opt)


def test_save_killed_half_way_leaves_the_previous_checkpoint(pool, tmp_path):
    ckdir = tmp_path / "run"
    good = str(ckdir / "step_00000001")
    ref = pool.run(stage, "HYBRID_SHARD", load=None, save=good, seed=1, train_steps=1)[0]

    with pytest.raises((TimeoutError, AssertionError), match="died|failed"):
        pool.run(save_then_die, str(ckdir / "step_00000002"), "write", stall_s=60)
    assert os.path.isdir(ckdir / "step_00000002.partial") and not os.path.exists(ckdir / "step_00000002")
    assert hs.latest_checkpoint(ckdir) == good
    with pytest.raises(ValueError, match="did not finish"):
        hs.load_checkpoint(ckdir / "step_00000002", RM.make_model(0))

    with pytest.raises((TimeoutError, AssertionError), match="died|failed"):
        pool.run(save_then_die, good, "publish", stall_s=60)  # overwriting, killed between the renames
    assert not os.path.exists(good) and hs.latest_checkpoint(ckdir) == good + CK._OLD
    model = RM.make_model(50)
    opt = torch.optim.AdamW(model.parameters(), lr=1.0)
    assert hs.load_checkpoint(good, model, optimizer=opt) == {"step": 1, "from": "HYBRID_SHARD"}
    _assert_same_state(model.state_dict(), ref["state"], "after the killed saves")
    _assert_same_optim(_named_optim(model, opt), ref["optim"], "after the killed saves")


def load_wrong(path: str) -> dict:
    """A model with an extra block: the load must fail naming it and change nothing."""
    model = RM.make_model(3, num_blocks=3)
    hs.shard(model, strategy="HYBRID_SHARD", groups=RM.groups(), wrap={RM.Block})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = hs.full_state_dict(model)
    try:
        hs.load_checkpoint(path, model, optimizer=opt)
    except ValueError as exc:
        message = str(exc)
    else:
        message = "no error"
    after = hs.full_state_dict(model)
    return {"message": message, "unchanged": all(torch.equal(before[k], after[k]) for k in before),
            "optimizer_empty": not opt.state}


def test_mismatched_model_fails_naming_parameters_and_changes_nothing(pool, tmp_path):
    path = str(tmp_path / "ck")
    model = RM.make_model(0)
    hs.save_checkpoint(path, model)
    for got in pool.run(load_wrong, path):
        assert "missing from the checkpoint: ['blocks.2.fc1.bias'" in got["message"], got["message"]
        assert got["unchanged"] and got["optimizer_empty"]
    # Plain process: a shape that differs, and an optimizer the checkpoint has no state for.
    other = torch.nn.Linear(3, 4)
    with pytest.raises(ValueError, match=r"missing from the checkpoint: \['bias', 'weight'\]"):
        hs.load_checkpoint(path, other)
    wrong_shape = RM.make_model(1)
    wrong_shape.pos = torch.nn.Parameter(torch.zeros(RM.SEQ + 1, RM.DIM))
    before = {k: v.clone() for k, v in wrong_shape.state_dict().items()}
    with pytest.raises(ValueError, match=r"pos: checkpoint \[6, 16\], model \[7, 16\]"):
        hs.load_checkpoint(path, wrong_shape)
    _assert_same_state(wrong_shape.state_dict(), before, "after the failed load")
    with pytest.raises(ValueError, match="holds no optimizer state"):
        hs.load_checkpoint(path, RM.make_model(1), optimizer=torch.optim.SGD(model.parameters(), lr=1.0))
    with pytest.raises(ValueError, match="no complete checkpoint"):
        hs.load_checkpoint(tmp_path / "nothing", RM.make_model(1))


def test_flat_ranges_as_boxes_and_incomplete_checkpoints(tmp_path):
    """Every flat range of a tensor is tiled, in order, by at most 2*ndim-1 contiguous boxes; a
    checkpoint that lacks part of a tensor fails to load, naming the entry."""
    from hybridshard.state.pieces import Piece, PieceLoadPlanner, PieceSavePlanner, flat_range_boxes

    for shape in [(5,), (3, 4), (2, 3, 4), (4, 1, 3)]:
        full = torch.arange(torch.Size(shape).numel()).view(shape)
        for start in range(full.numel() + 1):
            for end in range(start, full.numel() + 1):
                boxes = flat_range_boxes(shape, start, end)
                assert len(boxes) <= 2 * len(shape) - 1
                got = [full[tuple(slice(o, o + s) for o, s in zip(b.offsets, b.sizes))].reshape(-1) for b in boxes]
                assert (torch.cat(got).tolist() if got else []) == list(range(start, end)), (shape, start, end)
    path = str(tmp_path / "half")
    dcp.save({}, checkpoint_id=path, planner=PieceSavePlanner({"w": [Piece((4, 4), 0, torch.arange(8.0))]}), no_dist=True)
    with pytest.raises(BaseException, match="'w' holds 8 of the 16 elements"):  # DCP's CheckpointException
        dcp.load({}, checkpoint_id=path, planner=PieceLoadPlanner({"w": [Piece((4, 4), 0, torch.empty(16))]}), no_dist=True)
    # Through load_checkpoint: a ValueError naming the entry, and the model unchanged.
    model = RM.make_model(0)
    good = str(tmp_path / "good")
    hs.save_checkpoint(good, model)
    os.rename(os.path.join(good, "__0_0.distcp"), os.path.join(good, "moved"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises((ValueError, RuntimeError), match="load_checkpoint.*failed on rank 0"):
        hs.load_checkpoint(good, model)
    _assert_same_state(model.state_dict(), before, "after a failed read")
    half = torch.empty(8)
    dcp.load({}, checkpoint_id=path, planner=PieceLoadPlanner({"w": [Piece((4, 4), 0, half)]}), no_dist=True)
    assert half.tolist() == list(range(8))


def test_save_logs_each_rank_progress_and_the_bytes_it_wrote(tmp_path, caplog, monkeypatch):
    """See [Note: save progress] in hybridshard/state/progress.py (one plain process here)."""
    from hybridshard.state import progress as CP

    monkeypatch.setattr(CP, "PROGRESS_INTERVAL_S", 0.0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)])  # 8 x 16.25 KiB of tensors
    with caplog.at_level(logging.INFO, logger=CP.__name__):
        saved = hs.save_checkpoint(tmp_path / "c", model)
    lines = [r.getMessage() for r in caplog.records if r.name == CP.__name__]
    percents = [int(p) for line in lines for p in re.findall(r"rank 0 wrote .* of 130.0 KiB \((\d+)%\)", line)]
    assert len(percents) >= 6 and percents == sorted(percents) and 80 <= percents[-1] < 100, lines
    size = os.path.getsize(tmp_path / "c" / "__0_0.distcp")
    assert saved.bytes_per_rank == (size,)  # the count is what reached the file
    assert f"rank 0 finished __0_0.distcp: {size / 1024:.1f} KiB ({size / 1024:.1f} KiB in all)" in lines[-1], lines
