"""``hybridshard bench``: hybridshard against PyTorch FSDP1, FSDP2 and a no-communication floor.

    hybridshard bench                                   # 2 nodes x 2 ranks on loopback, HYBRID_SHARD
    hybridshard bench --strategy hybrid_shard_zero2 --inter-node-bandwidth 100mbit
    hybridshard bench --variants hybridshard,hybridshard:prefetch=0 --systems hybridshard,fsdp1
    hybridshard bench --compile --nodes 1                # eager and compiled hybridshard, FSDP2 + compile
    hybridshard bench --racks 2 --nodes 4 --nproc-per-node 1 --inter-node-bandwidth 1gbit --spine-rate 250mbit

The command starts the job itself (see [Note: bench job] in :mod:`hybridshard.bench.job`), waits,
then prints the table (or ``--json``) from ``OUT/bench.json``; the chart is ``OUT/bench.png``. Under
an existing launcher (``torchrun ... -m hybridshard bench --worker ...``) every process is one rank,
and rank 0 writes the files and prints the table. Method: docs/performance.md, "Benchmark".
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from hybridshard.bench.config import DEFAULT_SYSTEMS, BenchConfig, Contestant, System, contestants, parse_variant

logger = logging.getLogger(__name__)

_STRATEGIES = ("hybrid_shard", "hybrid_shard_zero2")
_DEFAULT_SYSTEMS = ",".join(s.value for s in DEFAULT_SYSTEMS)
# Options every rank needs, as (dest, flag): the job passes them on to the workers unchanged.
_PASSED_ON = (("strategy", "--strategy"), ("systems", "--systems"), ("variants", "--variants"),
              ("steps", "--steps"), ("warmup", "--warmup"), ("rounds", "--rounds"), ("d_model", "--d-model"),
              ("layers", "--layers"), ("heads", "--heads"), ("seq", "--seq"), ("batch", "--batch"),
              ("vocab", "--vocab"), ("lr", "--lr"), ("seed", "--seed"), ("timeout", "--timeout"),
              ("inter_node_bandwidth", "--inter-node-bandwidth"), ("out", "--out"), ("racks", "--racks"),
              ("spine_rate", "--spine-rate"), ("shard_nodes", "--shard-nodes"))


def _bandwidth(value: str) -> str | None:
    return None if value.strip().lower() in ("", "none", "loopback") else value.strip()


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("bench", help="benchmark hybridshard against FSDP1, FSDP2 and a no-communication floor",
                              description="hybridshard against PyTorch FSDP1, FSDP2 and a no-communication floor: "
                                          "the same model, groups and data, interleaved in rounds in one job.",
                              formatter_class=argparse.RawDescriptionHelpFormatter,
                              epilog="examples:\n" + __doc__.split("\n\n")[1] + "\n\nMethod and measured figures: "
                                     "docs/performance.md")
    p.add_argument("--strategy", type=str.lower, choices=_STRATEGIES, default="hybrid_shard",
                   help="hybrid_shard (ZeRO-3 in the node, default) or hybrid_shard_zero2")
    p.add_argument("--systems", default=_DEFAULT_SYSTEMS,
                   help="comma-separated, from hybridshard, fsdp1, fsdp2, floor (default: all four)")
    p.add_argument("--variants", default="hybridshard",
                   help="the hybridshard contestants, comma-separated, each hybridshard[:key=value:...] with "
                        "hybridshard.shard() options, e.g. hybridshard,hybridshard:prefetch=0 (default: hybridshard)")
    p.add_argument("--steps", type=int, default=3, help="timed steps of each system per round (default 3)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps of each system first (default 2)")
    p.add_argument("--rounds", type=int, default=3, help="rounds, the order rotated each round (default 3)")
    p.add_argument("--d-model", type=int, default=256, help="model width (default 256)")
    p.add_argument("--layers", type=int, default=6, help="transformer blocks (default 6)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    p.add_argument("--seq", type=int, default=64, help="sequence length (default 64)")
    p.add_argument("--batch", type=int, default=8, help="global batch in sequences, split over the ranks (default 8)")
    p.add_argument("--vocab", type=int, default=256, help="vocabulary size (default 256)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--nodes", type=int, default=2, help="nodes (agents on loopback, or hosts) (default 2)")
    p.add_argument("--nproc-per-node", type=int, default=2, help="ranks per node (default 2)")
    p.add_argument("--inter-node-bandwidth", type=_bandwidth, default=None, metavar="RATE",
                   help="run on launch/local-cluster with each host's link shaped to RATE (1gbit, 100mbit; "
                        "needs root); none (default): loopback")
    p.add_argument("--out", default="bench-results", help="directory for bench.json and bench.png (default ./bench-results)")
    p.add_argument("--json", action="store_true", help="print the JSON document instead of the table")
    p.add_argument("--timeout", type=float, default=1800.0,
                   help="seconds before the job is stopped, and the process-group timeout (default 1800)")
    p.add_argument("--compile", action="store_true",
                   help="compile: every hybridshard variant also runs with compile=True, FSDP2 compiles each block; "
                        "--systems defaults to hybridshard,fsdp2; compile time, frames, graph breaks and recompiles "
                        "are reported apart from step times")
    p.add_argument("--racks", type=int, default=None, metavar="P",
                   help="the replicate reduction's forms on P racks behind a spine (local-cluster, root): flat in a "
                        "rack-interleaved order, flat in network order, two hops, rack_reduce=None, FSDP2; spine bytes "
                        "from the uplinks' counters (docs/performance.md, 'Above the node')")
    p.add_argument("--spine-rate", default=None, metavar="RATE",
                   help="(with --racks) each rack's uplink to the spine (default: a quarter of --inter-node-bandwidth)")
    p.add_argument("--shard-nodes", type=int, default=None, metavar="K",
                   help="one shard group over K nodes: flat, two hops, two hops + the node-local secondary shard, FSDP2 "
                        "(local-cluster, root); bytes from the hosts' link counters")
    p.add_argument("--worker", action="store_true",
                   help="be one rank of a job already started (torchrun): rank 0 writes the files and prints")
    p.add_argument("--from-job", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(func=run)


def _split(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _variants(text: str) -> list[str]:
    """Split at the commas that start a new ``hybridshard``; the others separate one variant's options."""
    out: list[str] = []
    for part in _split(text):
        if part.lower().startswith(System.HYBRIDSHARD.value) or not out:
            out.append(part)
        else:
            out[-1] += "," + part
    return out


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """The :class:`BenchConfig` the options describe; ``ValueError`` names the bad option."""
    compiled = getattr(args, "compile", False)
    if compiled and args.systems == _DEFAULT_SYSTEMS:
        args.systems = f"{System.HYBRIDSHARD.value},{System.FSDP2.value}"
    systems = [System.parse(s) for s in _split(args.systems)]
    variants = [parse_variant(v) for v in _variants(args.variants)] if System.HYBRIDSHARD in systems else []
    if compiled:  # each variant eager and compiled, side by side
        listed = {c.name for c in variants}
        more = [Contestant(c.system, c.options + (("compile", True),))
                for c in variants if "compile" not in dict(c.options)]
        variants += [c for c in more if c.name not in listed]
    if System.HYBRIDSHARD in systems and not variants:
        raise ValueError("--variants is empty but --systems lists hybridshard; pass e.g. --variants hybridshard")
    return BenchConfig(
        strategy=args.strategy.upper(), contestants=tuple(contestants(systems, variants)), steps=args.steps,
        warmup=args.warmup, rounds=args.rounds, d_model=args.d_model, layers=args.layers, heads=args.heads,
        seq=args.seq, batch=args.batch, vocab=args.vocab, lr=args.lr, seed=args.seed, timeout_s=args.timeout,
        compile=compiled,
    )


