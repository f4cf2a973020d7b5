"""The emulated device's rules on their own, in one process (hybridshard/runtime/comm/executors/emulate.py,
hybridshard/runtime/trace/host_syncs.py): stream order, buffer lifetimes, host-sync counting and torchft's
managed all-reduce on the emulated streams. tests/test_emulator.py runs the runtime on it over gloo ranks.
"""

from __future__ import annotations

import pytest
import torch


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
