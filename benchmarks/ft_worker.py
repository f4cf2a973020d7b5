"""One rank of a replica group in fault-tolerant mode, for tests/test_ft.py and the FT benchmarks.

Run with the torchrun environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) of its own replica
group plus TORCHFT_LIGHTHOUSE and HYBRIDSHARD_REPLICA_ID. Trains a small model until the committed
step count reaches --steps, one JSON line per step into --out, then checks the replicas and writes a
digest of this rank's master shards and optimizer state into --out's ``.done`` file, and (rank 0) the
group's full parameters into --out's ``.state.pt`` file. With ``--executor emulate`` the ``.done`` file
also holds the runtime's host syncs from the second step on (``host_syncs``: hot and exempt, each a
``[step, phase, site, count]``; tests/test_gpu_path_ft.py).

Each step's line says what a reference needs to replay it: ``batches``, the per-group batches committed
before it (its samples follow them, see ``FaultTolerance.batch_indices``), ``replicas`` (the groups
averaged), ``participant`` (this group's place among them; None while healing), this group's ``loss``
and the total ``grad_norm`` after the cross-group reduction.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import hybridshard as hs
from hybridshard.runtime.engine import get_engine


def model_and_data(seed: int = 0, width: int = 32) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The model's initial weights from ``seed``; the data is the same for every seed."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 16, generator=g)
    y = torch.randn(512, 4, generator=g)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 4))
    return model, x, y


SGD_LR, SGD_MOMENTUM = 1e-2, 0.9
"""``--optimizer sgd``; its update shows a gradient off by a constant factor, which AdamW's hides."""


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=SGD_LR, momentum=SGD_MOMENTUM)
    return torch.optim.AdamW(params, lr=1e-2)


