"""A stream-race check on the GPU: two gloo ranks sharing it, under torch's CUDA sanitizer.

Run with ``TORCH_CUDA_SANITIZER=1`` set before Python starts (``make gpu-check`` does): torch's
CSAN then records, for every kernel launched through the dispatcher, which tensors it reads and
writes on which stream, and raises when two streams touch the same memory with no event ordering
them. It sees the runtime's own kernels on its side streams (casts, copies into the flat buffers,
the reduce-scatter's sums and divisions, the optimizer's slices), not what c10d does inside a
collective on its internal streams. The subset: HYBRID_SHARD with overlap and prefetch,
``shard_optimizer_across_replicas=True`` on a (2, 1) mesh (replicate 2, shard groups of one, the
case the emulator found a defect in), bf16 compute, 3 steps.

    TORCH_CUDA_SANITIZER=1 torchrun --standalone --nproc-per-node 2 benchmarks/stream_race.py
    torchrun --standalone --nproc-per-node 2 benchmarks/stream_race.py --cpu   # the same run on CPU

Without a CUDA device (and without ``--cpu``, a dry run of the same code with no sanitizer) it prints
why and exits 0.
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # after an installed hybridshard

import hybridshard as hs  # noqa: E402
from benchmarks import tiny_lm as RM  # noqa: E402

STEPS = 3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu", action="store_true", help="a dry run of the same code on the CPU (no sanitizer)")
    args = p.parse_args()
    if not args.cpu and not torch.cuda.is_available():
        print("stream_race: skipped: no CUDA device on this machine")
        return 0
    from torch.distributed.device_mesh import init_device_mesh

    sanitizer = os.environ.get("TORCH_CUDA_SANITIZER", "") not in ("", "0")
    device = torch.device("cpu") if args.cpu else torch.device("cuda", 0)
    if not args.cpu:
        torch.cuda.set_device(device)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    mesh = init_device_mesh(device.type, (dist.get_world_size(), 1), mesh_dim_names=("replicate", "shard"))
    model = RM.make_model(num_blocks=4)
    mp = hs.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    hs.shard(model, strategy="HYBRID_SHARD", mesh=mesh, wrap={RM.Block}, device=device, mixed_precision=mp,
             prefetch=1, overlap_grads=True, shard_optimizer_across_replicas=True)
    replicas = {u.groups.replicate_size for u in model.hybridshard_runtime.units}
    assert replicas == {dist.get_world_size()}, f"expected every unit replicated {dist.get_world_size()} times: {replicas}"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        tokens = RM.batch(step, 0, dist.get_rank(), 2).to(device)
        loss = RM.lm_loss(model(tokens), tokens)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    if not args.cpu:
        torch.cuda.synchronize(device)
    state = "CPU dry run, no sanitizer" if args.cpu else \
        "sanitizer on" if sanitizer else "SANITIZER OFF (set TORCH_CUDA_SANITIZER=1)"
    if dist.get_rank() == 0:
        print(f"figures: {state}: "
              f"HYBRID_SHARD sliced across 2 replicas, overlap, prefetch 1, bf16, {STEPS} steps on 2 gloo ranks: "
              f"no race reported (losses {[round(float(x), 4) for x in losses]})", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if sanitizer or args.cpu else 1


if __name__ == "__main__":
    sys.exit(main())
