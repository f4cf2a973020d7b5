"""Models, data and training runs for tests/test_frozen_memory.py (its measuring jobs: tests/frozen_jobs.py).

``FrozenNet``: a trainable input projection and norm (the root) around wide MLP blocks whose
parameters are all frozen, so activations need gradients but the blocks get none. ``LoRANet``: a
frozen input projection, blocks of frozen ``Linear`` layers each with a small trainable low-rank
adapter (LoRA), and a trainable head; every block mixes frozen and trainable parameters. Both can
checkpoint each block (non-reentrant or reentrant) and can record, from inside backward, which units
are gathered once backward has passed every block (``probe``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import hybridshard as hs
from hybridshard.runtime.units.flat_param import FlatParam
from hybridshard.runtime.units.strategy import ShardingStrategy
from hybridshard.runtime.units.unit import ShardedState
from tests import runtime_models as RM

DIM, HIDDEN, BLOCKS, BATCH, SEQ = 128, 512, 4, 2, 4
LORA_RANK, OUT = 8, 16


class _Probe(torch.autograd.Function):
    """Identity; its backward records which units are gathered at that point of backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, model: nn.Module) -> torch.Tensor:  # noqa: ANN001
        ctx.model = model
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        units = ctx.model.hybridshard_runtime.units
        ctx.model.seen.append(sorted(u.name for u in units if u.sharded_state is not ShardedState.SHARDED))
        return grad, None


def _run_blocks(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if model.seen is not None and isinstance(model, hs.HybridShardModule):
        x = _Probe.apply(x, model)  # backward reaches it after every block
    for block in model.blocks:
        # Reentrant checkpointing needs an input that requires grad to give the block's parameters one.
        if model.checkpoint and (model.checkpoint != "reentrant" or x.requires_grad):
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=model.checkpoint == "reentrant")
        else:
            x = block(x)
    return x


class FrozenBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(DIM, HIDDEN), nn.Linear(HIDDEN, DIM)
        self.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


class FrozenNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.blocks = nn.ModuleList(FrozenBlock() for _ in range(BLOCKS))
        self.norm = nn.LayerNorm(DIM)
        self.checkpoint: bool | str = False
        self.seen: list | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(_run_blocks(self, self.inp(x)))


class LoRALinear(nn.Module):
    """A frozen ``Linear`` plus a trainable rank-``LORA_RANK`` update ``b @ a``."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.base = nn.Linear(n_in, n_out).requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(LORA_RANK, n_in) / n_in**0.5)
        self.lora_b = nn.Parameter(torch.randn(n_out, LORA_RANK) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (b, s, in) @ (in, r) @ (r, out) = (b, s, out)
        return self.base(x) + (x @ self.lora_a.t()) @ self.lora_b.t()


class LoRABlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM).requires_grad_(False)
        self.fc1, self.fc2 = LoRALinear(DIM, HIDDEN), LoRALinear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class LoRANet(nn.Module):
    """Frozen input projection (so the first block's input needs no gradient), LoRA blocks, a frozen
    norm that backward passes after the head's gradient is complete, trainable head."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM).requires_grad_(False)
        self.blocks = nn.ModuleList(LoRABlock() for _ in range(BLOCKS))
        self.out_norm = nn.LayerNorm(DIM).requires_grad_(False)  # frozen, after the blocks
        with torch.no_grad():
            self.out_norm.weight.normal_(1.0, 0.2)
        self.head = nn.Linear(DIM, OUT)
        self.checkpoint: bool | str = False
        self.seen: list | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.out_norm(_run_blocks(self, self.inp(x))))


MODELS = {"frozen": (FrozenNet, FrozenBlock), "prefix": (FrozenNet, FrozenBlock), "lora": (LoRANet, LoRABlock)}


def make(kind: str, seed: int = 0) -> tuple[nn.Module, type]:
    torch.manual_seed(seed)
    cls, block = MODELS[kind]
    model = cls()
    if kind == "prefix":  # the input projection frozen too: no block's output needs a gradient
        model.inp.requires_grad_(False)
    return model, block


def data(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 100 * micro + rank)
    return torch.randn(BATCH, SEQ, DIM, generator=g), torch.randn(BATCH, SEQ, OUT, generator=g)


