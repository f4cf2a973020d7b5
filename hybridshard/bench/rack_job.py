"""Start ``hybridshard bench --racks``: the local cluster with racks and a shaped spine, one worker per rank.

The job runs on :mod:`hybridshard.launcher.local_cluster` with ``--racks`` (every host's
``HYBRIDSHARD_NETWORK_PATH`` set, each rack's uplink shaped to the spine rate). This process creates the
network, so the uplinks' counters are its own ``/sys/class/net/<tag>-u<j>/statistics/tx_bytes``; the
ranks, in other network namespaces, read them through ``/proc/<this pid>/root`` (see [Note: rack bench
rows] in :mod:`hybridshard.bench.racks`).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from hybridshard.bench.config import BenchConfig
from hybridshard.bench.job import worker_command
from hybridshard.bench.progress import ProgressSink
from hybridshard.bench.report import print_results
from hybridshard.bench.racks import COUNTERS_ENV, RESULT_NAME, render_racks, run_racks_worker
from hybridshard.bench.shard_nodes import RESULT_NAME as SHARD_RESULT, render_shard_nodes, run_shard_nodes_worker
from hybridshard.launcher import local_cluster
from hybridshard.launcher.netns import Shaping, check_rights, run_tag

logger = logging.getLogger(__name__)

__all__ = ["run_racks", "spine_rate"]

_WORKER_ARGS = (("strategy", "--strategy"), ("steps", "--steps"), ("warmup", "--warmup"), ("rounds", "--rounds"),
                ("d_model", "--d-model"), ("layers", "--layers"), ("heads", "--heads"), ("seq", "--seq"),
                ("batch", "--batch"), ("vocab", "--vocab"), ("lr", "--lr"), ("seed", "--seed"),
                ("timeout", "--timeout"), ("inter_node_bandwidth", "--inter-node-bandwidth"), ("out", "--out"),
                ("racks", "--racks"), ("spine_rate", "--spine-rate"), ("shard_nodes", "--shard-nodes"))


def spine_rate(args: argparse.Namespace) -> str:
    """``--spine-rate``, or a quarter of the hosts' rate."""
    if args.spine_rate:
        return args.spine_rate
    rate = Shaping(rate=args.inter_node_bandwidth).rate
    digits = rate.rstrip("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
    return f"{float(digits) / 4:g}{rate[len(digits):]}"


def _check(args: argparse.Namespace, cfg: BenchConfig) -> str | None:
    if args.shard_nodes is not None:
        if args.racks is not None or args.shard_nodes < 2 or args.nodes % args.shard_nodes or args.nproc_per_node < 2:
            return (f"--shard-nodes expects K >= 2 dividing --nodes, at least 2 ranks per node and no --racks, found "
                    f"--shard-nodes {args.shard_nodes} --nodes {args.nodes} --nproc-per-node {args.nproc_per_node}; "
                    "pass e.g. --shard-nodes 2 --nodes 2 --nproc-per-node 2")
    elif args.racks < 2 or args.nodes % args.racks or args.nodes // args.racks < 2:
        return (f"--racks expects at least 2 racks of at least 2 nodes each, found --racks {args.racks} with --nodes "
                f"{args.nodes}; pass e.g. --racks 2 --nodes 4")
    if not args.inter_node_bandwidth:
        return "--racks expects --inter-node-bandwidth (the hosts' links, e.g. 1gbit), found none; pass it"
    reason = check_rights()
    if reason is not None:
        return f"--racks runs on launch/local-cluster, which needs root to create network namespaces: {reason}"
    return None


def run_racks(args: argparse.Namespace, cfg: BenchConfig) -> int:
    """The worker (``--worker``: one rank) or the whole job (start, wait, print the table)."""
    rate = spine_rate(args) if args.racks and (args.inter_node_bandwidth or args.spine_rate) else None
    if args.worker and args.shard_nodes is not None:
        run_shard_nodes_worker(cfg, os.path.abspath(args.out), shard_nodes=args.shard_nodes,
                               node_rate=args.inter_node_bandwidth or "?")
        return 0
    if args.worker:
        run_racks_worker(cfg, os.path.abspath(args.out), spine_rate=rate or "?",
                         node_rate=args.inter_node_bandwidth or "?")
        return 0
    problem = _check(args, cfg)
    if problem is not None:
        print(f"hybridshard bench: error: {problem}", file=sys.stderr)
        return 2
    out = os.path.abspath(args.out)
    name, render = (SHARD_RESULT, render_shard_nodes) if args.shard_nodes is not None else (RESULT_NAME, render_racks)
    result = os.path.join(out, name)
    if os.path.exists(result):
        os.remove(result)
    passed: list[str] = []
    for dest, flag in _WORKER_ARGS:
        value = getattr(args, dest)
        if dest == "spine_rate":
            value = rate
        if value is not None:
            passed += [flag, os.path.abspath(value) if dest == "out" else str(value)]
    tag = run_tag()  # the network this process makes is named after it
    counters = [f"/proc/{os.getpid()}/root/sys/class/net/{tag}-u{j}/statistics/tx_bytes" for j in range(args.racks or 0)]
    opts = local_cluster.ClusterOptions(
        args.nodes, args.nproc_per_node, worker_command(passed), shaping=Shaping(rate=args.inter_node_bandwidth),
        timeout_s=args.timeout + 60, racks=args.racks, spine=Shaping(rate=rate) if args.racks else Shaping())
    saved = dict(os.environ)
    os.environ.update({COUNTERS_ENV: ",".join(counters), "OMP_NUM_THREADS": "1", "TORCH_CPP_LOG_LEVEL": "ERROR",
                       "PYTHONUNBUFFERED": "1"})
    sink = ProgressSink(sys.stderr)
    try:
        rc = local_cluster.run_cluster(opts, out=sink)
    finally:
        sink.close()
        os.environ.clear()
        os.environ.update(saved)
    return print_results(rc, result, render, as_json=args.json)
