"""The emulated device (hybridshard/runtime/comm/executors/emulate.py): its rules on their own, in one process, and
the defects it exists to catch, on gloo ranks.

The multi-process checks use 4 ranks on 2 simulated nodes (shard groups of 2) and 2 ranks on 2 nodes
(shard groups of one), one pool each for the module.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests import runtime_models as RM
from tests.mp import RankPool


@pytest.fixture(autouse=True)
def no_wrappers_after():
    """The in-process tests install the sync counters' wrappers; later test modules run without them."""
    yield
    from hybridshard.runtime.trace import host_syncs

    host_syncs.uninstall()


@pytest.fixture
def device():
    from hybridshard.runtime.comm.executors.emulate import EmulatedStreams
    from hybridshard.runtime.trace.position import where

    streams = EmulatedStreams(torch.device("cpu"))
    streams.unit_names = ["<root>", "blocks.0"]
    unit, phase = where.unit, where.phase
    where.unit, where.phase = 1, "backward"
    yield streams
    where.unit, where.phase = unit, phase


def test_side_stream_work_runs_only_when_waited_for(device):
    buf = torch.ones(4)
    with device.side(device.all_reduce):
        out = buf.mul_(3)
        doubled = buf * 2  # a new tensor: allocated now, filled when the stream runs
        fence = device.fence(device.all_reduce, None)
    assert out is buf and torch.equal(buf, torch.ones(4)), "the in-place op ran on the host"
    assert device.pending() == 2
    fence.wait()  # the compute stream (the host) waits: the stream runs up to the event
    assert torch.equal(buf, torch.full((4,), 3.0)) and torch.equal(doubled, torch.full((4,), 6.0))
    assert device.pending() == 0
    assert device.waits == [("all_reduce", "compute", 1, "backward")]


def test_a_dropped_buffer_is_caught_naming_unit_buffer_and_stream(device):
    from hybridshard.runtime.comm.executors import emulate

    buf = torch.ones(64)
    emulate.label(buf, "blocks.0: gradient shard")
    with device.side(device.all_reduce):
        buf.mul_(2)
        fence = device.fence(device.all_reduce, None)
    del buf  # the runtime's last reference, before the compute stream waited on the stream
    with pytest.raises(emulate.DeviceFault, match=r"^emulated device: mul_\.Tensor queued on the all_reduce stream "
                       r"\(unit 'blocks\.0', backward\) touches buffer 'blocks\.0: gradient shard' \(torch\.float32, "
                       r"256 bytes, storage 0x[0-9a-f]+, allocated on the compute stream\) after the runtime dropped "
                       r"its last reference to it; keep that buffer referenced"):
        fence.wait()


def test_a_view_keeps_its_buffer_and_a_freed_storage_is_caught(device):
    from hybridshard.runtime.comm.executors.emulate import DeviceFault

    base = torch.ones(8)
    view = base[2:6]
    with device.side(device.reduce_scatter):
        view.add_(1)
        first = device.fence(device.reduce_scatter, None)
    del base  # the view still holds the storage: nothing was released
    first.wait()
    assert view.tolist() == [2.0] * 4
    with device.side(device.reduce_scatter):
        view.add_(1)
        second = device.fence(device.reduce_scatter, None)
    view.untyped_storage().resize_(0)  # freed the way the runtime frees a gathered buffer
    with pytest.raises(DeviceFault, match="after its storage was freed"):
        second.wait()


def test_a_temporary_of_the_same_stream_may_go(device):
    with device.side(device.all_gather):
        tmp = torch.empty(16)  # allocated on the all_gather stream
        tmp.fill_(1)
        kept = tmp + 1
        fence = device.fence(device.all_gather, None)
    del tmp  # reused only in the all_gather stream's order: safe
    fence.wait()
    assert kept.tolist() == [2.0] * 16


def test_a_side_stream_waits_for_another_one_in_stream_order(device):
    x = torch.zeros(4)
    with device.side(device.reduce_scatter):
        x.add_(1)
        scattered = device.fence(device.reduce_scatter, None)
    with device.side(device.all_reduce, after=scattered, follow_compute=False):
        x.mul_(5)  # must see the reduce-scatter stream's add first
        done = device.fence(device.all_reduce, None)
    assert x.tolist() == [0.0] * 4 and device.pending() == 3  # the add, the marker, the mul
    done.wait()
    assert x.tolist() == [5.0] * 4
    assert ("reduce_scatter", "all_reduce", 1, "backward") in device.waits


def test_end_of_step_runs_what_is_queued(device):
    x = torch.zeros(2)
    with device.side(device.all_reduce):
        x.add_(7)
    device.end_step()
    assert x.tolist() == [7.0, 7.0] and device.pending() == 0


# -- on gloo ranks ---------------------------------------------------------------------------------

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


# -- host syncs -------------------------------------------------------------------------------------

