"""The CUDA path end to end, run under torchrun by ``tests/test_cuda.py`` (needs a GPU).

Every rank discovers its GPU through ``init_groups()`` (real NVML), shards the runtime tests' model
on CUDA with each strategy, trains a few AdamW steps on its share of the global batch, and compares
the losses and every parameter with the single-process CPU reference of ``tests.runtime_models``.
Rank 0 writes a JSON summary (max differences, peak CUDA memory, the backend, the groups) to
``--out``; any mismatch raises, so torchrun exits non-zero.

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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import hybridshard as hs  # noqa: E402
from tests import runtime_models as RM  # noqa: E402

STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2"]
# CUDA and CPU kernels sum in different orders; TF32 is off, so this is fp32 rounding only.
TOL = dict(atol=1e-4, rtol=1e-4)


def run(cfg: RM.Config, groups: hs.ShardGroups) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    device = groups.device
    model = RM.make_model(num_blocks=cfg.num_blocks)
    model.checkpoint = cfg.checkpoint
    hs.shard(model, strategy=cfg.strategy, groups=groups, wrap={RM.Block}, device=device)
    assert all(p.device == device for p in model.parameters()), "parameters not on the rank's GPU"
    opt = RM.make_optimizer(cfg, model.parameters())
    torch.cuda.reset_peak_memory_stats(device)
    losses = []
    for step in range(cfg.steps):
        opt.zero_grad(set_to_none=True)
        tokens = RM.batch(step, 0, rank, cfg.micro_batch).to(device)
        loss = RM.lm_loss(model(tokens), tokens)
        loss.backward()
        hs.clip_grad_norm_(model, 1.0) if cfg.clip else None
        opt.step()
        total = loss.detach().reshape(1)
        dist.all_reduce(total)
        losses.append(total.item() / world)
    torch.cuda.synchronize(device)
    state = {k: v.detach().cpu() for k, v in hs.full_state_dict(model).items()}
    return {"losses": losses, "norms": [], "state": state, "peak": torch.cuda.max_memory_allocated(device)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", choices=["nccl", "gloo"], required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dist.init_process_group(args.backend, timeout=timedelta(seconds=120))
    groups = hs.init_groups()
    summary = {
        "backend": args.backend,
        "world_size": dist.get_world_size(),
        "device": str(groups.device),
        "gpu": torch.cuda.get_device_name(groups.device),
        "shard_groups": [list(g) for g in groups.plan.shard_groups],
        "runs": {},
    }
    for strategy in STRATEGIES:
        for checkpoint in (False, True):
            cfg = RM.Config(strategy=strategy, steps=3, checkpoint=checkpoint)
            got = run(cfg, groups)
            ref = RM.reference_run(cfg, dist.get_world_size())
            RM.compare(ref, got, label=f"{strategy} ckpt={checkpoint} rank {dist.get_rank()}", **TOL)
            diff = max((got["state"][k] - v).abs().max().item() for k, v in ref["state"].items())
            loss_diff = max(abs(a - b) for a, b in zip(got["losses"], ref["losses"]))
            summary["runs"][f"{strategy}{'-ckpt' if checkpoint else ''}"] = {
                "max_param_diff": diff, "max_loss_diff": loss_diff, "peak_cuda_bytes": got["peak"],
            }
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
