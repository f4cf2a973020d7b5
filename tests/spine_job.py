"""A small sharded training job for the cut-spine test: one line per step, ``--steps`` steps, ``--pause``
seconds between them, so the spine can be cut while it trains (tests/test_local_cluster_racks.py)."""

import argparse
import os
import time

import torch
import torch.distributed as dist

import hybridshard as hs


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--pause", type=float, default=0.2)
    args = p.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = hs.shard(torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 1)),
                     strategy=hs.ShardingStrategy.FULL_SHARD, device=torch.device("cpu"))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    rank, path = dist.get_rank(), os.environ.get("HYBRIDSHARD_NETWORK_PATH", "-")
    for step in range(args.steps):
        loss = model(torch.randn(8, 32)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        print(f"rank {rank} on {path}: step {step} loss {loss.item():.4f}", flush=True)
        time.sleep(args.pause)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
