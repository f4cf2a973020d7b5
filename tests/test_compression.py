"""The compressed replicate all-reduce (see [Note: compressed replicate all-reduce]).

4 ranks; groups of 4 (the world) and of 2 (``[0, 1]``, ``[2, 3]``). Each rank's input has blocks of
very different magnitudes, so int8's per-block scales matter. Checked against the exact sum
(float64 of the all-gathered inputs), element by element, for one call with fresh residuals:

- bf16: ``|error| <= 2^-7 * sum_i |x_i|`` (plus fp32 summation slack);
- int8: ``|error| <= sum_i amax_i / 127``, ``amax_i`` rank i's largest ``|x|`` in the element's block.

Also: every rank ends with the same bits; the ring bytes counted are ``2 (R-1) P`` with ``P`` the
bytes of one quantized chunk (scales included); error feedback makes the mean of 50 calls on the
same input at least 20x closer to the exact sum than without it; group size 1 is a no-op; a
non-finite input poisons its block once and not the next call.
"""

from __future__ import annotations

import math
import threading

import pytest
import torch

from hybridshard.runtime.comm import collectives as C
from hybridshard.runtime.grads.compression import MODES, ReplicateCompressor, parse_compression
from hybridshard.runtime.trace import counters
from hybridshard.topology import groups as G
from tests.mp import RankPool

pytestmark = pytest.mark.multiprocess

WORLD = 4
BLOCK = 256
NUMELS = (3, 1001, 4 * BLOCK * 3)  # fewer than the ranks, not divisible, divisible into whole blocks
CASES = [(g, m, n) for g in ("world", "pairs") for m in MODES for n in NUMELS]


_GROUPS: dict = {}  # per rank process: made once, as new_group costs a rendezvous


