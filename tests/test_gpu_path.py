"""The GPU path's rules, checked on CPU: the stream executor's issue order, fp16 gradients and the
sharded grad scaler.

The stream executor (see [Note: stream executor] in hybridshard/runtime/comm/executors/streams.py) runs here with
its streams as no-ops. Across a matrix of strategies, prefetch depths, overlap, compression,
activation checkpointing, no_sync and mixed precision, every rank must issue the collectives of
each communicator from one thread per phase, in the same order on every rank, and the whole
interleaved order must be the same everywhere (what NCCL needs); results must be bitwise those of
the thread executor and match the single-process reference.

4 ranks on 2 simulated nodes, one pool for the module. ``FaultTolerance``, whose replica groups are
separate jobs, is in tests/test_gpu_path_ft.py.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests import runtime_models as RM
from tests.mp import RankPool

pytestmark = pytest.mark.multiprocess

WORLD = 4
_S = RM.Config(steps=2)
MATRIX = [
    *(replace(_S, strategy=s) for s in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")),
    *(replace(_S, prefetch=p, overlap_grads=o) for p in (0, 2) for o in (False, True)),
    replace(_S, strategy="FULL_SHARD", prefetch=0, overlap_grads=False),
    replace(_S, strategy="NO_SHARD", prefetch=2, overlap_grads=False),
    replace(_S, compression="int8"),
    replace(_S, strategy="HYBRID_SHARD_ZERO2", compression="bf16", prefetch=2),
    replace(_S, checkpoint=True),
    replace(_S, strategy="FULL_SHARD", checkpoint="reentrant", prefetch=2),
    replace(_S, micro_steps=2),
    replace(_S, strategy="HYBRID_SHARD_ZERO2", micro_steps=2, reduce_scatter_micro=True),
    replace(_S, strategy="SHARD_GRAD_OP", micro_steps=2, reduce_scatter_micro=True, checkpoint=True),
    replace(_S, bf16=True),
    replace(_S, block_strategies=("FULL_SHARD", "HYBRID_SHARD", "NO_SHARD")),
    replace(_S, offload=True),
    replace(_S, bf16=True, offload=True),
    replace(_S, shard_optimizer=True),
    replace(_S, shard_optimizer=True, compression="int8", prefetch=2),
]
EXECUTORS = ("threads", "streams", "emulate")
"""``emulate``: the stream executor on the emulated device (hybridshard/runtime/comm/executors/emulate.py), which must
give the streams executor's results bit for bit, with no host sync from the second step on."""


def _label(c: RM.Config) -> str:
    parts = [c.strategy, f"p{c.prefetch}", "overlap" if c.overlap_grads else "sync"]
    parts += [f"micro{c.micro_steps}{'rs' if c.reduce_scatter_micro else ''}"] if c.micro_steps > 1 else []
    parts += [f"ckpt-{c.checkpoint}"] if c.checkpoint else []
    parts += [c.compression] if c.compression else []
    parts += ["bf16"] if c.bf16 else []
    parts += ["mixed-" + "-".join(c.block_strategies)] if c.block_strategies else []
    parts += ["offload"] if c.offload else []
    parts += ["sliced"] if c.shard_optimizer else []
    return "-".join(parts)


def run_recorded(configs: list[RM.Config]) -> list[dict]:
    """Each config under the issue-order recorder; results, the order and the issuing threads."""
    from hybridshard import record_issue_order
    from hybridshard.runtime.units import offload

    taken = []
    take = offload.Staged.take
    offload.Staged.take = lambda self, *a: taken.append(1) or take(self, *a)  # counts staged inputs used
    out = []
    for cfg in configs:
        taken.clear()
        with record_issue_order() as log:
            got = RM.sharded_run(cfg)
        got["staged"] = len(taken)
        got["order"] = log.signatures()
        got["per_group"] = {g: [i.signature for i in issues] for g, issues in log.by_group().items()}
        got["threads"] = {f"{g}/{p}": sorted(t) for (g, p), t in log.threads_per_phase().items()}
        out.append(got)
    return out


