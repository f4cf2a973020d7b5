"""``collectives.reduce_scatter`` on gloo: an all-to-all plus a local sum (see [Note: reduce-scatter
on gloo]) that must give what the native ``reduce_scatter_tensor`` gives and count as it did.

4 ranks; groups: the world (4), the pairs ``[0, 1]``/``[2, 3]`` and the strided pairs
``[0, 2]``/``[1, 3]`` (subgroups made with ``new_group``, as shard groups are). Each case compares
the library's result with the native call's on the same input:

- integer values (fp32 holding integers, and int64): equal exactly;
- random fp32: ``allclose`` with rtol 1e-6 (summation order only);
- bf16: summed in bf16 with one rounding per addition, in gloo's order, so from 4096 elements on at
  least 99% of the elements are the native ones bit for bit (an fp32 sum cast once to bf16 matches
  about two thirds); gloo orders tiny messages otherwise, so every size is held only to what a
  different order of S-1 bf16 additions allows: (S-1) * 2^-8 of the sum of |x| over ranks.
"""

from __future__ import annotations

import pytest
import torch

from hybridshard.runtime.comm import collectives as C
from hybridshard.runtime.trace import counters
from hybridshard.topology import groups as G
from tests.mp import RankPool

pytestmark = pytest.mark.multiprocess

WORLD = 4
GROUPS = ("world", "pairs", "strided")
KINDS = ("int_fp32", "int64", "fp32", "bf16")
NUMELS = (4, 4096, 65536 + 8)  # per rank's full input, divisible by 4 and 2


_GROUPS: dict = {}  # per rank process: made once, as new_group costs a rendezvous


