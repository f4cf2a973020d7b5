"""One rank of a 256-GPU job (32 nodes x 8) with shard groups over k nodes, 405B-shaped, on torch's fake process group.

The same method as ``benchmarks/big_rank.py`` (whose model, training loop and store check this script
imports): torch's ``fake`` backend completes every collective at once with this rank's own data, so
one process runs what rank 0 of the job runs, minus the communication. The groups are the planner's:
``plan_groups(synthetic_cluster(32, 8, racks=4), shard_size=8 * k)`` and ``build_groups`` (the shard
group's two hops, across nodes and inside the node, included), with ``k = --shard-nodes`` (2: 16 shard
groups of 16, 16 replicas). The model has Llama-3.1-405B's units (hidden 16384, 126 layers, 128 heads
with 8 key/value heads, MLP 53248, vocab 128256, untied head; no rotary embedding), cut to
``--layers``; bf16 compute and reduction (``--reduce-dtype``), fp32 masters, AdamW, every layer
checkpointed. Settings, one after the other, each a fresh model:

- ``two``: HYBRID_SHARD, the shard group in two hops (``two_hop=True``)
- ``node``: the same with the node-local secondary shard (``reshard_after_forward="node"``)
- ``sliced``: two hops with the optimizer across replicas (``shard_optimizer_across_replicas=True``)
- ``flat``: one flat ring over the shard group (``two_hop=False``; not in the default list)

For each: rank 0's peak against the planner's figure for the same setting
(:func:`hybridshard.estimates.multinode.node_settings`: ``NodeSetting.peak``, the secondary shard
included; activations are left out by the planner and are in the measured peak).

    python benchmarks/big_rank_nodes.py                 # on a GPU: the layers that fit it (below)
    python benchmarks/big_rank_nodes.py --cpu --narrow 4 --layers 4 --seq 16   # on CPU, ~6 GiB
    python benchmarks/big_rank_nodes.py --stand-in      # on CPU: big_rank's small model, seconds

[Note: how many layers on one GPU]
All 126 layers do not fit one GPU: every layer adds 4 bytes x 4 (master, gradient, two AdamW moments)
over the 16-rank shard group, 3.2 GB, and the secondary shard 0.8 GB more, beside the 8.4 GB root
(embedding and head) gathered from forward into backward and two 6.4 GB layers gathered with their
gradients. Without ``--layers`` on a GPU the script takes the most layers whose largest planned peak
over the asked settings stays within 85 % of the device's memory (the rest for the logits, the
checkpointed inputs and the allocator): 19 on a 141 GB H200, 6 on an 80 GB H100 (bf16 compute and reduction).

On CPU (``--cpu``) the real layer shape does not fit a small machine (one full-width layer plans 37.7
GiB), so ``--narrow D`` divides the hidden size, the heads and the MLP by ``D`` (head size 128, the 8
key/value heads and the vocabulary kept), and the peak is the live tensor bytes of the main thread
(``hybridshard.bench.live_bytes``; the stream executor, so no other thread allocates). torch's CPU
AdamW steps one parameter at a time, so the planner's figure there leaves out the foreach step's
temporary (``sizing.memory(foreach=False)``). Without ``--cpu``/``--stand-in`` and without a CUDA
device it prints why and exits 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from big_rank import STAND_IN, Layer, Llama, Shape, _StoreCalls, train  # noqa: E402  (also puts the checkout on the path)

import hybridshard as hs  # noqa: E402
from hybridshard.estimates.multinode import NodeSetting, node_settings  # noqa: E402
from hybridshard.estimates.sizing import ClusterSpec, ModelSpec, memory  # noqa: E402
from hybridshard.runtime.units.strategy import ShardingStrategy  # noqa: E402

NODES, GPUS_PER_NODE, RACKS = 32, 8, 4
WORLD = NODES * GPUS_PER_NODE
LLAMA_405B = Shape(hidden=16384, layers=126, heads=128, kv_heads=8, ffn=53248, vocab=128256, seq=1024, batch=1)
SETTINGS = ("two", "node", "sliced", "flat")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
GPU_FRACTION = 0.85
"""Share of the device's memory the largest planned peak may take when the layers are chosen; see
[Note: how many layers on one GPU]."""


def narrowed(s: Shape, div: int) -> Shape:
    """``s`` with the hidden size, the query heads and the MLP divided by ``div`` (head size kept)."""
    if div < 1 or s.heads % div or s.hidden % div or s.ffn % div or s.heads // div < s.kv_heads:
        raise ValueError(f"--narrow expects a divisor of the heads ({s.heads}) leaving at least the {s.kv_heads} "
                         f"key/value heads, found {div}; pass 1, 2, 4, 8 or 16")
    return dataclasses.replace(s, hidden=s.hidden // div, heads=s.heads // div, ffn=s.ffn // div)


def model_spec(s: Shape, reduce_dtype: str, param_dtype: str = "bf16") -> ModelSpec:
    with torch.device("meta"):
        model = Llama(s)
    layer = sum(p.numel() for p in model.layers[0].parameters())
    total = sum(p.numel() for p in model.parameters())
    return ModelSpec(num_params=total, unit_params=layer, root_params=total - s.layers * layer,
                     param_dtype=param_dtype, reduce_dtype=reduce_dtype)


def planned_setting(s: Shape, k: int, name: str, reduce_dtype: str, param_dtype: str = "bf16") -> NodeSetting:
    """The planner's row for ``name`` with shard groups of ``k`` nodes (``flat`` plans as ``two``: the
    hops change the bytes across nodes, not the memory the planner counts)."""
    cluster = ClusterSpec(node_sizes=(GPUS_PER_NODE,) * NODES, gpu_memory_bytes=80 * 10**9)
    rows = node_settings(model=model_spec(s, reduce_dtype, param_dtype), cluster=cluster, rack_sizes=(NODES // RACKS,) * RACKS)
    want = (k, name == "sliced", name == "node")
    [row] = [r for r in rows if (r.nodes, r.shard_optimizer, r.secondary) == want]
    return row


def planned_peak(row: NodeSetting, foreach: bool) -> int:
    """``row.peak``; with ``foreach=False`` (torch's AdamW on CPU) without the step's temporary."""
    m = row.memory
    temp = m.step_temp if foreach else 0
    return m.params + m.grads + m.optimizer + max(m.gathered + row.secondary_bytes + row.hop_bytes, m.root_backward, temp)


def layers_that_fit(s: Shape, k: int, names: list[str], dtypes: tuple[str, str], device_bytes: int) -> int:
    """The most layers (up to the shape's) whose largest planned peak over ``names`` stays within
    ``GPU_FRACTION`` of ``device_bytes``; see [Note: how many layers on one GPU]."""
    best = 0
    for n in range(1, s.layers + 1):
        cut = dataclasses.replace(s, layers=n)
        if max(planned_setting(cut, k, name, dtypes[1], dtypes[0]).peak for name in names) > GPU_FRACTION * device_bytes:
            break
        best = n
    if best == 0:
        raise ValueError(f"expected a device that holds at least one layer of this shape within {GPU_FRACTION:.0%} "
                         f"of its memory, found {device_bytes / 2**30:.1f} GiB; pass --narrow or a smaller --shard-nodes")
    return best


def make_groups(k: int):
    from hybridshard.topology.groups import build_groups
    from hybridshard.topology.planner import plan_groups
    from hybridshard.topology.synthetic import synthetic_cluster

    plan = plan_groups(synthetic_cluster(num_nodes=NODES, gpus_per_node=GPUS_PER_NODE, racks=RACKS),
                       shard_size=GPUS_PER_NODE * k)
    groups = build_groups(plan)
    if k > 1 and groups.shard_hops is None:
        raise RuntimeError(f"shard groups of {k} nodes came without their two hops; plan {plan}")
    return groups


def build(name: str, s: Shape, groups, device: torch.device, compute: torch.dtype, reduce: torch.dtype) -> torch.nn.Module:
    with torch.device("meta"):
        model = Llama(s)
    mp = hs.MixedPrecision(param_dtype=compute, reduce_dtype=reduce)
    return hs.shard(model, strategy="HYBRID_SHARD", groups=groups, wrap={Layer}, device=device, mixed_precision=mp,
                    executor="streams", shard_optimizer_across_replicas=name == "sliced", rack_reduce=False,
                    two_hop=name != "flat", reshard_after_forward="node" if name == "node" else None)


def measure(name: str, s: Shape, k: int, groups, device: torch.device, dtypes: tuple[str, str], steps: int,
            warmup: int) -> dict:
    param_dtype, reduce_dtype = dtypes
    compute, reduce = (DTYPES[d] for d in dtypes)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        model = build(name, s, groups, device, compute, reduce)
        got = train(s, model, device, steps, warmup)
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before
    else:
        from hybridshard.bench.live_bytes import LiveTensorBytes

        with LiveTensorBytes() as live, live.counting_resizes():
            model = build(name, s, groups, device, compute, reduce)
            got = train(s, model, device, steps, warmup)
        peak = live.peak()
    held = sum(u.secondary is not None for u in model.hybridshard_runtime.units)
    del model
    row = planned_setting(s, k, name, reduce_dtype, param_dtype)
    got.update(peak_bytes=peak, planned_bytes=planned_peak(row, foreach=device.type == "cuda"),
               secondary_planned_bytes=row.secondary_bytes, hop_planned_bytes=row.hop_bytes,
               secondary_held_after_step=held)
    got["ratio"] = peak / got["planned_bytes"]
    return got


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = p.add_mutually_exclusive_group()
    where.add_argument("--stand-in", action="store_true", help="big_rank's small model on the CPU (the same code path)")
    where.add_argument("--cpu", action="store_true", help="the 405B shape (see --narrow) on the CPU")
    p.add_argument("--shard-nodes", type=int, default=2, help="k: nodes per shard group (a divisor of 32 racks' 8)")
    p.add_argument("--layers", type=int, help="layers kept (default: on a GPU the most that fit, on CPU 2)")
    p.add_argument("--narrow", type=int, default=1, help="divide hidden size, heads and MLP by this (CPU runs)")
    p.add_argument("--seq", type=int, help="tokens per sequence (default: the shape's 1024; 16 on CPU)")
    p.add_argument("--batch", type=int, help="sequences per step (default: the shape's)")
    p.add_argument("--vocab", type=int, help="vocabulary (default: the shape's 128256; a small one puts the peak "
                                              "in the layers' backward instead of the root's)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16",
                   help="compute dtype (fp32 on CPU: torch's CPU bf16 weight-gradient matmuls are very slow)")
    p.add_argument("--reduce-dtype", choices=("bf16", "fp32"), help="gradient reduction dtype (default: --dtype)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--systems", default="two,node,sliced", help=f"comma-separated, of {', '.join(SETTINGS)}")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    names = [n for n in args.systems.split(",") if n]
    if not names or not set(names) <= set(SETTINGS):
        p.error(f"--systems expects names from {', '.join(SETTINGS)}, found {args.systems!r}")
    if args.shard_nodes < 2 or (NODES // RACKS) % args.shard_nodes:
        p.error(f"--shard-nodes expects k > 1 dividing the {NODES // RACKS} nodes of a rack, found {args.shard_nodes}")
    args.names = names
    args.reduce_dtype = args.reduce_dtype or args.dtype
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if not (args.stand_in or args.cpu) and not torch.cuda.is_available():
        print("big_rank_nodes: skipped: no CUDA device on this machine (--stand-in or --cpu runs on the CPU)")
        return 0
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from hybridshard.runtime.faults import peers

    k = args.shard_nodes
    device = torch.device("cpu") if (args.stand_in or args.cpu) else torch.device("cuda", 0)
    s = STAND_IN if args.stand_in else narrowed(LLAMA_405B, args.narrow)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        layers = args.layers or layers_that_fit(s, k, args.names, (args.dtype, args.reduce_dtype),
                                                torch.cuda.get_device_properties(device).total_memory)
    else:
        layers = args.layers or (s.layers if args.stand_in else 2)
    s = dataclasses.replace(s, layers=layers, batch=args.batch or s.batch, vocab=args.vocab or s.vocab,
                            seq=args.seq or (s.seq if device.type == "cuda" or args.stand_in else 16))
    store_calls = _StoreCalls()
    peers_log = logging.getLogger(peers.__name__)
    peers_log.addHandler(store_calls)
    peers_log.setLevel(logging.DEBUG)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    try:
        groups = make_groups(k)
        results = {name: measure(name, s, k, groups, device, (args.dtype, args.reduce_dtype), args.steps, args.warmup)
                   for name in args.names}
        results["store"] = {"found": peers.store() is not None, "failed_calls": store_calls.failed}
        results["groups"] = {"shard_size": groups.shard_size, "replicate_size": groups.replicate_size,
                             "two_hops": groups.shard_hops is not None}
    finally:
        dist.destroy_process_group()
    where = "CPU stand-in " if args.stand_in else "CPU " if args.cpu else f"{torch.cuda.get_device_name(device)} "
    shape = (f"hidden {s.hidden} x {s.layers} layers, {s.heads}/{s.kv_heads} heads, MLP {s.ffn}, vocab {s.vocab}, "
             f"batch {s.batch}x{s.seq}, {args.dtype} compute, {args.reduce_dtype} reduce")
    parts = [f"{name} peak {r['peak_bytes'] / 2**20:,.1f} MiB / planned {r['planned_bytes'] / 2**20:,.1f} MiB = "
             f"{r['ratio']:.3f}, {r['step_ms']:.0f} ms/step" for name, r in results.items() if name in SETTINGS]
    print(f"figures: {where}rank 0 of {WORLD} ({NODES} nodes x {GPUS_PER_NODE}, shard groups of {k} nodes: "
          f"{groups.replicate_size}x{groups.shard_size} fake groups), {shape}: " + "; ".join(parts))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": dataclasses.asdict(s), "shard_nodes": k, **results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
