"""One-GPU step time: hybridshard against FSDP2 on the same model, batch and optimizer.

Both shard a GPT (each transformer block a unit, the rest the root) over one rank with NCCL, so
no bytes cross a link: what differs is each runtime's own work per step (hooks, gathers into the
flat buffer or per-parameter copies, streams and events, the optimizer over flat shards or
DTensors). Steps are timed with CUDA events in interleaved rounds (one system, then the other), and
the medians are printed with their ratio. The first step's losses are compared as a check that both
train the same model.

    python benchmarks/gpu_step.py                       # FULL_SHARD, fp32
    python benchmarks/gpu_step.py --strategy SHARD_GRAD_OP --dtype bf16 --layers 12
    python benchmarks/gpu_step.py --compile   # + hybridshard compiled per unit, FSDP2 compiled per block

With ``--compile`` three systems run: hybridshard eager, hybridshard with ``shard(..., compile=True)``
and FSDP2 with each block's ``.compile()``; the first step (where compilation happens) is timed apart, each system compiling cold
(see [Note: cold compiles] in hybridshard/bench/compiled.py).

Without a CUDA device it prints why and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # after an installed hybridshard

import hybridshard as hs  # noqa: E402
from hybridshard.bench.compiled import CompileCounts, private_forward, warm_inductor  # noqa: E402
from hybridshard.bench.model import GPT, Block, global_batch  # noqa: E402


def build(args: argparse.Namespace) -> GPT:
    torch.manual_seed(0)
    return GPT(args.vocab, args.dim, args.layers, args.heads, args.seq)


def hybridshard_model(args: argparse.Namespace, device: torch.device, groups: hs.ShardGroups,
                      compile: bool = False) -> torch.nn.Module:
    mp = hs.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.dtype == "bf16" else None
    model = build(args)
    if compile:  # see [Note: cold compiles] in hybridshard/bench/compiled.py
        private_forward(model, Block)
    return hs.shard(model, strategy=args.strategy, groups=groups, wrap={Block}, device=device,
                    mixed_precision=mp, **({"compile": True} if compile else {}))


def fsdp2_model(args: argparse.Namespace, device: torch.device, compile: bool = False) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = build(args).to(device)
    if compile:
        private_forward(model, Block)
    mesh = init_device_mesh("cuda", (1,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.dtype == "bf16" else None
    options = {"mesh": mesh, **({"mp_policy": mp} if mp is not None else {})}
    zero3 = args.strategy == "FULL_SHARD"
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=zero3, **options)
    fully_shard(model, **options)
    if compile:
        for block in model.blocks:
            block.compile()
    return model


def step(model: torch.nn.Module, opt: torch.optim.Optimizer, tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    opt.zero_grad(set_to_none=True)
    logits = model(tokens[:, :-1])  # (b, s, vocab)
    loss = F.cross_entropy(logits.float().reshape(-1, vocab), tokens[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    return loss.detach()


def timed(model, opt, tokens, vocab: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    step(model, opt, tokens, vocab)
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--strategy", choices=["FULL_SHARD", "SHARD_GRAD_OP"], default="FULL_SHARD")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--compile", action="store_true", help="also hybridshard compiled per unit, against FSDP2 compiled")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("gpu_step: skipped: no CUDA device on this machine")
        return 0
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)
    try:
        groups = hs.init_groups()
        systems = {"hybridshard": hybridshard_model(args, device, groups)}
        if args.compile:
            systems["compiled"] = hybridshard_model(args, device, groups, compile=True)
        systems["fsdp2"] = fsdp2_model(args, device, compile=args.compile)
        opts = {name: torch.optim.AdamW(m.parameters(), lr=1e-4) for name, m in systems.items()}
        batches = [global_batch(i, seed=0, batch=args.batch, seq=args.seq, vocab=args.vocab).to(device)
                   for i in range(args.warmup + args.rounds)]
        first, first_s = {}, {}
        counts = CompileCounts()
        if args.compile:
            warm_inductor(device)
        try:
            for name, m in systems.items():  # the first step: where compiling happens, cold for each system
                with counts.cold(name) if args.compile else contextlib.nullcontext():
                    t0 = time.perf_counter()
                    first[name] = step(m, opts[name], batches[0], args.vocab).item()
                    first_s[name] = time.perf_counter() - t0
        finally:
            counts.close()
        for i in range(1, args.warmup):
            for name, m in systems.items():
                step(m, opts[name], batches[i], args.vocab)
        times: dict[str, list[float]] = {name: [] for name in systems}
        for i in range(args.warmup, args.warmup + args.rounds):
            order = list(systems) if i % 2 else list(reversed(systems))
            for name in order:
                times[name].append(timed(systems[name], opts[name], batches[i], args.vocab))
        med = {name: statistics.median(t) for name, t in times.items()}
        peak = torch.cuda.max_memory_allocated(device) / 2**20
        print(f"gpu_step on {torch.cuda.get_device_name(device)}: {args.strategy}, {args.dtype}, GPT {args.layers}x"
              f"{args.dim} (vocab {args.vocab}), batch {args.batch}x{args.seq}, torch {torch.__version__}")
        print("  first-step loss: " + ", ".join(f"{n} {v:.5f}" for n, v in first.items()))
        print("  first step (compiling, if any): " + ", ".join(f"{n} {v:.1f} s" for n, v in first_s.items()))
        for name in systems:
            t = sorted(times[name])
            print(f"  {name:>11}: median {med[name]:8.2f} ms/step (min {t[0]:.2f}, max {t[-1]:.2f}, {len(t)} rounds)")
        print(f"  ratio hybridshard / fsdp2: {med['hybridshard'] / med['fsdp2']:.3f}   (peak CUDA memory, both "
              f"models together: {peak:.0f} MiB)")
        if args.compile:
            c, e, f = med["compiled"], med["hybridshard"], med["fsdp2"]
            print(f"figures: {args.strategy} {args.dtype} compiled: hybridshard {c:.2f} ms (eager {e:.2f} ms, "
                  f"{c / e:.3f}x) vs fsdp2+compile {f:.2f} ms, ratio {c / f:.3f}; first step {first_s['compiled']:.1f} s "
                  f"vs fsdp2+compile {first_s['fsdp2']:.1f} s (targets: <= 0.90x eager, <= 0.90x fsdp2+compile)",
                  flush=True)
            return 0 if all(abs(v - first["fsdp2"]) <= 1e-2 * abs(first["fsdp2"]) for v in first.values()) else 1
        target = " (target <= 0.95)" if args.dtype == "fp32" else ""
        print(f"figures: {args.strategy} {args.dtype}: hybridshard {med['hybridshard']:.2f} ms vs fsdp2 "
              f"{med['fsdp2']:.2f} ms per step, ratio {med['hybridshard'] / med['fsdp2']:.3f}{target}", flush=True)
        if abs(first["hybridshard"] - first["fsdp2"]) > 1e-2 * abs(first["fsdp2"]):
            print("gpu_step: the two systems' first losses differ by more than 1%: they did not train the same model")
            return 1
        return 0
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
