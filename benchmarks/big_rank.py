"""One rank of a 64-GPU job (8 shard groups of 8), Llama-3-8B-shaped, on torch's fake process group.

torch's ``fake`` backend completes every collective at once and returns this rank's own data, and
its store refuses every call, so one process runs exactly what rank 0 of a 64-rank job runs, minus
the communication: the runtime's own work, its memory and the model's compute. The mesh is given
(``init_device_mesh(..., (8, 8), ("replicate", "shard"))``) instead of discovered. The model has
Llama-3-8B's units (hidden 4096, 32 layers, 32 heads with 8 key/value heads, MLP 14336, vocab 128256,
untied head; no rotary embedding), is built on meta and materialised one unit at a time, computes in
bf16 with fp32 masters, checkpoints each layer's activations and steps AdamW. Three systems, one after
the other: HYBRID_SHARD, HYBRID_SHARD with ``shard_optimizer_across_replicas``, and FSDP2's HSDP
(``fully_shard`` over the same 2-D mesh). For each: the step time (median of the timed steps; CUDA
events) and rank 0's peak memory against ``hybridshard.estimates.sizing.memory`` (the planner leaves
out activations: the layer inputs checkpointing keeps and the logits are in the measured peak).

    python benchmarks/big_rank.py                       # on a GPU: the Llama-3-8B shape
    python benchmarks/big_rank.py --stand-in --json o.json  # on CPU: a small model, the same code

``--stand-in`` shrinks the model (hidden 64, 2 layers, vocab 512) and runs on the CPU, where the
peak is the live tensor bytes the main thread allocates (``hybridshard.bench.live_bytes``; the stream
executor, so no other thread allocates). Without ``--stand-in`` and without a CUDA device it prints
why and exits 0.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # after an installed hybridshard

import hybridshard as hs  # noqa: E402
from hybridshard.estimates.sizing import ModelSpec, memory  # noqa: E402
from hybridshard.runtime.units.strategy import ShardingStrategy  # noqa: E402

WORLD, SHARD = 64, 8


@dataclass(frozen=True)
class Shape:
    """A Llama decoder stack and its batch: sizes of the hidden state, layers, heads (query and key/value),
    the MLP, the vocabulary, and the sequence and batch of one step."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq: int
    batch: int


LLAMA_3_8B = Shape(hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336, vocab=128256, seq=1024, batch=1)
STAND_IN = Shape(hidden=64, layers=2, heads=4, kv_heads=2, ffn=176, vocab=512, seq=32, batch=2)


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, eps=1e-5)


class Layer(nn.Module):
    """A Llama decoder layer: grouped-query attention and a SwiGLU MLP, pre-norm, no biases."""

    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.heads, self.kv_heads, head_dim = s.heads, s.kv_heads, s.hidden // s.heads
        self.attn_norm, self.mlp_norm = RMSNorm(s.hidden), RMSNorm(s.hidden)
        self.q = nn.Linear(s.hidden, s.hidden, bias=False)
        self.kv = nn.Linear(s.hidden, 2 * s.kv_heads * head_dim, bias=False)
        self.o = nn.Linear(s.hidden, s.hidden, bias=False)
        self.gate_up = nn.Linear(s.hidden, 2 * s.ffn, bias=False)
        self.down = nn.Linear(s.ffn, s.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        h = self.attn_norm(x)
        q = self.q(h).view(b, n, self.heads, -1).transpose(1, 2)  # (b, heads, n, hd)
        k, v = self.kv(h).view(b, n, 2, self.kv_heads, -1).permute(2, 0, 3, 1, 4)  # 2 x (b, kv, n, hd)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(att.transpose(1, 2).reshape(b, n, d))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class Llama(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.embed = nn.Embedding(s.vocab, s.hidden)
        self.layers = nn.ModuleList(Layer(s) for _ in range(s.layers))
        self.norm = RMSNorm(s.hidden)
        self.head = nn.Linear(s.hidden, s.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:  # activation checkpointing around every layer
            x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
        return self.head(self.norm(x))  # (b, n, vocab)


def planned(s: Shape, sliced: bool) -> int:
    with torch.device("meta"):
        model = Llama(s)
    layer = sum(p.numel() for p in model.layers[0].parameters())
    total = sum(p.numel() for p in model.parameters())
    spec = ModelSpec(num_params=total, unit_params=layer, root_params=total - s.layers * layer,
                     param_dtype="bf16", reduce_dtype="fp32")
    return memory(ShardingStrategy.HYBRID_SHARD, SHARD, model=spec, replicate_size=WORLD // SHARD,
                  shard_optimizer=sliced).total


def hybridshard_model(s: Shape, mesh, device: torch.device, sliced: bool) -> nn.Module:
    with torch.device("meta"):
        model = Llama(s)
    mp = hs.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return hs.shard(model, strategy="HYBRID_SHARD", mesh=mesh, wrap={Layer}, device=device, mixed_precision=mp,
                    executor="streams", shard_optimizer_across_replicas=sliced)


def fsdp2_model(s: Shape, mesh, device: torch.device) -> nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    with torch.device("meta"):
        model = Llama(s)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    model.to_empty(device=device)
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()
    return model


def train(s: Shape, model: nn.Module, device: torch.device, steps: int, warmup: int) -> dict:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, s.vocab, (s.batch, s.seq + 1), generator=g).to(device)
    times = []
    for i in range(warmup + steps):
        cuda = device.type == "cuda"
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.float().reshape(-1, s.vocab), tokens[:, 1:].reshape(-1)).backward()
        opt.step()
        if cuda:
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
        else:
            ms = (time.perf_counter() - t0) * 1e3
        if i >= warmup:
            times.append(ms)
    return {"step_ms": statistics.median(times)}