@pytest.fixture(scope="module")
def pool():
    with RankPool(WORLD, num_nodes=2, layout="block", timeout=240) as pool:
        yield pool


@pytest.fixture(scope="module")
def sweep(pool):
    configs = [replace(c, executor=e) for c in MATRIX for e in EXECUTORS]
    results = pool.run(run_recorded, configs)
    return {(c.executor, i): [r[k] for r in results] for k, c in enumerate(configs) for i in [k // len(EXECUTORS)]}


@pytest.mark.parametrize("index", range(len(MATRIX)), ids=[_label(c) for c in MATRIX])
def test_stream_executor_issue_order_and_results(sweep, index):
    streams, threads, emulated = sweep[("streams", index)], sweep[("threads", index)], sweep[("emulate", index)]
    # The emulated device: the same collectives in the same order, the same bits, no steady-state sync.
    for rank, (a, b) in enumerate(zip(emulated, streams)):
        assert a["order"] == b["order"], f"rank {rank}: the emulated device changed the issue order"
        assert a["losses"] == b["losses"] and a["counts"] == b["counts"], (rank, a["losses"], b["losses"])
        for key, value in b["state"].items():
            assert torch.equal(a["state"][key], value), f"rank {rank}: {key} differs under the emulator"
        assert a["host_syncs"]["hot"] == {}, (rank, a["host_syncs"]["hot"])
        exempt = a["host_syncs"]["exempt"]
        if MATRIX[index].offload:  # the one event sync before the CPU optimizer (see [Note: CPU offload])
            exempt = {k: v for k, v in exempt.items() if k[2] != "CPU offload: gradients arrived" or v != 1}
        assert not exempt, (rank, a["host_syncs"]["exempt"])
    # One thread issues everything (on CPU, backward hooks run on the thread that called backward).
    for rank, got in enumerate(streams + emulated):
        issuers = {t for ts in got["threads"].values() for t in ts}
        assert issuers == {"MainThread"}, (rank, got["threads"])
    # The whole interleaved order, and so each communicator's, is the same on every rank.
    first = streams[0]["order"]
    assert len(first) > 10
    for rank, got in enumerate(streams):
        assert got["order"] == first, f"rank {rank} issued another order than rank 0"
    # The thread executor: each communicator still has one issuing thread per phase and one order.
    for rank, got in enumerate(threads):
        assert all(len(ts) == 1 for ts in got["threads"].values()), (rank, got["threads"])
        assert got["per_group"] == threads[0]["per_group"], rank
    for rank in range(WORLD):
        a, b = streams[rank], threads[rank]
        # The same collectives; on a node's hop group the thread executor issues a gather's hops inside
        # the node when the unit waits, later than the streams do ([Note: a deferred inner hop]).
        assert a["per_group"].keys() == b["per_group"].keys(), rank
        for group, issues in a["per_group"].items():
            if group.endswith("_node"):
                assert sorted(issues) == sorted(b["per_group"][group]), f"rank {rank}: {group} differs"
            else:
                assert issues == b["per_group"][group], f"rank {rank}: the executors issued different collectives on {group}"
        assert a["losses"] == b["losses"], (rank, a["losses"], b["losses"])
        for key, value in b["state"].items():
            assert torch.equal(a["state"][key], value), f"rank {rank}: {key} differs between executors"
        assert a["counts"] == b["counts"]
    cfg = MATRIX[index]
    if cfg.compression is None:
        tol = dict(atol=2e-3, rtol=2e-3) if cfg.bf16 else dict(atol=1e-5, rtol=1e-5)
        RM.compare(RM.reference_run(cfg, WORLD), streams[0], label=_label(cfg), **tol)


@pytest.mark.parametrize("index", [i for i, c in enumerate(MATRIX) if c.offload], ids=lambda i: _label(MATRIX[i]))
def test_cpu_offload_is_a_no_op_on_cpu(sweep, index):
    """On a CPU device the master already lives in CPU memory: bitwise the run without offload, with
    the gathers' inputs staged ahead all the same (see [Note: CPU offload])."""
    plain = MATRIX.index(replace(MATRIX[index], offload=False))
    for executor in EXECUTORS:
        for a, b in zip(sweep[(executor, index)], sweep[(executor, plain)]):
            assert a["staged"] > 0 and b["staged"] == 0, (a["staged"], b["staged"])
            assert a["losses"] == b["losses"] and a["counts"] == b["counts"]
            assert all(torch.equal(a["state"][k], v) for k, v in b["state"].items())


def watch_stream_jobs(num_blocks: int = 4) -> dict:
    """Stream executor, HYBRID_SHARD: at each post-backward hook, how many earlier jobs still hold their
    unsharded gradient, and the jobs' states after the backward."""
    import hybridshard as hs
    from hybridshard.runtime.comm.executors.base import JobState

    model = RM.make_model(num_blocks=num_blocks)
    hs.shard(model, strategy="HYBRID_SHARD", groups=RM.groups(), wrap={RM.Block}, executor="streams")
    runtime = model.hybridshard_runtime
    jobs_seen, holding = [], []
    for unit in runtime.units:
        original = unit._post_backward

        def post(leaf, original=original):
            holding.append(sum(job.full is not None for job in runtime.executor._jobs))
            original(leaf)
            jobs_seen.extend(j for j in runtime.executor._jobs if j not in jobs_seen)
        unit.flat.unsharded._post_accumulate_grad_hooks.clear()
        unit.flat.unsharded.register_post_accumulate_grad_hook(post)
    tokens = RM.batch(0, 0, 0, 2)
    RM.lm_loss(model(tokens), tokens).backward()
    return {"holding": holding, "states": [j.state is JobState.REDUCED and j.full is None for j in jobs_seen],
            "left": len(runtime.executor._jobs), "kind": runtime.executor.kind}


def test_stream_executor_keeps_at_most_two_unsharded_gradients(pool):
    """Before each post-backward hook at most one earlier gradient is still held (the one whose
    reduce-scatter the compute stream has not waited for yet); after backward every job is done."""
    for got in pool.run(watch_stream_jobs):
        assert got["kind"] == "streams"
        assert len(got["holding"]) == 5 and max(got["holding"]) == 1 and got["holding"][0] == 0, got["holding"]
        assert got["states"] == [True] * 5 and got["left"] == 0, got


def test_thread_executor_reduces_on_its_thread(sweep):
    """The contrast the stream executor removes: the replicate all-reduces of a hybrid backward come
    from the communication thread, the other collectives from the main thread."""
    index = MATRIX.index(replace(_S, strategy="HYBRID_SHARD"))
    for got in sweep[("threads", index)]:
        assert got["threads"]["replicate/backward"] == ["hybridshard-comm"], got["threads"]
        assert got["threads"]["shard/backward"] == ["MainThread"], got["threads"]


# -- fp16: the division split around the sum, and a scaler every rank obeys -------------------------

def test_divide_factors_split_the_world_size():
    from hybridshard.runtime.grads.reduce import divide_factors

    for world in range(1, 65):
        assert divide_factors(world, torch.float32) == (1, world)
        assert divide_factors(world, torch.bfloat16) == (1, world)
        pre, post = divide_factors(world, torch.float16)
        assert pre * post == world and pre & (pre - 1) == 0, (world, pre, post)
        assert pre * pre <= world < 4 * pre * pre, (world, pre)


def test_divide_is_the_division_bit_for_bit():
    """The gradient scaling multiplies by a power of two's reciprocal instead of dividing: the same bits,
    for every dtype the gradients take, subnormals, extremes and specials included."""
    from hybridshard.runtime.grads.reduce import divide_

    g = torch.Generator().manual_seed(0)
    values = torch.cat([torch.randn(4096, generator=g) * torch.logspace(-44, 38, 4096),
                        torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1.2e-38, 3.4e38, float("inf"), float("-inf")])])
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        x = values.to(dtype)
        for factor in (2, 4, 8, 16, 64, 3, 6, 12, 2.5):
            expected = x / factor
            got = divide_(x.clone(), factor)
            assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8)), (dtype, factor)


