"""Meta init, pretrained load and export on CUDA, run under torchrun by ``tests/test_cuda.py`` (needs a GPU).

Rank 0 saves a tiny Llama with transformers (safetensors, several files and an index); every rank
builds it under ``torch.device("meta")``, shards it on its GPU (``FULL_SHARD`` over the job),
loads the checkpoint with ``hs.load_pretrained`` and compares the logits with ``from_pretrained``
on the CPU; then ``hs.save_pretrained`` and ``from_pretrained`` of the export. Rank 0 writes a JSON
summary (max differences, bytes read, CUDA memory of the init) to ``--out``; a mismatch raises.

    torchrun --standalone --nproc-per-node 1 tests/cuda_large_job.py --backend nccl --dir D --out summary.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # after an installed hybridshard

import hybridshard as hs  # noqa: E402
from tests import hf_models as HF  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", required=True)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    dist.init_process_group(args.backend)
    rank = dist.get_rank()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    pretrained = os.path.join(args.dir, "pretrained")
    if rank == 0:
        model, _ = HF.make_model("llama", seed=3)
        model.save_pretrained(pretrained, max_shard_size="10KB")
    dist.barrier()
    groups = hs.init_groups()
    device = groups.device or torch.device("cuda", torch.cuda.current_device())
    with torch.device("meta"):
        model, layer = HF.make_model("llama")
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    hs.shard(model, strategy="FULL_SHARD", wrap={layer}, device=device, param_init_fn=model._init_weights)
    init_peak = torch.cuda.max_memory_allocated() - before
    on_device = all(t.device == device for t in (*model.parameters(), *model.buffers()))
    result = hs.load_pretrained(model, pretrained)
    inputs = HF.batch(7, 0, 2)
    model.eval()
    with torch.no_grad():
        logits = model(**{k: v.to(device) for k, v in inputs.items()}).logits.cpu()
    export = os.path.join(args.dir, "export")
    hs.save_pretrained(model, export, config=model.config)
    if rank == 0:
        from transformers import AutoModelForCausalLM

        with torch.no_grad():
            ref = AutoModelForCausalLM.from_pretrained(pretrained).eval()(**inputs).logits
            back = AutoModelForCausalLM.from_pretrained(export).eval()(**inputs).logits
        units = model.hybridshard_runtime.units
        summary = {
            "device": str(device), "on_device": on_device, "world": dist.get_world_size(),
            "load_max_diff": (logits - ref).abs().max().item(), "export_max_diff": (back - ref).abs().max().item(),
            "bytes_read": result.bytes_read, "bytes_unstriped": result.bytes_unstriped, "bytes_model": result.bytes_model,
            "init_peak_cuda_bytes": init_peak,
            "shards_bytes": sum(u.flat.layout.shard_numel * 4 for u in units),
            "unit_bytes": max(u.flat.layout.padded_numel * 4 for u in units),
            "init_tensors": len(list(model.parameters())) + len(list(model.buffers())),
        }
        with open(args.out, "w") as f:
            json.dump(summary, f)
        if not on_device or summary["load_max_diff"] > 1e-4 or summary["export_max_diff"] > 1e-4:
            raise SystemExit(f"mismatch: {summary}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
