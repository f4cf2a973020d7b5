"""Fine-tune a pretrained Llama that no rank builds whole: meta init, weights read into the shards,
training, a sharded checkpoint, and an export that ``from_pretrained`` reads in one process.

    python examples/finetune_llama.py --workdir /tmp/ft            # spawns 2 simulated nodes x 2 ranks
    hybridshard launch --nproc-per-node 4 examples/finetune_llama.py --workdir /tmp/ft

1. Rank 0 writes a tiny Llama with transformers' ``save_pretrained`` (safetensors, several files and
   an index) into ``WORKDIR/pretrained``, standing in for a downloaded checkpoint (no download).
2. Every rank builds the model from its config under ``torch.device("meta")`` and shards it with
   ``HYBRID_SHARD``; ``shard`` allocates only the rank's shards (``param_init_fn=model._init_weights``
   gives the non-persistent rotary buffers their values).
3. ``hs.load_pretrained`` reads each rank's stripe of its shards; the logits equal those of
   ``from_pretrained`` in one process.
4. A few AdamW steps on ``hs.param_groups`` (no weight decay for norms), ``hs.save_checkpoint``.
5. ``hs.save_pretrained`` exports the result; rank 0 reloads it with ``from_pretrained`` and checks
   that its logits equal the sharded model's. Prints one JSON line with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch
import torch.distributed as dist

import hybridshard as hs

VOCAB, SEQ = 128, 16


def tiny_llama(path: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2 * SEQ,
                         tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    LlamaForCausalLM(config).save_pretrained(path, max_shard_size="40KB")


def batch(step: int, rank: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    first = torch.randint(3, VOCAB, (4, 1), generator=g)
    ids = torch.cat([(first * (i + 1)) % (VOCAB - 3) + 3 for i in range(SEQ)], dim=1)
    return {"input_ids": ids, "labels": ids}


def logits_of(model: torch.nn.Module) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        out = model(input_ids=batch(99, 0)["input_ids"]).logits
    model.train()
    return out


def main(args: argparse.Namespace) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    pretrained = os.path.join(args.workdir, "pretrained")
    if rank == 0 and not os.path.exists(pretrained):
        tiny_llama(pretrained)
    dist.barrier()

    config = AutoConfig.from_pretrained(pretrained)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    hs.shard(model, strategy="HYBRID_SHARD", groups=hs.init_groups(), wrap={LlamaDecoderLayer},
             param_init_fn=model._init_weights)
    loaded = hs.load_pretrained(model, pretrained)
    loaded_logits = logits_of(model)

    opt = torch.optim.AdamW(hs.param_groups(model, weight_decay=0.1), lr=3e-3)
    losses = []
    for step in range(args.steps):
        loss = model(**batch(step, rank)).loss
        loss.backward()
        hs.clip_grad_norm_(model, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        total = loss.detach().reshape(1)
        dist.all_reduce(total)
        losses.append(round(total.item() / dist.get_world_size(), 4))
    hs.save_checkpoint(os.path.join(args.workdir, "ckpt", f"step_{args.steps:08d}"), model, optimizer=opt,
                       extra={"step": args.steps})
    trained_logits = logits_of(model)
    export = os.path.join(args.workdir, "export")
    hs.save_pretrained(model, export, config=model.config)

    if rank == 0:
        torch.set_num_threads(1)
        with torch.no_grad():
            plain = AutoModelForCausalLM.from_pretrained(pretrained).eval()
            before = (plain(input_ids=batch(99, 0)["input_ids"]).logits - loaded_logits).abs().max().item()
            back = AutoModelForCausalLM.from_pretrained(export).eval()
            after = (back(input_ids=batch(99, 0)["input_ids"]).logits - trained_logits).abs().max().item()
        print(json.dumps({
            "losses": losses, "bytes_read_rank0": loaded.bytes_read, "bytes_unstriped_rank0": loaded.bytes_unstriped,
            "bytes_model": loaded.bytes_model, "load_max_logit_diff": before, "export_max_logit_diff": after,
        }), flush=True)
        if before > 1e-5 or after > 1e-5:
            raise SystemExit(f"logits differ: after load {before}, after export {after}")
    dist.destroy_process_group()


def spawn(argv: list[str], script: str = __file__, env: dict[str, str] | None = None) -> int:
    """Run ``script`` (this one by default) as 2 simulated nodes x 2 ranks on this machine (what torchrun
    would set, plus ``env``)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(4):
        rank_env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "4", "LOCAL_RANK": str(rank % 2),
                    "LOCAL_WORLD_SIZE": "2", "HYBRIDSHARD_NODE_NAME": f"node{rank // 2}", "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "GROUP_RANK": str(rank // 2), **(env or {})}
        procs.append(subprocess.Popen([sys.executable, script, *argv], env=rank_env))
    codes = [p.wait(timeout=600) for p in procs]
    return max(codes, key=abs)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--steps", type=int, default=5)
    parsed = parser.parse_args()
    if "RANK" not in os.environ:
        sys.exit(spawn(sys.argv[1:]))
    main(parsed)