FP16 = [replace(_S, strategy=s, bf16=True, fp16=True, steps=3, executor=e)
        for s in ("FULL_SHARD", "HYBRID_SHARD", "NO_SHARD") for e in EXECUTORS]
FP16 += [replace(_S, strategy="HYBRID_SHARD_ZERO2", bf16=True, fp16=True, steps=3, executor=e, micro_steps=2,
                 reduce_scatter_micro=True, clip=1.0) for e in ("streams", "emulate")]


@pytest.fixture(scope="module")
def fp16_sweep(pool):
    return pool.run(RM.run_configs, FP16)


@pytest.mark.parametrize("index", range(len(FP16)), ids=[f"{_label(c)}-{c.executor}" for c in FP16])
def test_fp16_with_sharded_scaler_matches_reference(fp16_sweep, index):
    cfg = FP16[index]
    ref = RM.reference_run(cfg, WORLD)
    for rank, results in enumerate(fp16_sweep):
        RM.compare(ref, results[index], label=f"rank {rank}", atol=2e-3, rtol=2e-3)
        assert results[index]["losses"] == fp16_sweep[0][index]["losses"]
    if cfg.executor == "emulate":  # bit for bit the streams executor; only GradScaler.step's own sync
        twin = FP16.index(replace(cfg, executor="streams"))
        for results in fp16_sweep:
            a, b = results[index], results[twin]
            assert a["losses"] == b["losses"] and a["norms"] == b["norms"]
            assert all(torch.equal(a["state"][k], v) for k, v in b["state"].items())
            assert a["host_syncs"]["hot"] == {}, a["host_syncs"]["hot"]
            assert {site for _, _, site in a["host_syncs"]["exempt"]} == {"GradScaler.step found_inf"}