def test_host_syncs_are_counted_per_step_phase_and_site_from_the_runtimes_code_only():
    from hybridshard.runtime.trace import host_syncs
    from hybridshard.runtime.trace.position import where

    counts = host_syncs.install()
    counts.reset()
    code = compile("def hot(t):\n    t.item(); t.tolist(); bool(t)\n    return torch.tensor([1], device='cpu')\n",
                   "fake", "exec")
    scope = {"__name__": "hybridshard.runtime.fake", "torch": torch}
    exec(code, scope)
    exempt = {"__name__": "hybridshard.runtime.optim.grad_norm"}
    exec(compile("def clip(t):\n    return t.item()\n", "fake", "exec"), exempt)
    step, phase = where.step, where.phase
    where.phase = "backward"
    try:
        scope["hot"](torch.ones(1))
        exempt["clip"](torch.ones(1))
        torch.ones(1).item()  # this module is not the runtime: not counted
        host = host_syncs.mark_host(torch.ones(1))
        exec(compile("def read(t):\n    return t.tolist()\n", "fake", "exec"), scope)
        scope["read"](host)  # host memory: no sync
    finally:
        where.phase = phase
    assert counts.hot == {
        (step, "backward", "item in hybridshard.runtime.fake.hot"): 1,
        (step, "backward", "tolist in hybridshard.runtime.fake.hot"): 1,
        (step, "backward", "__bool__ in hybridshard.runtime.fake.hot"): 1,
        (step, "backward", "torch.tensor(host data, device=) in hybridshard.runtime.fake.hot"): 1,
    }, counts.hot
    assert counts.exempt == {(step, "backward", "clip_grad_norm_"): 1}


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


def test_fault_tolerance_waits_for_the_quorum_when_the_forward_ends():
    """Manager.allreduce waits for the step's quorum; the forward hook waits first, once per step."""
    from hybridshard.ft.replicate import ManagedReplicate

    calls = []

    class Manager:  # the one method of torchft's Manager this reads
        def wait_quorum(self):
            calls.append("wait_quorum")

    hook = ManagedReplicate(Manager())
    model = torch.nn.Linear(2, 2)
    model.register_forward_hook(hook.quorum_ready)
    model(torch.ones(2))
    assert calls == []  # no quorum started: nothing to wait for
    hook.quorum_started = True
    model(torch.ones(2))
    model(torch.ones(2))  # a second micro-batch of the step
    assert calls == ["wait_quorum"]


class _Manager:
    """What ``ManagedReplicate`` reads of torchft's Manager; its all-reduce halves the shard (two
    groups holding the same values), and notes what it saw when it ran."""

    def __init__(self) -> None:
        self.seen: list = []

    def wait_quorum(self) -> None:
        pass

    @torch.profiler.record_function("torchft::manager::num_participants")  # torchft's: a dispatched op, no tensor
    def num_participants(self) -> int:
        return 2

    def allreduce(self, tensor: torch.Tensor) -> object:
        self.seen.append(tensor.tolist())
        tensor.div_(2)
        seen = self.seen

        class Work:  # gloo's: wait() blocks the host
            def wait(self) -> bool:
                seen.append("waited")
                return True
        return Work()


def test_managed_all_reduce_runs_when_the_host_waits_for_it(device):
    """Queued on the all-reduce stream like an NCCL collective, not run at issue (torchft's profiler
    ranges once made the emulator run the stream there): it runs when the compute stream waits on its
    fence at the end of backward, after what the stream queued before it, and that wait is counted as
    the exempt ``torchft all-reduce wait``."""
    from hybridshard.ft.replicate import ManagedReplicate
    from hybridshard.runtime.trace import host_syncs

    manager = _Manager()
    hook = ManagedReplicate(manager)
    shard = torch.ones(4)
    counts = host_syncs.counts()
    counts.reset()
    with device.side(device.all_reduce):
        shard.mul_(3)
        done = device.fence(device.all_reduce, hook.all_reduce(shard, async_op=True))
    assert manager.seen == [] and device.pending() == 2 and shard.tolist() == [1.0] * 4
    done.wait()
    assert manager.seen == [[3.0] * 4, "waited"] and shard.tolist() == [1.5] * 4
    assert counts.hot == {} and [site for _, _, site in counts.exempt] == ["torchft all-reduce wait"], counts.exempt


def test_a_shard_dropped_before_the_managed_all_reduce_ran_is_caught(device):
    """torchft may run its all-reduce on NCCL too: the shard must stay the runtime's until it ran."""
    from hybridshard.ft.replicate import ManagedReplicate
    from hybridshard.runtime.comm.executors.emulate import DeviceFault

    hook = ManagedReplicate(_Manager())
    shard = torch.ones(4)
    with device.side(device.all_reduce):
        done = device.fence(device.all_reduce, hook.all_reduce(shard, async_op=True))
    del shard
    with pytest.raises(DeviceFault, match=r"^emulated device: all_reduce on torchft's replica groups queued on the "
                       r"all_reduce stream \(unit 'blocks\.0', backward\) touches a buffer .* after the runtime "
                       r"dropped its last reference to it"):
        done.wait()
