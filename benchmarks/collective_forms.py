"""Which formulation of a reduce-scatter is fastest on gloo (CPU tensors)?

    python benchmarks/collective_forms.py [--world 4] [--sizes 64K,1M,4M,16M] [--rounds 15]

Spawns ``--world`` gloo ranks on this host and times, for fp32 messages of each size (the full
input of one rank, as a unit's gradient would be), in groups of the whole world and in groups of 2
(the pairs ``[0, 1]``, ``[2, 3]``, ... all running at once, as shard groups do):

- ``native``: ``reduce_scatter_tensor``; gloo runs a full all-reduce underneath.
- ``all_to_all``: ``all_to_all_single``, then a local sum of the received chunks.
- ``ring``: a point-to-point ring (``isend``/``irecv`` of one chunk per step, S-1 steps).
- ``all_reduce``: ``all_reduce`` of a copy, then a slice (the reference the native form resembles).
- ``library``: :func:`hybridshard.runtime.comm.collectives.reduce_scatter` as it now is.

Each round runs every (group, size, form) once, in a rotated order so no form always goes first;
one sample is the slowest rank's time for ``--inner``-scaled repetitions after a barrier. The table
shows the median per call over the rounds (after ``--warmup`` rounds) and its ratio to ``native``.
Every form is first checked against ``native`` (``allclose``, rtol 1e-6). On a shared machine the
figures are noisy: compare ratios from one run, and prefer more rounds to more sizes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

Form = Callable[[torch.Tensor, torch.Tensor, dist.ProcessGroup], None]


def _parse_size(text: str) -> int:
    """``"64K"``, ``"1M"``, ``"512"`` -> bytes."""
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text.rstrip("KMG")) * scale)


# Newer torch renames reduce_scatter_tensor; the semantics are the same.
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def native(output: torch.Tensor, full: torch.Tensor, group: dist.ProcessGroup) -> None:
    _REDUCE_SCATTER(output, full, group=group)


def all_to_all(output: torch.Tensor, full: torch.Tensor, group: dist.ProcessGroup) -> None:
    received = torch.empty_like(full)
    dist.all_to_all_single(received, full, group=group)
    chunks = received.view(dist.get_world_size(group), -1)
    output.copy_(chunks[0])
    for chunk in chunks[1:]:
        output.add_(chunk)


def ring(output: torch.Tensor, full: torch.Tensor, group: dist.ProcessGroup) -> None:
    ranks = dist.get_process_group_ranks(group)
    size, me = len(ranks), dist.get_rank(group)
    right, left = ranks[(me + 1) % size], ranks[(me - 1) % size]
    chunks = full.view(size, -1)
    # Step s sends the partial sum of chunk (me-1-s) to the right and receives chunk (me-2-s) from
    # the left; after size-1 steps this rank holds the full sum of chunk me.
    send = chunks[(me - 1) % size].clone()
    recv = torch.empty_like(send)
    for step in range(size - 1):
        works = [dist.isend(send, right, group=group), dist.irecv(recv, left, group=group)]
        for work in works:
            work.wait()
        recv.add_(chunks[(me - 2 - step) % size])
        send, recv = recv, send
    output.copy_(send)


def all_reduce(output: torch.Tensor, full: torch.Tensor, group: dist.ProcessGroup) -> None:
    total = full.clone()
    dist.all_reduce(total, group=group)
    output.copy_(total.view(dist.get_world_size(group), -1)[dist.get_rank(group)])


def library(output: torch.Tensor, full: torch.Tensor, group: dist.ProcessGroup) -> None:
    from hybridshard.runtime.comm import collectives

    collectives.reduce_scatter(output, full, group)


FORMS: dict[str, Form] = {
    "native": native, "all_to_all": all_to_all, "ring": ring, "all_reduce": all_reduce, "library": library,
}


def _inner(nbytes: int) -> int:
    """Repetitions per sample: enough that a small message's sample is not all timer and barrier."""
    return max(1, min(32, (4 << 20) // nbytes))


def _rank_main(rank: int, args: argparse.Namespace, store_path: str, queue) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, args.world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=args.world)
    pairs = [dist.new_group([r, r + 1]) for r in range(0, args.world, 2)]
    groups = {args.world: dist.group.WORLD, 2: pairs[rank // 2]}
    cases = [(s, nbytes) for s in sorted(groups) for nbytes in args.sizes]
    inputs = {}
    for s, nbytes in cases:
        numel = nbytes // 4 // s * s
        g = torch.Generator().manual_seed(rank * 7919 + numel)
        full = torch.randn(numel, generator=g)
        inputs[(s, nbytes)] = (full, torch.empty(numel // s))
        expected = torch.empty(numel // s)
        native(expected, full, groups[s])
        for name, form in FORMS.items():
            out = torch.empty(numel // s)
            form(out, full, groups[s])
            if not torch.allclose(out, expected, rtol=1e-6, atol=1e-6):
                raise AssertionError(f"{name} differs from native for group size {s}, {nbytes} bytes")
    names = list(FORMS)
    samples: dict[tuple[int, int, str], list[float]] = {(s, b, f): [] for s, b in cases for f in names}
    for round_index in range(args.warmup + args.rounds):
        for case_index, (s, nbytes) in enumerate(cases):
            full, out = inputs[(s, nbytes)]
            shift = (round_index + case_index) % len(names)
            for name in names[shift:] + names[:shift]:
                reps = _inner(nbytes)
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(reps):
                    FORMS[name](out, full, groups[s])
                elapsed = torch.tensor([(time.perf_counter() - t0) / reps], dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                if round_index >= args.warmup:
                    samples[(s, nbytes, name)].append(elapsed.item())
    if rank == 0:
        queue.put({key: statistics.median(v) for key, v in samples.items()})
    dist.barrier()
    dist.destroy_process_group()


def _table(medians: dict[tuple[int, int, str], float], args: argparse.Namespace) -> str:
    names = list(FORMS)
    head = f"{'group':>5} {'bytes':>9} " + " ".join(f"{n + ' ms':>14}" for n in names) + "   ratio to native"
    lines = [head, "-" * len(head)]
    for s in sorted({k[0] for k in medians}):
        for nbytes in args.sizes:
            base = medians[(s, nbytes, "native")]
            times = " ".join(f"{medians[(s, nbytes, n)] * 1e3:>14.3f}" for n in names)
            ratios = " ".join(f"{n}={medians[(s, nbytes, n)] / base:.2f}" for n in names[1:])
            lines.append(f"{s:>5} {nbytes:>9} {times}   {ratios}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=4, help="ranks to spawn (even; default 4)")
    parser.add_argument("--sizes", default="64K,1M,4M,16M", help="full fp32 input bytes per rank, comma-separated")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    if args.world < 2 or args.world % 2:
        parser.error(f"--world must be an even number >= 2, got {args.world}")
    args.sizes = [_parse_size(s) for s in args.sizes.split(",")]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="hs-bench-") as tmp:
        context = mp.start_processes(_rank_main, args=(args, os.path.join(tmp, "store"), queue),
                                     nprocs=args.world, join=False, start_method="spawn")
        while not context.join(timeout=1):  # raises if a rank fails
            if not queue.empty():
                break
        medians = queue.get()
        context.join()
    print(f"reduce-scatter forms on gloo, {args.world} ranks, {os.cpu_count()} CPUs, "
          f"median of {args.rounds} rounds after {args.warmup} warm-up; one thread per rank")
    print(_table(medians, args))


if __name__ == "__main__":
    main()