class Scaled(torch.nn.Module):
    """loss = sum(w * x): the gradient of w is x, here close to fp16's largest value."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.w * x).sum()


def fp16_gradient(strategy: str, executor: str, value: float) -> list[float]:
    import hybridshard as hs

    model = Scaled()
    mp = hs.MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float16, keep_low_precision_grads=True)
    hs.shard(model, strategy=strategy, groups=RM.groups(), mixed_precision=mp, executor=executor)
    model(torch.full((64,), value, dtype=torch.float16)).backward()
    return model.w.grad.float().tolist()


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "HYBRID_SHARD"])
def test_fp16_average_of_large_gradients_does_not_overflow(pool, strategy):
    """Every rank's gradient is 30000: the sum over 4 ranks (120000) is past fp16's 65504, the mean is not."""
    assert torch.isinf(torch.tensor(30000.0, dtype=torch.float16) * WORLD)
    for executor in EXECUTORS:
        for rank, grad in enumerate(pool.run(fp16_gradient, strategy, executor, 30000.0)):
            assert grad and all(g == 30000.0 for g in grad), (executor, rank, grad[:4])


def skip_on_one_rank(sharded_scaler: bool) -> dict:
    """One step in which only rank 1's gradient shard holds an inf."""
    import torch.distributed as dist

    import hybridshard as hs

    model = RM.make_model()
    hs.shard(model, strategy="HYBRID_SHARD", groups=RM.groups(), wrap={RM.Block}, executor="streams")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = hs.ShardedGradScaler("cpu", init_scale=256.0) if sharded_scaler else torch.amp.GradScaler("cpu", init_scale=256.0)
    before = {k: v.clone() for k, v in hs.full_state_dict(model).items()}
    tokens = RM.batch(0, 0, dist.get_rank(), 2)
    scaler.scale(RM.lm_loss(model(tokens), tokens)).backward()
    if dist.get_rank() == 1:
        next(p for p in model.parameters() if p.grad is not None and p.grad.numel()).grad[0] = float("inf")
    scaler.step(opt)
    scaler.update()
    after = hs.full_state_dict(model)
    return {"scale": scaler.get_scale(), "unchanged": all(torch.equal(after[k], v) for k, v in before.items())}


