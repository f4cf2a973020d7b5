"""Peak per-rank memory of one training step against the planner's formula, for every strategy.

Counted as in [Note: counting live tensor bytes] (tests/live_bytes.py), per rank, on 4 gloo ranks /
2 simulated nodes, over one step (forward, backward, AdamW step) after a warm-up step:

* every storage an op allocates on the main thread (the dispatch mode);
* the unsharded buffers, which ``FlatParam.alloc_storage``/``free_storage`` grow and shrink with
  ``untyped_storage().resize_()`` outside any op: both are wrapped here and enter the same timeline;
* the communication thread (``hybridshard-comm``, see hybridshard/runtime/comm/executors/threads.py), which the mode
  entered on the main thread does not see: every job it runs is wrapped in a mode of its own, and
  the test asserts that it allocated nothing (it scales in place);
* what exists before the step (master shards, AdamW state, buffers still gathered), added as a
  constant: the step starts after ``zero_grad(set_to_none=True)``, so no gradient exists yet.

The model is wide MLP blocks on a batch of 2 x 4 tokens, so parameters, gradients and optimizer
state dominate; its activations are measured in one plain process, counted the same way, and
added to the formula as a separate term (``ACTIVATIONS``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from hybridshard.estimates.sizing import ModelSpec, memory
from hybridshard.runtime.units.strategy import ShardingStrategy
from tests import runtime_models as RM
from tests.live_bytes import LiveTensorBytes, _key
from tests.mp import RankPool

pytestmark = pytest.mark.multiprocess

WORLD = 4
DIM, HIDDEN, BLOCKS, BATCH, SEQ = 128, 512, 4, 2, 4
STRATEGIES = [s.name for s in ShardingStrategy]
SETTINGS = [(1, True), (1, False), (0, False)]  # (prefetch, overlap_grads)
CASES = [(s, p, o) for s in STRATEGIES for p, o in SETTINGS]
# [Note: per-rank excursions]
# Without overlap, the median rank of every case is at 0.93-0.99x of the formula (6 runs). In some
# runs a single rank of a case peaks higher: 1.07x and 1.09x in 6 runs (FULL_SHARD and SHARD_GRAD_OP,
# prefetch 1), 1.16x once in an earlier version of the formula; the cause was not found. So the
# median rank is held to 10 % and every rank to 25 %.
# [Note: the gradient in flight]
# With ``overlap_grads`` the formula counts the previous unit's gradient as alive until its
# reduce-scatter is done, on the communication thread. Whether it still is at the next unit's peak
# is a race: the thread drops it as soon as it is scattered, and on 2 cores it often wins. In 6 runs
# a rank of HYBRID_SHARD peaked at 0.90x-0.98x of the formula, FULL_SHARD at 0.86x-1.06x (two of
# four HYBRID_SHARD ranks at 0.899x in one CI run). The planner keeps the upper bound, so an
# overlapped case is held between the formula without that gradient (the race won) and the formula
# with it (the race lost).
ASSERTED = list(range(len(CASES)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(DIM, HIDDEN), nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


class WideMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.norm = nn.LayerNorm(DIM)  # the root unit's own parameters

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


def _inputs(seed: int) -> torch.Tensor:
    return torch.randn(BATCH, SEQ, DIM, generator=torch.Generator().manual_seed(seed))


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).mean()


class StepBytes(LiveTensorBytes):
    """:class:`LiveTensorBytes` with autograd's gradient accumulation counted as it runs unobserved.

    Autograd adds a second gradient for one tensor into the first *in place* when nothing else
    holds the first (``InputBuffer::accumulate``); under any Python dispatch mode the tensor's
    Python object counts as a holder, so the engine adds out of place and three buffers are alive
    where two would be. A tensor used twice gets two gradients (here, in the blocks' residual path;
    a flat leaf whose views were slices, ``slice_backward``, got one per parameter before its views
    came from one split): an ``add.Tensor`` outside grad mode whose first input is such an
    accumulation buffer of the output's size is counted as reusing it.
    """

    _ACCUMULATORS = ("aten.slice_backward.default", "aten.add.Tensor")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - the mode protocol
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if str(func) == "aten.add.Tensor" and not torch.is_grad_enabled() and isinstance(args[0], torch.Tensor):
            old = self._ids.get(_key(args[0]))
            new = self._ids.get(_key(out))
            if (old is not None and new is not None and new != old and self.labels.get(old) in self._ACCUMULATORS
                    and self.sizes[old] == self.sizes[new] and old not in self._gone):
                at = max(i for i, e in enumerate(self.events) if e == (new, self.sizes[new]))
                self.events.insert(at, (old, -self.sizes[old]))  # freed before the result, as in place
                self._gone.add(old)
        return out

    def __init__(self) -> None:
        super().__init__()
        self._gone: set[int] = set()

    def _release(self, sid: int, key) -> None:  # noqa: ANN001
        if sid not in self._gone:
            return super()._release(sid, key)
        self._refs[sid] -= 1
        if self._refs[sid] == 0 and self._ids.get(key) == sid:
            del self._ids[key]


def _nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


class _Recorder:
    """Wraps ``FlatParam.alloc_storage``/``free_storage`` and the communication thread's jobs."""

    def __init__(self, live: LiveTensorBytes) -> None:
        from hybridshard.runtime.comm.executors.threads import GradJob
        from hybridshard.runtime.units.flat_param import FlatParam

        self.live = live
        self.open: dict[int, int] = {}  # id(FlatParam) -> its recorded allocation
        self.comm: list[LiveTensorBytes] = []
        self._saved = [(FlatParam, "alloc_storage"), (FlatParam, "free_storage"), (GradJob, "run")]
        self._originals = [getattr(cls, name) for cls, name in self._saved]
        alloc, free, run = self._originals
        rec = self

        def alloc_storage(flat) -> None:
            before = flat.unsharded.untyped_storage().nbytes()
            alloc(flat)
            after = flat.unsharded.untyped_storage().nbytes()
            if after != before and not flat.aliases_master:
                assert before == 0 and id(flat) not in rec.open, "a buffer grown twice"
                rec.open[id(flat)] = rec.live.record("unsharded buffer", after)

        def free_storage(flat) -> None:
            before = flat.unsharded.untyped_storage().nbytes()
            free(flat)
            if before and not flat.unsharded.untyped_storage().nbytes() and id(flat) in rec.open:
                rec.live.release(rec.open.pop(id(flat)))

        def job_run(job) -> None:
            mode = LiveTensorBytes()
            rec.comm.append(mode)
            with mode:
                run(job)

        FlatParam.alloc_storage, FlatParam.free_storage, GradJob.run = alloc_storage, free_storage, job_run

    def close(self) -> None:
        for (cls, name), original in zip(self._saved, self._originals):
            setattr(cls, name, original)