def _worker_args(args: argparse.Namespace) -> list[str]:
    out: list[str] = []
    for dest, flag in _PASSED_ON:
        value = getattr(args, dest)
        if value is not None:
            out += [flag, os.path.abspath(value) if dest == "out" else str(value)]
    return out + (["--compile"] if args.compile else [])


def _link(args: argparse.Namespace) -> str:
    if args.inter_node_bandwidth:
        return f"{args.inter_node_bandwidth} inter-node links (local-cluster, tc)"
    return "loopback (agents as nodes)" if args.from_job else "as launched"


def run(args: argparse.Namespace) -> int:
    try:
        cfg = config_from_args(args)
        if not args.worker:
            cfg.check_world(args.nodes * args.nproc_per_node)
    except ValueError as exc:
        print(f"hybridshard bench: error: {exc}", file=sys.stderr)
        return 2
    if args.racks is not None or args.shard_nodes is not None:
        from hybridshard.bench.rack_job import run_racks

        return run_racks(args, cfg)
    if args.worker:
        from hybridshard.bench.worker import run_worker

        run_worker(cfg, os.path.abspath(args.out), link=_link(args), from_job=args.from_job,
                   print_report=not args.from_job)
        return 0
    return _run_job(args)


def _run_job(args: argparse.Namespace) -> int:
    from hybridshard.bench.job import JobSpec, run_job, worker_command
    from hybridshard.bench.report import print_results, render_text
    from hybridshard.bench.worker import JSON_NAME, PNG_NAME

    out = os.path.abspath(args.out)
    result_path = os.path.join(out, JSON_NAME)
    if os.path.exists(result_path):
        os.remove(result_path)  # a failed job must not leave an older run's results looking new
    try:
        spec = JobSpec(args.nodes, args.nproc_per_node, worker_command(_worker_args(args)),
                       inter_node_bandwidth=args.inter_node_bandwidth, timeout_s=args.timeout + 60)
        rc = run_job(spec)
    except (ValueError, PermissionError) as exc:
        print(f"hybridshard bench: error: {exc}", file=sys.stderr)
        return 2
    return print_results(rc, result_path, render_text, as_json=args.json, also=os.path.join(out, PNG_NAME))