def loss_of(model: nn.Module, kind: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = model(x)  # (b, s, OUT) for LoRANet, (b, s, DIM) for FrozenNet
    return F.mse_loss(out[..., :OUT], y)


@dataclass(frozen=True)
class Run:
    """One training run of a model, sharded (on every rank) or as the single-process reference."""

    kind: str = "lora"
    strategy: str = "FULL_SHARD"
    split: float | None = 0.5
    """``shard(split_frozen=...)``."""
    checkpoint: bool | str = False
    micro: int = 1
    """Micro-batches per step; all but the last under ``no_sync``."""
    reduce_scatter: bool = False
    prefetch: int = 1
    overlap: bool = True
    bf16: bool = False
    clip: float | None = 0.5
    steps: int = 3
    unfreeze: str | None = None
    """A frozen parameter to unfreeze after ``shard`` (before the optimizer is built)."""
    two_hop: bool | None = False
    """``shard(two_hop=...)``: flat unless asked; ``None`` (the default of ``shard``) runs FULL_SHARD and
    SHARD_GRAD_OP in two hops on the test pools of 2 nodes x 2 ranks (see :func:`expected_counts`)."""


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    # SGD, not Adam: Adam divides each update by the gradient's own size, which turns the last-bit
    # differences of near-zero gradients (summation order) into visible parameter differences.
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def sharded_run(run: Run) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    model, block = make(run.kind)
    model.checkpoint, model.seen = run.checkpoint, []
    mp = hs.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if run.bf16 else None
    hs.shard(model, strategy=run.strategy, groups=RM.groups(), wrap={block}, mixed_precision=mp, prefetch=run.prefetch,
             overlap_grads=run.overlap, split_frozen=run.split, two_hop=run.two_hop)
    if run.unfreeze:
        model.get_parameter(run.unfreeze).requires_grad_(True)
    opt = optimizer(model)
    losses, norms, counts = [], [], []
    for step in range(run.steps):
        opt.zero_grad(set_to_none=True)
        total = torch.zeros(1)
        with hs.count_collectives() as c:
            for m in range(run.micro):
                x, y = data(step, m, rank)
                with hs.no_sync(model, reduce_scatter=run.reduce_scatter) if m < run.micro - 1 else contextlib.nullcontext():
                    loss = loss_of(model, run.kind, x, y)
                    (loss / run.micro).backward()
                total += loss.detach().float() / run.micro
        counts.append(dict(c.calls))
        dist.all_reduce(total)
        losses.append(total.item() / world)
        if run.clip is not None:
            norms.append(float(hs.clip_grad_norm_(model, run.clip)))
        opt.step()
    units = model.hybridshard_runtime.units
    return {"losses": losses, "norms": norms, "state": hs.full_state_dict(model), "counts": counts,
            "units": [(u.name, u.strategy.name, u.expects_grad) for u in units], "seen": model.seen,
            "owner": {slot.name: u.name for u in units for slot in u.flat.layout.slots}}


def reference_run(run: Run, world: int) -> dict[str, Any]:
    """One process, the global batch (every rank's micro-batches)."""
    with RM.single_thread():
        model, _ = make(run.kind)
        model.checkpoint = run.checkpoint
        if run.unfreeze:
            model.get_parameter(run.unfreeze).requires_grad_(True)
        opt = optimizer(model)
        losses, norms = [], []
        for step in range(run.steps):
            opt.zero_grad(set_to_none=True)
            parts = [data(step, m, r) for m in range(run.micro) for r in range(world)]
            loss = loss_of(model, run.kind, torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts]))
            loss.backward()
            losses.append(loss.item())
            if run.clip is not None:
                norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), run.clip)))
            opt.step()
        return {"losses": losses, "norms": norms, "state": {k: v.clone() for k, v in model.state_dict().items()}}


def run_all(runs: list[Run]) -> list[dict[str, Any]]:
    with poisoned_frees():
        return [sharded_run(run) for run in runs]


@contextlib.contextmanager
def poisoned_frees() -> Iterator[None]:
    """Fill every unsharded buffer with NaN before it is freed, so that a computation that reads a
    buffer after the runtime freed it (freed too early) turns the losses and parameters into NaN
    instead of reading stale values from memory the allocator has not reused yet."""
    original = FlatParam._free_storage

    def free(flat: FlatParam) -> None:
        if flat.unsharded.untyped_storage().size() and flat.unsharded.is_floating_point():
            flat.unsharded.data.fill_(float("nan"))
        original(flat)

    FlatParam._free_storage = free
    try:
        yield
    finally:
        FlatParam._free_storage = original


def expected_counts(run: Run, units: list[tuple[str, str, bool]]) -> dict[tuple[str, str], int]:
    """Collectives per step: a ZeRO-3 unit other than the root and its frozen part gathers twice per
    micro-batch, the others once (NO_SHARD never), and a block under reentrant checkpointing twice
    (its forward runs under ``no_grad``, which frees every unit); only units with trainable
    parameters reduce. FULL_SHARD and SHARD_GRAD_OP in two hops (``run.two_hop`` not ``False``): the
    same calls on ``world_across``; compare with :func:`across_counts` of what was counted."""
    out: dict[tuple[str, str], int] = {}

    def add(key: tuple[str, str], n: int) -> None:
        out[key] = out.get(key, 0) + n

    for name, strategy, trains in units:
        s = ShardingStrategy[strategy]
        root = name.startswith("<root>")
        if s is ShardingStrategy.NO_SHARD:
            if trains:
                add(("all_reduce", "world"), 1)
            continue
        group = "shard" if s.is_hybrid else "world" if run.two_hop is False else "world_across"
        # Under reentrant checkpointing LoRANet runs its first block plainly (see _run_blocks).
        plain_first = run.kind == "lora" and name.startswith("blocks.0")
        reentrant = run.checkpoint == "reentrant" and not root and not plain_first
        add(("all_gather", group), run.micro * (2 if (s.reshard_after_forward or reentrant) and not root else 1))
        if trains:
            add(("reduce_scatter", group), run.micro if run.reduce_scatter else 1)
            if s.is_hybrid:
                add(("all_reduce", "replicate"), 1)
    return out


def across_counts(counts: dict[tuple[str, str], int]) -> dict[tuple[str, str], int]:
    """``counts`` without the calls of the hop inside the node (``world_node``): one gather or
    reduce-scatter in two hops is one call across nodes and as many inside the node as the hop makes
    ([Note: a shard group in two hops] in hybridshard/runtime/comm/two_hop.py)."""
    return {key: n for key, n in counts.items() if key[1] != "world_node"}


def check_counts(run: Run, got: dict[str, Any], label: str) -> None:
    """A :func:`sharded_run`'s collectives per step are :func:`expected_counts`; in two hops, the hop
    inside the node besides, and only then."""
    assert [across_counts(c) for c in got["counts"]] == [expected_counts(run, got["units"])] * run.steps, (
        label, got["counts"], got["units"])
    hops = run.two_hop is not False and run.strategy in ("FULL_SHARD", "SHARD_GRAD_OP")
    assert all(any(group == "world_node" for _, group in c) == hops for c in got["counts"]), (label, got["counts"])