def test_sharded_scaler_skips_on_every_rank_together(pool):
    got = pool.run(skip_on_one_rank, True)
    assert [g["scale"] for g in got] == [128.0] * WORLD, got
    assert all(g["unchanged"] for g in got), got
    # torch's own scaler sees the inf on rank 1 only: that rank skips, the others step.
    plain = pool.run(skip_on_one_rank, False)
    assert [g["scale"] for g in plain] == [256.0, 128.0, 256.0, 256.0], plain


# -- choices and their errors ------------------------------------------------------------------------

def test_executor_choice(monkeypatch):
    from hybridshard.runtime.comm.executors.select import ENV, ExecutorKind, resolve_executor

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    monkeypatch.delenv(ENV, raising=False)
    assert resolve_executor(None, cpu) is ExecutorKind.THREADS
    assert resolve_executor(None, cuda) is ExecutorKind.STREAMS
    assert resolve_executor("Streams", cpu) is ExecutorKind.STREAMS
    monkeypatch.setenv(ENV, "streams")
    assert resolve_executor(None, cpu) is ExecutorKind.STREAMS
    assert resolve_executor("threads", cpu) is ExecutorKind.THREADS  # the argument wins
    monkeypatch.setenv(ENV, "fibers")
    with pytest.raises(ValueError, match=r"^HYBRIDSHARD_EXECUTOR must be one of 'auto', 'threads', 'streams', 'emulate'; "
                       r"got 'fibers'"):
        resolve_executor(None, cpu)
    monkeypatch.setenv(ENV, "emulate")
    assert resolve_executor(None, cpu) is ExecutorKind.EMULATE
    with pytest.raises(ValueError, match=r"^HYBRIDSHARD_EXECUTOR='emulate' emulates a GPU with CPU tensors, but the model "
                       r"is on cuda:0; use"):
        resolve_executor(None, cuda)
    with pytest.raises(ValueError, match=r"^executor='threads' runs on CPU tensors only, but the model is on cuda:0; use"):
        resolve_executor("threads", cuda)


def test_a_staged_input_is_used_only_while_the_master_is_unchanged():
    from hybridshard.runtime.units.offload import stage

    master = torch.arange(4.0)
    staged = stage(lambda: master.to(torch.bfloat16), (master._version,), None)
    assert staged.take((master._version,), master.device) is staged.tensor
    master.add_(1)  # an optimizer step after it was staged
    assert staged.take((master._version,), master.device) is None


def test_offload_and_scaler_arguments():
    import hybridshard as hs
    from hybridshard.runtime.units.offload import parse_offload

    assert parse_offload(None) is None and parse_offload(False) is None
    assert parse_offload(True) == hs.CPUOffload() and hs.CPUOffload().pin_memory
    with pytest.raises(ValueError, match=r"^offload must be a hybridshard.CPUOffload, True, False or None; got 'cpu'"):
        parse_offload("cpu")
    with pytest.raises(ValueError, match=r"^CPUOffload.pin_memory must be True or False; got 1"):
        hs.CPUOffload(pin_memory=1)
    with pytest.raises(ValueError, match=r"^ShardedGradScaler device must be 'cuda' or 'cpu'"):
        hs.ShardedGradScaler("mps")
