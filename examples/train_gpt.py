"""Train a small GPT-style model with hybrid sharding on synthetic data (no downloads).

    hybridshard launch --nproc-per-node 8 examples/train_gpt.py --steps 50
    launch/local-cluster --nodes 2 --procs-per-node 2 -- examples/train_gpt.py --steps 20
    python examples/train_gpt.py --reference --steps 20      # one process, the same global batch
    hybridshard launch --nproc-per-node 4 --max-restarts 2 examples/train_gpt.py \
        --checkpoint-dir ckpt --save-every 5 --resume                   # survives a killed rank

Every rank builds the same model from one seed, takes its slice of each step's global batch, and
trains under ``hs.shard(..., strategy=HYBRID_SHARD)``. Rank 0 logs the loss averaged over the global
batch and tokens/s. ``--reference`` trains the unsharded model in one process on the whole global
batch, so its losses match a distributed run's (up to floating-point reduction order).

With ``--checkpoint-dir`` the job saves a sharded checkpoint (``hs.save_checkpoint``) every
``--save-every`` steps as ``step_<N>`` and keeps the last ``--keep``; with ``--resume`` it first
loads the latest complete one (any topology or strategy may have written it) and continues at its
step, on the same data, so the losses continue as if nothing happened. Under ``--max-restarts``
torchrun restarts every rank of every node when one dies; each restart resumes this way, because
``--resume`` means "the latest checkpoint, if there is one" on every rank alike. ``--kill-rank R
--kill-at-step S`` makes rank R kill itself (SIGKILL) at step S of the first attempt, to see that.

[Note: restart count]
``TORCHELASTIC_RESTART_COUNT`` counts the restarts of *this rank's agent*: the agent whose worker
died counts one, an agent that restarts because another node re-joined the rendezvous does not. So
it decides only the kill (the killed rank's agent always counts its restart), never whether to
resume; the JSON output records every rank's count.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shutil
import signal
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import hybridshard as hs
from model import GPT, Block  # examples/model.py, next to this script


def global_batch(step: int, args: argparse.Namespace) -> torch.Tensor:
    """Step ``step``'s global batch, the same on every rank: arithmetic sequences modulo the vocabulary
    with a random start and stride per row, so the next token is learnable from the context."""
    g = torch.Generator().manual_seed(args.seed * 100_003 + step)
    start = torch.randint(0, args.vocab, (args.batch_size, 1), generator=g)
    stride = torch.randint(1, 8, (args.batch_size, 1), generator=g)
    return (start + stride * torch.arange(args.seq_len + 1)) % args.vocab  # (batch, seq + 1)


def build_model(args: argparse.Namespace) -> GPT:
    torch.manual_seed(args.seed)
    return GPT(args.vocab, args.dim, args.layers, args.heads, args.seq_len)


def checksum(state: dict[str, torch.Tensor]) -> float:
    return float(sum(t.double().sum().item() + t.double().abs().sum().item() for t in state.values()))


def _save(args: argparse.Namespace, model: nn.Module, opt: torch.optim.Optimizer, next_step: int, rank: int) -> None:
    path = os.path.join(args.checkpoint_dir, f"step_{next_step:08d}")
    saved = hs.save_checkpoint(path, model, optimizer=opt, extra={"step": next_step})
    if rank == 0:
        print(f"saved {path}: {sum(saved.bytes_per_rank):,} bytes "
              f"({', '.join(f'{b:,}' for b in saved.bytes_per_rank)} per rank) in {saved.seconds:.2f} s", flush=True)
        done = sorted(n for n in os.listdir(args.checkpoint_dir) if n.startswith("step_") and "." not in n)
        for old in done[: -args.keep]:
            shutil.rmtree(os.path.join(args.checkpoint_dir, old), ignore_errors=True)


def train(args: argparse.Namespace) -> dict:
    distributed = not args.reference
    owns_group = distributed and not dist.is_initialized()
    if owns_group:
        # A collective that cannot finish (a rank is gone) raises after this long instead of hanging.
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo",
                                timeout=datetime.timedelta(seconds=args.timeout_s))
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    if args.batch_size % world:
        raise ValueError(f"--batch-size {args.batch_size} must divide by the world size {world}")
    model = build_model(args)
    device = torch.device("cpu")
    if distributed:
        groups = hs.init_groups()
        device = groups.device or device
        model = hs.shard(model, strategy=args.strategy, groups=groups, wrap={Block}, device=device)
        if rank == 0:
            print(f"world {world}, {args.strategy}: shard groups {list(groups.plan.shard_groups)}, "
                  f"replicate groups {list(groups.plan.replicate_groups)}", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    start = 0
    latest = hs.latest_checkpoint(args.checkpoint_dir) if args.resume and args.checkpoint_dir else None
    if latest is not None:
        start = hs.load_checkpoint(latest, model, optimizer=opt)["step"]
        if rank == 0:
            print(f"resumed from {latest}: continuing at step {start}", flush=True)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))  # see [Note: restart count]
    per_rank = args.batch_size // world
    losses = []
    for step in range(start, args.steps):
        if step == args.kill_at_step and rank == args.kill_rank and attempt == 0:
            print(f"rank {rank}: killing myself at step {step} (--kill-rank)", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        t0 = time.perf_counter()
        batch = global_batch(step, args)[rank * per_rank:(rank + 1) * per_rank].to(device)
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, args.vocab), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if distributed:
            hs.clip_grad_norm_(model, max_norm=args.max_norm)
        else:
            nn.utils.clip_grad_norm_(model.parameters(), max_norm=args.max_norm)
        opt.step()
        mean_loss = loss.detach().clone()
        if distributed:
            dist.all_reduce(mean_loss)
            mean_loss /= world
            hs.maybe_check_replicas(model, step=step + 1, every=args.check_replicas_every)
        losses.append(float(mean_loss))
        tokens_per_s = args.batch_size * args.seq_len / (time.perf_counter() - t0)
        if rank == 0:
            print(f"step {step:4d}  loss {losses[-1]:.4f}  tokens/s {tokens_per_s:,.0f}", flush=True)
        if args.checkpoint_dir and args.save_every and (step + 1) % args.save_every == 0:
            _save(args, model, opt, step + 1, rank)
    state = hs.full_state_dict(model, rank0_only=True) if distributed else model.state_dict()
    restart_counts = [attempt] * world
    if distributed:
        dist.all_gather_object(restart_counts, attempt)
    result = {"world_size": world, "steps": args.steps, "start_step": start, "losses": losses,
              "restart_counts": restart_counts}
    if rank == 0:
        if any(restart_counts):
            print(f"restarts of each rank's agent: {restart_counts}", flush=True)
        result["checksum"] = checksum(state)
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump(result, f)
        if args.state_out:
            torch.save(state, args.state_out)
    if owns_group:
        dist.destroy_process_group()
    return result


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=8, help="global batch, in sequences")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--max-norm", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--strategy", default="HYBRID_SHARD", choices=[s.name for s in hs.ShardingStrategy],
                   help="sharding strategy (default HYBRID_SHARD)")
    p.add_argument("--json-out", help="rank 0 writes per-step losses and a parameter checksum here")
    p.add_argument("--reference", action="store_true", help="train unsharded in this one process")
    p.add_argument("--state-out", help="rank 0 saves the final full state dict here (torch.save)")
    p.add_argument("--checkpoint-dir", help="save sharded checkpoints here (step_<N> directories)")
    p.add_argument("--save-every", type=int, default=0, help="save a checkpoint every N steps (0: never)")
    p.add_argument("--keep", type=int, default=2, help="keep the newest N checkpoints (default 2)")
    p.add_argument("--resume", action="store_true", help="load the latest checkpoint in --checkpoint-dir first")
    p.add_argument("--check-replicas-every", type=int, default=0, metavar="K",
                   help="compare every shard's checksum across its replicas every K steps (0: never)")
    p.add_argument("--timeout-s", type=float, default=120.0,
                   help="process-group timeout: a collective a lost rank cannot finish fails after this long")
    p.add_argument("--kill-rank", type=int, default=-1, help="rank that kills itself (first attempt only)")
    p.add_argument("--kill-at-step", type=int, default=-1, help="step at which --kill-rank kills itself")
    args = p.parse_args(argv)
    if args.dim % args.heads:
        p.error(f"--dim {args.dim} must divide by --heads {args.heads}")
    if not math.isfinite(args.lr) or args.lr <= 0:
        p.error(f"--lr must be a positive number, found {args.lr}")
    if (args.save_every or args.resume) and not args.checkpoint_dir:
        p.error("--save-every and --resume need --checkpoint-dir DIR")
    if args.save_every < 0 or args.keep < 1:
        p.error(f"--save-every must be >= 0 and --keep >= 1, found {args.save_every} and {args.keep}")
    return args


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    train(parse_args())