def _static_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    """What exists before the measured step, by distinct storage."""
    units = model.hybridshard_runtime.units
    seen: set[int] = set()

    def count(tensors) -> int:
        total = 0
        for t in tensors:
            ptr = t.untyped_storage().data_ptr()
            if t.untyped_storage().nbytes() and ptr not in seen:
                seen.add(ptr)
                total += _nbytes(t)
        return total

    return {
        "params": count(u.flat.sharded for u in units),
        "gathered": count(u.flat.unsharded for u in units),
        "grads": count(p.grad for p in model.parameters() if p.grad is not None),
        "optimizer": count(v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)),
    }


def measure(strategy: str, prefetch: int, overlap: bool) -> dict:
    """One rank: the peak live tensor bytes of one step, and what made it up."""
    import torch.distributed as dist

    import hybridshard as hs

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = WideMLP()
    hs.shard(model, strategy=strategy, groups=RM.groups(), wrap={Block}, prefetch=prefetch, overlap_grads=overlap)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(2):
        opt.zero_grad(set_to_none=True)
        x = _inputs(10 * step + rank)
        if step == 0:  # warm-up: prefetch order recorded, optimizer state created
            _loss(model, x).backward()
            opt.step()
            continue
        static = _static_bytes(model, opt)
        with StepBytes() as live:
            rec = _Recorder(live)
            try:
                _loss(model, x).backward()
                opt.step()
            finally:
                rec.close()
        del x
    units = model.hybridshard_runtime.units
    alive = live.alive_at_peak()
    by_label: dict[str, int] = {}
    for label, n in alive.values():
        by_label[label] = by_label.get(label, 0) + n
    return {
        "static": static,
        "dynamic": live.peak(),
        "peak": sum(static.values()) + live.peak(),
        "alive_at_peak": by_label,
        "allocated": sum(c for _, c in live.events if c > 0),
        "comm_allocated": sum(c for m in rec.comm for _, c in m.events if c > 0),
        "comm_jobs": len(rec.comm),
        "shard_size": units[0].groups.shard_size,
        "units": [(u.flat.layout.numel, u.flat.layout.padded_numel) for u in units],
    }