def measure(name: str, s: Shape, mesh, device: torch.device, steps: int, warmup: int) -> dict:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        model = build(name, s, mesh, device)
        got = train(s, model, device, steps, warmup)
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before
    else:
        from hybridshard.bench.live_bytes import LiveTensorBytes

        with LiveTensorBytes() as live, live.counting_resizes():
            model = build(name, s, mesh, device)
            got = train(s, model, device, steps, warmup)
        peak = live.peak()
    del model
    got["peak_bytes"] = peak
    if name != "fsdp2":
        got["planned_bytes"] = planned(s, sliced=name == "sliced")
        got["ratio"] = peak / got["planned_bytes"]
    return got


def build(name: str, s: Shape, mesh, device: torch.device) -> nn.Module:
    if name == "fsdp2":
        return fsdp2_model(s, mesh, device)
    return hybridshard_model(s, mesh, device, sliced=name == "sliced")


class _StoreCalls(logging.Handler):
    """Counts the runtime's failed store calls (each logged at DEBUG by hybridshard.runtime.faults.peers)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.failed = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.failed += "store" in record.getMessage() or "ask" in record.getMessage()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stand-in", action="store_true", help="a small model on the CPU (the same code path)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--systems", default="hybrid,sliced,fsdp2")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args()
    if not args.stand_in and not torch.cuda.is_available():
        print("big_rank: skipped: no CUDA device on this machine (--stand-in runs a small model on the CPU)")
        return 0
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from hybridshard.runtime.faults import peers

    s = STAND_IN if args.stand_in else LLAMA_3_8B
    device = torch.device("cpu") if args.stand_in else torch.device("cuda", 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store_calls = _StoreCalls()
    peers_log = logging.getLogger(peers.__name__)
    peers_log.addHandler(store_calls)
    peers_log.setLevel(logging.DEBUG)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    try:
        mesh = init_device_mesh(device.type, (WORLD // SHARD, SHARD), mesh_dim_names=("replicate", "shard"))
        results = {name: measure(name, s, mesh, device, args.steps, args.warmup) for name in args.systems.split(",")}
        results["store"] = {"found": peers.store() is not None, "failed_calls": store_calls.failed}
    finally:
        dist.destroy_process_group()
    where = "CPU stand-in " if args.stand_in else f"{torch.cuda.get_device_name(device)} "
    shape = f"hidden {s.hidden} x {s.layers} layers, vocab {s.vocab}, batch {s.batch}x{s.seq}"
    parts = []
    for name in ("hybrid", "sliced"):
        if name in results:
            r = results[name]
            parts.append(f"{name} peak {r['peak_bytes'] / 2**20:.1f} MiB / planned {r['planned_bytes'] / 2**20:.1f} "
                         f"MiB = {r['ratio']:.3f}, {r['step_ms']:.1f} ms/step")
    if "fsdp2" in results:
        f2 = results["fsdp2"]
        parts.append(f"fsdp2 HSDP {f2['step_ms']:.1f} ms/step, peak {f2['peak_bytes'] / 2**20:.1f} MiB")
        if "hybrid" in results:
            parts.append(f"step ratio hybrid/fsdp2 {results['hybrid']['step_ms'] / f2['step_ms']:.3f}")
    print(f"figures: {where}rank 0 of {WORLD} ({WORLD // SHARD}x{SHARD} fake mesh), {shape}: " + "; ".join(parts))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": asdict(s), **results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