def _groups():
    """This rank's groups by name (every rank makes every group, in the same order)."""
    import torch.distributed as dist

    if _GROUPS:
        return _GROUPS
    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    strided = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    _GROUPS.update(world=dist.group.WORLD, pairs=pairs[rank // 2], strided=strided[rank % 2])
    return _GROUPS


def _input(kind: str, numel: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "int_fp32":  # sums stay below 2^24: exact in fp32 in any order
        return torch.randint(-1000, 1000, (numel,), generator=g).float()
    if kind == "int64":
        return torch.randint(-(1 << 40), 1 << 40, (numel,), generator=g)
    values = torch.randn(numel, generator=g) * torch.logspace(-2, 2, numel)[torch.randperm(numel, generator=g)]
    return values.to(torch.bfloat16 if kind == "bf16" else torch.float32)


def compare_with_native() -> dict:
    """Every (group, kind, numel): the library's result against the native one, sync and async."""
    import torch.distributed as dist

    out = {}
    for gname, group in _groups().items():
        n = C.group_size(group)
        for kind in KINDS:
            for numel in NUMELS:
                full = _input(kind, numel, seed=dist.get_rank() * 1009 + numel)
                native = torch.empty(numel // n, dtype=full.dtype)
                C._REDUCE_SCATTER(native, full, group=group)
                mine = torch.empty_like(native)
                C.reduce_scatter(mine, full, group)
                later = torch.full_like(native, 7)
                handle = C.reduce_scatter(later, full, group, async_op=True)
                handle.wait()
                # consume=True: a middle rank moves the chunks of its (own) input instead of sending its own chunk
                spent, consumed = full.clone(), torch.empty_like(native)
                C.reduce_scatter(consumed, spent, group, consume=True)
                scale = full.abs().float().view(n, -1)[dist.get_rank(group)]
                gathered = torch.empty(n * scale.numel())
                C._ALL_GATHER(gathered, scale.contiguous(), group=group)
                magnitude = gathered.view(n, -1).sum(0)  # sum over ranks of |x| for this chunk
                out[(gname, kind, numel)] = {
                    "size": n,
                    "exact": torch.equal(mine, native),
                    "bitwise_fraction": (mine == native).float().mean().item(),
                    "close": torch.allclose(mine.float(), native.float(), rtol=1e-6, atol=1e-6),
                    "bf16_err": ((mine.float() - native.float()).abs() / magnitude.clamp_min(1e-30)).max().item(),
                    "async_equal": torch.equal(later, mine),
                    "consume_equal": torch.equal(consumed, mine),
                    "completed": handle.is_completed(),
                }
    return out


def count_one_call() -> dict:
    """Counters of one sync and one async reduce-scatter in each group, and the debug check."""
    from hybridshard.runtime.comm import agreement

    out = {}
    for gname, group in _groups().items():
        G.name_group(group, f"test-{gname}")
        n = C.group_size(group)
        full, shard = torch.ones(1024), torch.empty(1024 // n)
        stats = counters.CollectiveCounts()
        with counters.count_collectives() as counts:
            C.reduce_scatter(shard, full, group, stats=stats)
            C.reduce_scatter(shard, full, group, stats=stats, async_op=True).wait()
        agreement.set_debug(True)
        try:
            C.reduce_scatter(shard, full, group)  # the agreement check sees a reduce-scatter
        finally:
            agreement.set_debug(False)
        out[gname] = {
            "size": n,
            "name": G.group_name(group),
            "counts": [dict(c.calls) for c in (stats, counts)],
            "elements": [dict(c.elements) for c in (stats, counts)],
            "bytes": [dict(c.bytes) for c in (stats, counts)],
            "ring_bytes": [dict(c.ring_bytes) for c in (stats, counts)],
            "value": shard[0].item(),
        }
    return out


@pytest.fixture(scope="module")
def pool():
    with RankPool(WORLD, num_nodes=2, layout="block") as p:
        yield p


@pytest.fixture(scope="module")
def compared(pool):
    return pool.run(compare_with_native)


CASES = [(g, k, n) for g in GROUPS for k in KINDS for n in NUMELS]


@pytest.mark.parametrize("case", CASES, ids=[f"{g}-{k}-{n}" for g, k, n in CASES])
def test_reduce_scatter_equals_native(compared, case):
    _, kind, numel = case
    for rank, results in enumerate(compared):
        r = results[case]
        assert r["async_equal"] and r["completed"], f"rank {rank}: async result differs from sync"
        assert r["consume_equal"], f"rank {rank}: the consuming form's result differs"
        if kind in ("int_fp32", "int64"):
            assert r["exact"], f"rank {rank}: integer sums differ from native"
        elif kind == "fp32":
            assert r["close"], f"rank {rank}: fp32 sums differ from native beyond summation order"
        else:
            if numel >= 4096:
                assert r["bitwise_fraction"] >= 0.99, f"rank {rank}: {r['bitwise_fraction']:.3f} bitwise equal"
            bound = (r["size"] - 1) * 2.0**-8
            assert r["bf16_err"] <= bound, f"rank {rank}: bf16 error {r['bf16_err']:.2e} of sum |x| > {bound:.2e}"


def test_counts_are_those_of_a_reduce_scatter(pool):
    for rank, per_group in enumerate(pool.run(count_one_call)):
        for gname, r in per_group.items():
            n, key = r["size"], ("reduce_scatter", r["name"])
            assert r["value"] == n, f"rank {rank} {gname}: sum of ones over {n} ranks"
            for which in range(2):  # stats=, then count_collectives
                assert r["counts"][which] == {key: 2}, f"rank {rank} {gname}: {r['counts'][which]}"
                assert r["elements"][which] == {key: 2 * 1024}
                assert r["bytes"][which] == {key: 2 * 4096}
                assert r["ring_bytes"][which][key] == pytest.approx(2 * (n - 1) / n * 4096, rel=1e-12)


def test_other_devices_and_shapes_keep_the_native_call():
    # Decided before asking the process group anything, so no group is needed here.
    full = torch.empty(8)
    assert not C._sums_locally(torch.empty(2, device="meta"), torch.empty(8, device="meta"), None, 4)
    assert not C._sums_locally(torch.empty(2), full, None, 3)  # numel does not divide: native raises
    assert not C._sums_locally(torch.empty(2, dtype=torch.float64), full, None, 4)
    assert not C._sums_locally(torch.empty(2), torch.empty(16)[::2], None, 4)
    assert not C._sums_locally(torch.empty(2, dtype=torch.bool), torch.empty(8, dtype=torch.bool), None, 4)
