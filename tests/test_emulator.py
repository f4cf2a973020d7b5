"""The emulated device (hybridshard/runtime/comm/executors/emulate.py) under the runtime: the defects it
exists to catch, on gloo ranks (its rules on their own, in one process: tests/test_emulated_streams.py).

4 ranks on 2 simulated nodes (shard groups of 2) and 2 ranks on 2 nodes (shard groups of one), one pool
each for the module.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests import runtime_models as RM
from tests.mp import RankPool


def run(cfg: RM.Config) -> dict:
    return RM.sharded_run(cfg)


@pytest.fixture(scope="module")
def pool4():
    with RankPool(4, num_nodes=2, layout="block", timeout=240) as pool:
        yield pool


@pytest.fixture(scope="module")
def pool2():
    with RankPool(2, num_nodes=2, layout="block", timeout=240) as pool:
        yield pool


SLICED = replace(RM.Config(steps=3), shard_optimizer=True, optimizer="sgd", clip=1e6)


def _bitwise(a: dict, b: dict) -> None:
    assert a["losses"] == b["losses"] and a["norms"] == b["norms"], (a["losses"], b["losses"])
    for key, value in b["state"].items():
        assert torch.equal(a["state"][key], value), key


@pytest.mark.parametrize("pool_name, cfg", [
    ("pool4", SLICED),
    ("pool4", replace(SLICED, compression="int8")),
    ("pool2", SLICED),  # shard groups of one: the reduce-scatter "output" is a view of the gradient
], ids=["S2", "S2-int8", "S1"])
def test_optimizer_sliced_across_replicas_keeps_what_the_replicate_stream_reads(request, pool_name, cfg):
    """Defect: the replicate reduce-scatter read a buffer nobody held any more (a gradient shard, or
    with shard groups of one the unsharded gradient), so the allocator could reuse it mid-read."""
    pool = request.getfixturevalue(pool_name)
    emulated = pool.run(run, replace(cfg, executor="emulate"))
    streams = pool.run(run, replace(cfg, executor="streams"))
    for a, b in zip(emulated, streams):
        _bitwise(a, b)
    if cfg.compression is None:
        RM.compare(RM.reference_run(cfg, pool.world_size), emulated[0], label=pool_name, atol=1e-5, rtol=1e-5)


STEADY = [
    RM.Config(steps=3),
    replace(RM.Config(steps=3), strategy="FULL_SHARD", prefetch=2),
    replace(RM.Config(steps=3), bf16=True, fp16=True, clip=1.0),
    replace(RM.Config(steps=3), shard_optimizer=True, clip=1.0),
    replace(RM.Config(steps=3), strategy="FULL_SHARD", offload=True, prefetch=2),
    replace(RM.Config(steps=3), offload=True, micro_steps=2),
]


@pytest.mark.parametrize("cfg", STEADY, ids=["hybrid", "full-p2", "fp16-scaler-clip", "sliced-clip", "offload-full-p2",
                                             "offload-hybrid-micro"])
def test_no_host_sync_in_steady_state_steps(pool4, cfg):
    """From the second step on the runtime makes no host sync but the documented exempt ones (the step
    check used to make four a step: two torch.tensor(..., device=) and two .tolist(); CPU offload one
    blocking copy per unit, now one event sync per step)."""
    for rank, got in enumerate(pool4.run(run, replace(cfg, executor="emulate"))):
        assert got["host_syncs"]["hot"] == {}, (rank, got["host_syncs"]["hot"])
        sites = {site for _, _, site in got["host_syncs"]["exempt"]}
        offload = "CPU offload: gradients arrived"
        assert sites <= {"GradScaler.step found_inf", "clip_grad_norm_", offload}, sites
        if cfg.fp16:
            assert "GradScaler.step found_inf" in sites
        arrivals = {step: n for (step, _, site), n in got["host_syncs"]["exempt"].items() if site == offload}
        # one per step with offload, whatever the number of units (and none for a no_sync backward)
        assert list(arrivals.values()) == ([1, 1] if cfg.offload else []), (rank, arrivals)  # steps 2 and 3


# -- where the streams wait -------------------------------------------------------------------------

def stream_waits(strategy: str, *, sliced: bool = False, micro_rs: bool = False) -> dict:
    """Two steps under the emulator (the second one inside ``no_sync(reduce_scatter=True)`` first
    with ``micro_rs``); the waits of the second step and what the no_sync backward queued."""
    import torch.distributed as dist

    import hybridshard as hs

    model = RM.make_model(num_blocks=3)
    hs.shard(model, strategy=strategy, groups=RM.groups(), wrap={RM.Block}, executor="emulate", prefetch=1,
             shard_optimizer_across_replicas=sliced)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    streams = model.hybridshard_runtime.executor.streams
    queued = {}
    for step in range(2):
        tokens = RM.batch(step, 0, dist.get_rank(), 2)
        if micro_rs and step == 1:
            before = streams.reduce_scatter.enqueued
            with hs.no_sync(model, reduce_scatter=True):
                RM.lm_loss(model(tokens), tokens).backward()
            queued["no_sync reduce_scatter stream"] = streams.reduce_scatter.enqueued - before
        RM.lm_loss(model(tokens), tokens).backward()
        opt.step()
        opt.zero_grad()
    return {"waits": list(streams.waits), **queued}


def test_the_replica_gather_is_waited_for_by_the_all_gather_stream_not_compute(pool4):
    """Defect: the compute stream waited for unit k+1's all-gather across replicas (issued after the
    optimizer step) before unit k computed; only the shard group's all-gather stream needs it."""
    for got in pool4.run(stream_waits, "HYBRID_SHARD", sliced=True):
        forward = [w for w in got["waits"] if w[3] == "forward"]
        assert not [w for w in forward if w[:2] == ("all_reduce", "compute")], forward
        assert len([w for w in forward if w[:2] == ("all_reduce", "all_gather")]) == 4, forward  # one per unit


