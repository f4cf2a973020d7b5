"""A short finished job, run once per rank by ``tests/test_shutdown.py``: every rank must exit 0.

Shards the runtime tests' model FULL_SHARD over the job, saves a checkpoint and loads it back, trains
two steps (gradient overlap on, the default), prints ``RESULT {json}`` and leaves. Options isolate
what a shutdown depends on::

    python tests/shutdown_job.py CKPT_DIR [--no-load] [--no-destroy] [--no-overlap] [--impl hs|fsdp1|fsdp2]

``--impl fsdp1`` / ``fsdp2`` run the same steps under torch's own FSDP (with DCP's ``save``/``load`` of
the model's state dict), for comparison.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import hybridshard as hs  # noqa: E402
from tests import runtime_models as RM  # noqa: E402
from tests.mp import print_result  # noqa: E402


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("checkpoint_dir")
    p.add_argument("--no-load", action="store_true", help="skip the save and load")
    p.add_argument("--no-destroy", action="store_true", help="leave without destroy_process_group()")
    p.add_argument("--no-overlap", action="store_true", help="shard(..., overlap_grads=False)")
    p.add_argument("--impl", choices=("hs", "fsdp1", "fsdp2"), default="hs")
    return p.parse_args()


def _shard(model: torch.nn.Module, args: argparse.Namespace) -> torch.nn.Module:
    if args.impl == "hs":
        return hs.shard(model, strategy="FULL_SHARD", wrap={RM.Block}, overlap_grads=not args.no_overlap)
    if args.impl == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({RM.Block}), use_orig_params=True)
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block)
    return fully_shard(model)


def _save_and_load(model: torch.nn.Module, opt: torch.optim.Optimizer, args: argparse.Namespace) -> None:
    path = os.path.join(args.checkpoint_dir, "step_00000000")
    if args.impl == "hs":
        hs.save_checkpoint(path, model, optimizer=opt, extra={"step": 0})
        hs.load_checkpoint(path, model, optimizer=opt)
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=path)
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])


def main() -> None:
    if os.environ.get("SHUTDOWN_FAULTHANDLER"):
        faulthandler.enable(all_threads=True)  # a crash prints every thread's stack
    args = _parse()
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    rank = dist.get_rank()
    torch.set_num_threads(1)
    model = _shard(RM.make_model(num_blocks=2), args)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if not args.no_load:
        _save_and_load(model, opt, args)
    losses = []
    for step in range(2):
        opt.zero_grad()
        tokens = RM.batch(step, 0, rank, 2)
        loss = RM.lm_loss(model(tokens), tokens)
        loss.backward()
        opt.step()
        losses.append(round(float(loss), 6))
    print_result({"rank": rank, "losses": losses})
    if not args.no_destroy:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
