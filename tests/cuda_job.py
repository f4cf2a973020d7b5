"""The CUDA path end to end, run under torchrun by ``tests/test_cuda.py`` (needs a GPU).

Every rank discovers its GPU through ``init_groups()`` (real NVML), shards the runtime tests' model
on CUDA with each strategy in five variants (fp32, activation checkpointing, bf16, fp16 with
``hs.ShardedGradScaler``, CPU offload with gradient clipping), trains a few steps on its share of the global batch, and
compares the losses and every parameter with the single-process CPU reference of
``tests.runtime_models``. Every run must use the stream executor with real streams, issue each
communicator's collectives from one thread per phase, and (two ranks) in the same order on every
rank. Then, per strategy, a larger model's peak CUDA memory is printed next to
``hybridshard.estimates.sizing.memory``. Rank 0 writes a JSON summary to ``--out``; any mismatch
raises, so torchrun exits non-zero.

    torchrun --standalone --nproc-per-node 1 tests/cuda_job.py --backend nccl --out summary.json
    torchrun --standalone --nproc-per-node 2 tests/cuda_job.py --backend gloo --out summary.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # after an installed hybridshard

import hybridshard as hs  # noqa: E402
from hybridshard.runtime.trace.issue_order import record_issue_order  # noqa: E402
from benchmarks.memory_job import STRATEGIES, memory_run  # noqa: E402
from benchmarks.tiny_lm import VARIANTS, sharded_model, variant_config  # noqa: E402
from tests import runtime_models as RM  # noqa: E402

# CUDA and CPU kernels sum in different orders; TF32 is off, so fp32 differs by rounding only. The
# low-precision variants step with SGD, whose update follows the gradient's size (AdamW's first
# steps follow its sign, which rounding flips for gradients near zero).
TOL = {"fp32": 1e-4, "ckpt": 1e-4, "offload": 1e-4, "bf16": 5e-3, "fp16": 5e-3}


def run(cfg: RM.Config, groups: hs.ShardGroups) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    device = groups.device
    model = sharded_model(cfg, groups, device)
    home = torch.device("cpu") if cfg.offload else device
    assert all(p.device == home for p in model.parameters()), f"parameters not on {home}"
    executor = model.hybridshard_runtime.executor
    assert executor.kind == "streams" and executor.streams.on_cuda, "CUDA must run the stream executor"
    opt = RM.make_optimizer(cfg, model.parameters())
    scaler = hs.ShardedGradScaler("cuda", init_scale=2.0**10) if cfg.fp16 else None
    torch.cuda.reset_peak_memory_stats(device)
    losses, norms = [], []
    with record_issue_order() as log:
        for step in range(cfg.steps):
            opt.zero_grad(set_to_none=True)
            tokens = RM.batch(step, 0, rank, cfg.micro_batch).to(device)
            loss = RM.lm_loss(model(tokens), tokens)
            (scaler.scale(loss) if scaler is not None else loss).backward()
            if cfg.clip is not None:  # offloaded: gradients on the CPU, the norm's all-reduce on the GPU
                norms.append(float(hs.clip_grad_norm_(model, cfg.clip)))
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            total = loss.detach().float().reshape(1)
            dist.all_reduce(total)
            losses.append(total.item() / world)
    torch.cuda.synchronize(device)
    state = {k: v.detach().cpu() for k, v in hs.full_state_dict(model).items()}
    threads = {f"{g}/{p}": sorted(t) for (g, p), t in log.threads_per_phase().items()}
    assert all(len(t) == 1 for t in threads.values()), f"a communicator had several issuing threads: {threads}"
    return {"losses": losses, "norms": norms, "state": state, "peak": torch.cuda.max_memory_allocated(device),
            "threads": threads, "order": log.signatures()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", choices=["nccl", "gloo"], required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dist.init_process_group(args.backend, timeout=timedelta(seconds=120))
    groups = hs.init_groups()
    rank = dist.get_rank()
    summary = {
        "backend": args.backend,
        "world_size": dist.get_world_size(),
        "device": str(groups.device),
        "gpu": torch.cuda.get_device_name(groups.device),
        "shard_groups": [list(g) for g in groups.plan.shard_groups],
        "runs": {},
        "memory": {},
    }
    for strategy in STRATEGIES:
        for variant in VARIANTS:
            cfg = variant_config(strategy, variant)
            got = run(cfg, groups)
            ref = RM.reference_run(cfg, dist.get_world_size())
            label = f"{strategy} {variant} rank {rank}"
            RM.compare(ref, got, label=label, atol=TOL[variant], rtol=TOL[variant])
            orders: list = [None] * dist.get_world_size()
            dist.all_gather_object(orders, got["order"])
            assert all(o == orders[0] for o in orders), f"{label}: the ranks issued collectives in different orders"
            diff = max((got["state"][k] - v).abs().max().item() for k, v in ref["state"].items())
            loss_diff = max(abs(a - b) for a, b in zip(got["losses"], ref["losses"]))
            summary["runs"][f"{strategy}-{variant}"] = {
                "max_param_diff": diff, "max_loss_diff": loss_diff, "peak_cuda_bytes": got["peak"],
                "issuing_threads": got["threads"], "collectives": len(got["order"]),
            }
    for strategy in STRATEGIES:
        summary["memory"][strategy] = mem = memory_run(strategy, groups)
        if rank == 0:
            print(f"peak CUDA memory {strategy:>18} ({args.backend}, {dist.get_world_size()} rank(s)): "
                  f"{mem['measured_peak_bytes'] / 2**20:8.1f} MiB measured, {mem['planned_bytes'] / 2**20:8.1f} MiB "
                  f"planned (hybridshard.estimates.sizing.memory), ratio {mem['ratio']:.2f}", flush=True)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