def test_no_shard_reduction_does_not_stall_the_next_unit(pool4):
    """Defect: NO_SHARD's world all-reduce made the compute stream wait for it at the next unit's
    post-backward hook; the gradient it reads is the job's shard, held until the end of backward."""
    for got in pool4.run(stream_waits, "NO_SHARD"):
        backward = [w for w in got["waits"] if w[3] == "backward"]
        assert not [w for w in backward if w[:2] == ("reduce_scatter", "compute")], backward


def test_no_sync_reduce_scatter_runs_on_the_reduce_scatter_stream(pool4):
    """Defect: inside no_sync(reduce_scatter=True) every reduce-scatter ran synchronously on the compute stream."""
    for got in pool4.run(stream_waits, "HYBRID_SHARD", micro_rs=True):
        assert got["no_sync reduce_scatter stream"] >= 4, got  # 4 units: a reduce-scatter each, plus local work


def test_no_shard_no_sync_reduce_scatter_keeps_the_held_shard(pool4):
    """Defect found by the emulator: NO_SHARD's all-reduce adds what no_sync held on the reduce-scatter
    stream, and nothing held that shard once the hook returned."""
    cfg = replace(RM.Config(steps=2), strategy="NO_SHARD", micro_steps=2, reduce_scatter_micro=True)
    for a, b in zip(pool4.run(run, replace(cfg, executor="emulate")), pool4.run(run, replace(cfg, executor="streams"))):
        _bitwise(a, b)


def recorded_waits() -> list[tuple]:
    import torch.distributed as dist

    import hybridshard as hs

    model = RM.make_model()
    hs.shard(model, strategy="HYBRID_SHARD", groups=RM.groups(), wrap={RM.Block}, executor="emulate")
    tokens = RM.batch(0, 0, dist.get_rank(), 2)
    with hs.record_issue_order() as log:
        RM.lm_loss(model(tokens), tokens).backward()
    return [(i.group, i.kind, i.phase, i.stream, tuple(i.waited_by)) for i in log.issues]


def test_recorded_collectives_name_their_stream_and_who_waited(pool4):
    for got in pool4.run(recorded_waits):
        gathers = [g for g in got if g[:2] == ("shard", "all_gather")]
        assert gathers and all(g[3] == "all_gather" and g[4] and g[4][0].startswith("compute in unit ") for g in gathers), got
        replicate = [g for g in got if g[0] == "replicate"]
        assert len(replicate) == 3 and all(g[3] == "all_reduce" for g in replicate), replicate
        assert all(g[4] and g[4][0].startswith("compute in unit ") for g in replicate), replicate  # drained
        scatters = [g for g in got if g[:2] == ("shard", "reduce_scatter")]
        assert all(g[3] == "reduce_scatter" and g[4][0].startswith("all_reduce in unit") for g in scatters), scatters
        checks = [g for g in got if g[0] == "world"]
        assert checks and all(g[3] == "" for g in checks)  # the step check: on the compute stream


# -- fault-tolerant mode: the managed all-reduce --------------------------------------------------

def managed_all_reduce_order() -> dict:
    """A managed all-reduce (torchft's work is gloo's: its ``wait()`` blocks the host) issued in the
    all-reduce stream's job; when the host waited on it, relative to the job and the compute wait."""
    import torch.distributed as dist

    from hybridshard.ft.replicate import _ManagedPending
    from hybridshard.runtime.comm.executors.emulate import EmulatedStreams

    events = []

    class NotedWork:  # gloo's own work, each host wait on it noted
        def __init__(self, work):
            self.work = work

        def wait(self):
            events.append("host waited")
            return self.work.wait()

    streams = EmulatedStreams(torch.device("cpu"))
    shard = torch.full((4,), float(dist.get_rank() + 1))
    with streams.side(streams.all_reduce, follow_compute=False):
        pending = _ManagedPending(NotedWork(dist.all_reduce(shard.detach(), async_op=True)))
        done = streams.fence(streams.all_reduce, pending)
    events.append("job issued")
    done.wait()  # the compute stream, at the end of backward
    events.append("compute waited")
    return {"events": events, "shard": shard.tolist()}


def test_managed_all_reduce_is_waited_by_the_compute_stream_not_in_the_job(pool2):
    """[Note: managed replicate all-reduce]: the stream executor used to wait for it inside the
    all-reduce stream's job (its fence), which on CUDA blocked the host in every unit's backward."""
    for got in pool2.run(managed_all_reduce_order):
        assert got["events"] == ["job issued", "host waited", "compute waited"], got["events"]
        assert got["shard"] == [3.0] * 4