def run_cases() -> list[dict]:
    return [measure(*case) for case in CASES]


def activation_peak() -> int:
    """Peak bytes of one forward + backward of the plain model on one rank's batch, leaving out
    the parameter gradients (the formula counts those): activations and their gradients."""
    torch.manual_seed(0)
    model = WideMLP()
    x = _inputs(0)
    _loss(model, x).backward()  # warm-up: first-call allocations
    model.zero_grad(set_to_none=True)
    with StepBytes() as live:
        _loss(model, x).backward()
    return live.peak(exclude=live.storages_of(p.grad for p in model.parameters()))


@pytest.fixture(scope="module")
def measured():
    with RankPool(WORLD, num_nodes=2, layout="block") as pool:
        return pool.run(run_cases), activation_peak()


def predicted(strategy: str, prefetch: int, overlap: bool, got: dict) -> int:
    """The planner's formula for the padded unit sizes (fp32 throughout), plus the activations."""
    sizes = [padded for _, padded in got["units"]]
    spec = ModelSpec(num_params=sum(sizes), unit_params=max(sizes[1:]), root_params=sizes[0],
                     param_dtype="fp32", reduce_dtype="fp32", master_dtype="fp32")
    s = ShardingStrategy[strategy]
    shard_size = 1 if s is ShardingStrategy.NO_SHARD else got["shard_size"]
    # On CPU AdamW steps one parameter at a time (no foreach temporary the size of the shard).
    return memory(s, shard_size, model=spec, prefetch=prefetch, overlap_grads=overlap, foreach=False).total


def ratios(measured, overlap: bool | None = None) -> dict[tuple[str, int, bool], list[float]]:
    """Measured / formula per rank; ``overlap`` overrides the case's own setting in the formula."""
    results, activations = measured
    return {case: [r[i]["peak"] / (predicted(*case[:2], case[2] if overlap is None else overlap, r[i]) + activations)
                   for r in results]
            for i, case in enumerate(CASES)}


def _median_pair(values: list[float]) -> list[float]:
    return sorted(values)[len(values) // 2 - 1 : len(values) // 2 + 1]


@pytest.mark.parametrize("index", ASSERTED, ids=[
    f"{CASES[i][0]}-p{CASES[i][1]}-{'overlap' if CASES[i][2] else 'sync'}" for i in ASSERTED])
def test_peak_within_ten_percent_of_the_formula(measured, index):
    """The median rank within 10 % of the formula, every rank within 25 %; see [Note: per-rank
    excursions]. Overlapped cases are bounded below by the formula without the gradient in flight;
    see [Note: the gradient in flight]."""
    case = CASES[index]
    high = ratios(measured)[case]  # against the formula with everything it counts
    low = ratios(measured, overlap=False)[case]  # the same, less the gradient in flight
    print(case, [round(r, 3) for r in high], [round(r, 3) for r in low])
    assert all(r <= 1.10 for r in _median_pair(high)), (case, high)
    assert all(r >= 0.90 for r in _median_pair(low)), (case, low)
    for rank, (hi, lo) in enumerate(zip(high, low)):
        row = measured[0][rank][index]
        assert lo >= 0.85 and hi <= 1.25, (case, rank, lo, hi, row["peak"], row["alive_at_peak"])


def test_the_communication_thread_allocates_nothing(measured):
    """The mode on the main thread does not see the thread: its own modes saw no allocation, and a
    step allocates the same bytes with the thread (overlap) as without."""
    results, _ = measured
    for rank in results:
        by_case = dict(zip(CASES, rank))
        for strategy in STRATEGIES:
            on, off = by_case[(strategy, 1, True)], by_case[(strategy, 0, False)]
            assert on["comm_jobs"] > 0 and on["comm_allocated"] == 0, (strategy, on["comm_allocated"])
            assert on["allocated"] == off["allocated"], (strategy, on["allocated"], off["allocated"])