def digest(model: nn.Module, optimizer: torch.optim.Optimizer) -> str:
    h = hashlib.sha256()
    for unit in get_engine(model).units:
        h.update(unit.flat.sharded.detach().contiguous().view(torch.uint8).numpy().tobytes())
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                h.update(value.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class PlainReplicas:
    """The same loop without fault tolerance: one job over every node, a step always commits."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, batch: int) -> None:
        self.model, self.optimizer, self.batch = model, optimizer, batch
        self.current_step = 0
        groups = get_engine(model).root.groups
        self.num_replicas, self.replica_rank = groups.replicate_size, groups.replicate_rank

    @property
    def batches_committed(self) -> int:
        return self.current_step * self.num_replicas

    def start_step(self) -> None:
        pass

    def batch_indices(self, batch_size: int, dataset_size: int) -> list[int]:
        start = (self.batches_committed + self.replica_rank) * batch_size
        return [(start + i) % dataset_size for i in range(batch_size)]

    def step(self) -> bool:
        self.optimizer.step()
        self.current_step += 1
        return True

    def check_replicas(self) -> int:
        hs.check_replicas(self.model)
        return self.num_replicas

    def save_checkpoint(self, path: str) -> None:
        hs.save_checkpoint(path, self.model, optimizer=self.optimizer, extra={"step": self.current_step})

    def load_checkpoint(self, path: str) -> None:
        self.current_step = hs.load_checkpoint(path, self.model, optimizer=self.optimizer)["step"]

    def shutdown(self) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--until-replicas", type=int, default=0,
                        help="after --steps, go on until a step commits with this many replica groups")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--sleep", type=float, default=0.0, help="seconds of extra work per step")
    parser.add_argument("--sleep-from", type=int, default=0,
                        help="the --sleep only from this process's step N (0-based) on: a replica group that "
                             "turns slow mid-run (tests/test_ft_stragglers.py)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--timeout", type=float, default=10.0)
    parser.add_argument("--ckpt", default=None, help="directory: resume from its latest checkpoint, save every --save-every")
    parser.add_argument("--save-every", type=int, default=0)
    parser.add_argument("--plain", action="store_true",
                        help="one job over every node, replicate group as usual (the mode FT is measured against)")
    parser.add_argument("--full-steps", type=int, default=0,
                        help="instead of --steps: this many steps after the first with --until-replicas groups")
    parser.add_argument("--no-check-steps", action="store_true", help="shard(check_steps=False)")
    parser.add_argument("--stop-file", default=None,
                        help="go on until this file names a step, then stop at the first step from it that "
                             "commits with --until-replicas groups (tests write it once every group is back)")
    parser.add_argument("--min-replicas", type=int, default=1)
    parser.add_argument("--max-failed-steps", type=int, default=20)
    parser.add_argument("--width", type=int, default=32, help="hidden width of the model")
    parser.add_argument("--init-seed", type=int, default=0,
                        help="seed of the initial weights (a group resuming from a checkpoint must not keep them)")
    parser.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
    parser.add_argument("--clip", type=float, default=1.0, help="max gradient norm (1e6: the norm, never clipped)")
    parser.add_argument("--no-init-sync", action="store_true",
                        help="FaultTolerance(init_sync=False): every group starts from the same seeded weights")
    parser.add_argument("--executor", default=None, choices=["threads", "streams", "emulate"],
                        help="shard(executor=...); under emulate the .done file also holds the runtime's host "
                             "syncs from the second step on (tests/test_gpu_path_ft.py)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    groups = hs.init_groups()
    model, x, y = model_and_data(seed=args.init_seed, width=args.width)
    model = hs.shard(model, strategy="hybrid_shard", groups=groups, check_steps=not args.no_check_steps,
                     wrap=lambda m: isinstance(m, nn.Linear), executor=args.executor)
    optimizer = make_optimizer(args.optimizer, model.parameters())
    if args.plain:
        ft = PlainReplicas(model, optimizer, args.batch)
    else:
        ft = hs.FaultTolerance(model, optimizer, timeout=args.timeout, quorum_timeout=3 * args.timeout,
                               min_replicas=args.min_replicas, max_failed_steps=args.max_failed_steps,
                               init_sync=not args.no_init_sync)
    if args.ckpt and (latest := hs.latest_checkpoint(args.ckpt)) is not None:
        ft.load_checkpoint(latest)
    # Several ranks, several hosts, one directory: "{node}_rank{rank}.jsonl".
    args.out = args.out.format(rank=dist.get_rank(), node=os.environ.get("HYBRIDSHARD_NODE_NAME", socket.gethostname()))
    log = open(args.out, "a", buffering=1)
    started = time.perf_counter()
    replicas, first_full = 0, None  # first_full: the first step every group took part in (the same on all)
    syncs, steady = None, None  # the emulated device's host-sync counts, and a copy from the second step on
    if args.executor == "emulate":
        from hybridshard.runtime.trace import host_syncs

        syncs = host_syncs.counts()

    def go_on() -> bool:
        if args.full_steps:
            return first_full is None or ft.current_step < first_full + args.full_steps
        if args.stop_file:
            try:
                with open(args.stop_file) as f:
                    target = int(f.read())
            except (FileNotFoundError, ValueError):  # not there yet, or being written
                return True
            return ft.current_step < target or replicas < args.until_replicas
        return ft.current_step < args.steps or replicas < args.until_replicas

    iterations = 0
    while go_on():
        if syncs is not None and iterations == 1:
            syncs.reset()  # the steady state: from the second step on (see [Note: counting host syncs])
        iterations += 1
        t0 = time.perf_counter()
        ft.start_step()
        index = torch.tensor(ft.batch_indices(args.batch, x.shape[0]))
        batches, participant = ft.batches_committed, ft.replica_rank
        loss = nn.functional.mse_loss(model(x[index]), y[index])
        loss.backward()
        grad_norm = hs.clip_grad_norm_(model, args.clip)
        if args.sleep and iterations > args.sleep_from:
            time.sleep(args.sleep)
        committed = ft.step()
        replicas = ft.num_replicas if committed else 0
        if first_full is None and replicas >= args.until_replicas:
            first_full = ft.current_step
        optimizer.zero_grad()
        record = json.dumps({"pid": os.getpid(), "step": ft.current_step, "committed": committed,
                             "replicas": ft.num_replicas, "loss": loss.item(), "seconds": time.perf_counter() - t0,
                             "t": time.time(), "batches": batches, "participant": participant,
                             "grad_norm": grad_norm.item()})
        log.write(record + "\n")
        if dist.get_rank() == 0:
            print(record, flush=True)  # what `local-cluster --kill-when` watches
        if args.ckpt and args.save_every and committed and ft.current_step % args.save_every == 0:
            ft.save_checkpoint(os.path.join(args.ckpt, f"step_{ft.current_step:08d}"))
    if syncs is not None:  # before check_replicas and full_state_dict, which sync between steps
        steady = {kind: [[*key, n] for key, n in sorted(getattr(syncs, kind).items())] for kind in ("hot", "exempt")}
    compared = ft.check_replicas()
    state = hs.full_state_dict(model)  # collective in the group
    if dist.get_rank() == 0:
        torch.save(state, args.out + ".state.pt")
    with open(args.out + ".done", "w") as f:
        json.dump({"digest": digest(model, optimizer), "compared": compared, "step": ft.current_step,
                   "seconds": time.perf_counter() - started,
                   "loss_finite": math.isfinite(loss.item()), "host_syncs": steady}, f)
    ft.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