def _groups() -> dict:
    """This rank's groups by name (every rank makes every group, in the same order)."""
    import torch.distributed as dist

    if _GROUPS:
        return _GROUPS
    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    singles = [dist.new_group([r]) for r in range(WORLD)]
    G.name_group(pairs[rank // 2], "pairs")
    _GROUPS.update(world=dist.group.WORLD, pairs=pairs[rank // 2], single=singles[rank])
    return _GROUPS


def _input(numel: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    magnitude = torch.logspace(-3, 1, 8)[torch.randint(0, 8, (-(-numel // 64),), generator=g)]
    return torch.randn(numel, generator=g) * magnitude.repeat_interleave(64)[:numel]


def _everyone(x: torch.Tensor, group) -> torch.Tensor:
    """(group size, numel): every rank's ``x``."""
    size = C.group_size(group)
    out = torch.empty(size * x.numel(), dtype=x.dtype)
    C._ALL_GATHER(out, x.contiguous(), group=group)
    return out.view(size, -1)


def _bound(mode: str, xs: torch.Tensor) -> torch.Tensor:
    """The Note's per-element error bound for inputs ``xs`` (ranks, numel)."""
    size, numel = xs.shape
    slack = size * 2.0**-23 * xs.abs().sum(0).double()  # fp32 sums of the dequantized parts
    if mode == "bf16":
        return 2.0**-7 * xs.abs().sum(0).double() + slack
    chunk = -(-numel // size)
    blocks = -(-chunk // BLOCK)
    padded = torch.zeros(size, size * chunk)
    padded[:, :numel] = xs
    per_block = torch.nn.functional.pad(padded.view(size, size, chunk), (0, blocks * BLOCK - chunk))
    amax = per_block.view(size, size, blocks, BLOCK).abs().amax(dim=3).sum(0)  # (chunks, blocks)
    bound = amax.repeat_interleave(BLOCK, dim=1)[:, :chunk].reshape(-1)[:numel].double() / 127
    return bound * (1 + 1e-5) + slack


def one_call() -> dict:
    """Each (group, mode, numel): one compressed all-reduce against the exact sum."""
    import torch.distributed as dist

    groups = _groups()
    out = {}
    for gname, mode, numel in CASES:
        group = groups[gname]
        x = _input(numel, seed=dist.get_rank() * 1013 + numel)
        xs = _everyone(x, group)
        exact = xs.double().sum(0)
        result, stats = x.clone(), counters.CollectiveCounts()
        ReplicateCompressor(mode, BLOCK).all_reduce(result, group, key=0, stats=stats)
        err = (result.double() - exact).abs()
        out[(gname, mode, numel)] = {
            "size": C.group_size(group),
            "worst": (err / _bound(mode, xs)).max().item(),
            "relative_norm": (err.norm() / exact.norm()).item(),
            "result": result,
            "ring_bytes": dict(stats.ring_bytes),
            "calls": dict(stats.calls),
        }
    return out


def feedback(mode: str, gname: str, calls: int = 50) -> dict:
    """Mean of ``calls`` compressed results on the same input, with and without error feedback."""
    import torch.distributed as dist

    group = _groups()[gname]
    x = _input(4 * BLOCK * 3, seed=dist.get_rank() + 5)
    exact = _everyone(x, group).double().sum(0)
    errors = {}
    for on in (True, False):
        compressor, total = ReplicateCompressor(mode, BLOCK, error_feedback=on), torch.zeros_like(exact)
        for _ in range(calls):
            result = x.clone()
            compressor.all_reduce(result, group, key="unit0")
            total += result.double()
        errors[on] = ((total / calls - exact).norm() / exact.norm()).item()
    return errors


def edge_cases() -> dict:
    """Group of one, a thread as caller, non-finite input, a key reused for another size."""
    import torch.distributed as dist

    groups = _groups()
    compressor = ReplicateCompressor("int8", BLOCK)
    x = _input(600, seed=dist.get_rank())
    alone = x.clone()
    with counters.count_collectives() as counts:
        compressor.all_reduce(alone, groups["single"], key=0)
    expected = x.clone()
    ReplicateCompressor("int8", BLOCK).all_reduce(expected, groups["world"], key=0)
    threaded = x.clone()
    caller = threading.Thread(target=compressor.all_reduce, args=(threaded, groups["world"]), kwargs={"key": 1})
    caller.start()
    caller.join()
    poisoned = x.clone()
    if dist.get_rank() == 1:
        poisoned[10] = float("inf")
    compressor.all_reduce(poisoned, groups["world"], key=2)
    after = x.clone()
    compressor.all_reduce(after, groups["world"], key=2)
    try:
        compressor.all_reduce(torch.zeros(601), groups["world"], key=2)
        reused = ""
    except ValueError as err:
        reused = str(err)
    compressor.reset()
    compressor.all_reduce(torch.zeros(601), groups["world"], key=2)  # fresh after reset
    return {
        "alone_unchanged": torch.equal(alone, x),
        "alone_calls": dict(counts.calls),
        "threaded_equal": torch.equal(threaded, expected),
        # 600 elements over 4 ranks: chunks of 150, each one int8 block; element 10 is in the first.
        "nonfinite_block": [torch.isnan(poisoned[:150]).all().item(), torch.isfinite(poisoned[150:]).all().item()],
        "finite_after": torch.isfinite(after).all().item(),
        "reused": reused,
    }


@pytest.fixture(scope="module")
def pool():
    with RankPool(WORLD, num_nodes=2, layout="block") as p:
        yield p


@pytest.fixture(scope="module")
def single_calls(pool):
    return pool.run(one_call)


@pytest.mark.parametrize("case", CASES, ids=[f"{g}-{m}-{n}" for g, m, n in CASES])
def test_within_bound_and_identical_on_every_rank(single_calls, case):
    gname, mode, numel = case
    for rank, results in enumerate(single_calls):
        r = results[case]
        assert r["worst"] <= 1.0, f"rank {rank}: error {r['worst']:.3f}x the bound"
        if numel >= 1000:  # typical size of the error, far inside the worst case
            assert r["relative_norm"] < (2.0**-8 if mode == "bf16" else 2e-2), r["relative_norm"]
    size = single_calls[0][case]["size"]
    for rank, results in enumerate(single_calls):
        peer = single_calls[rank - rank % size][case]["result"]  # first rank of this rank's group
        assert torch.equal(results[case]["result"], peer), f"rank {rank} differs from its group"


@pytest.mark.parametrize("case", CASES, ids=[f"{g}-{m}-{n}" for g, m, n in CASES])
def test_ring_bytes_are_those_of_the_quantized_chunks(single_calls, case):
    gname, mode, numel = case
    r = single_calls[0][case]
    size = r["size"]
    chunk = math.ceil(numel / size)
    per_chunk = 2 * chunk if mode == "bf16" else chunk + 4 * math.ceil(chunk / BLOCK)
    assert r["calls"] == {("all_to_all", gname): 1, ("all_gather", gname): 1}
    assert r["ring_bytes"][("all_to_all", gname)] == pytest.approx((size - 1) * per_chunk, rel=1e-12)
    assert r["ring_bytes"][("all_gather", gname)] == pytest.approx((size - 1) * per_chunk, rel=1e-12)
    if numel % (size * BLOCK) == 0:
        fp32 = 2 * (size - 1) / size * numel * 4
        expected = 0.5 if mode == "bf16" else (1 + 4 / BLOCK) / 4
        assert sum(r["ring_bytes"].values()) / fp32 == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("mode", MODES)
def test_error_feedback_converges_to_the_exact_sum(pool, mode):
    for gname in ("world", "pairs"):
        for rank, errors in enumerate(pool.run(feedback, mode, gname)):
            assert errors[False] > 0, "quantization lost nothing: the test input is too easy"
            assert errors[True] * 20 <= errors[False], f"rank {rank} {gname}: {errors}"


def test_edge_cases(pool):
    for rank, r in enumerate(pool.run(edge_cases)):
        assert r["alone_unchanged"] and r["alone_calls"] == {}, "a group of one communicates nothing"
        assert r["threaded_equal"], "a call from another thread gives the same result"
        assert r["nonfinite_block"] == [True, True], "an inf makes its own block NaN, and only that block"
        assert r["finite_after"], "the next call is finite again"
        assert "key 2 holds error feedback for 600 elements" in r["reused"]


def test_parse_compression():
    assert parse_compression(None) is None
    assert parse_compression("none") is None
    assert [parse_compression(m) for m in MODES] == ["bf16", "int8"]
    for bad in ("fp8", "INT8", "", 8):
        with pytest.raises(ValueError, match=r"one of None, 'none', 'bf16', 'int8'; got"):
            parse_compression(bad)


def test_bad_arguments():
    with pytest.raises(ValueError, match="needs a compression"):
        ReplicateCompressor("none")
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        ReplicateCompressor("int8", block_size=0)
    with pytest.raises(ValueError, match="1-D fp32, bf16 or fp16 tensor; got 2-D"):
        ReplicateCompressor("bf16").all_reduce(torch.zeros(2, 2), None, key=0)
    with pytest.raises(ValueError, match="got 1-D torch.int64"):
        ReplicateCompressor("bf16").all_reduce(torch.zeros(4, dtype=torch.int64), None, key=0)
