"""``hybridshard topo``: what this node, or the whole job, looks like before training starts.

Local mode (the default outside a job) reports this node: GPUs, their connections in the vocabulary
of ``nvidia-smi topo -m``, NUMA nodes and CPU affinity, NICs, memory. Cluster mode (under torchrun,
i.e. with RANK and WORLD_SIZE set, or with --cluster) gathers every rank's probe and rank 0 prints the
cluster table, the group plan and the warnings; every rank exits 1 when one of them is an error.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import sys
from typing import Any, Mapping

from hybridshard.diagnostics.slow_watch import find_log, read_reports, render_watch
from hybridshard.topology.findings import Finding, Level, cluster_findings, has_errors
from hybridshard.topology.planner import DOMAINS

logger = logging.getLogger(__name__)

EXIT_OK, EXIT_FINDINGS, EXIT_USAGE = 0, 1, 2
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}


def parse_size(text: str) -> int:
    """``"4096"``, ``"64K"``, ``"1M"``, ``"1GiB"`` -> bytes (binary units)."""
    raw = text.strip().upper().removesuffix("B").removesuffix("I")
    number, unit = (raw[:-1], raw[-1]) if raw[-1:] in _UNITS and raw[-1:] else (raw, "")
    try:
        value = int(float(number) * _UNITS[unit])
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive size such as 4096, 64K, 1M or 1G; got {text!r}")
    return value


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "topo", help="report this node's topology, or the whole job's under torchrun", description=__doc__
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument("--from-smi", metavar="FILE",
                   help="report the machine whose `nvidia-smi topo -m` output is in FILE instead of this one")
    p.add_argument("--smi-query", metavar="FILE",
                   help="with --from-smi: that machine's `nvidia-smi -q` output, for its multi-node NVLink Fabric")
    p.add_argument(
        "--cluster",
        action="store_true",
        help="gather every rank (the default when RANK and WORLD_SIZE are set, as under torchrun)",
    )
    p.add_argument("--shard-size", type=int, default=None, help="ranks per shard group (default: largest that tiles)")
    p.add_argument("--domain", choices=DOMAINS, default="node", help="fast domain to shard inside (default node)")
    p.add_argument(
        "--bandwidth", action="store_true", help="cluster mode: measure collective bandwidth in the planned groups"
    )
    p.add_argument(
        "--sizes",
        nargs="+",
        type=parse_size,
        default=None,
        metavar="SIZE",
        help="message sizes for --bandwidth, e.g. 1M 64M 256M",
    )
    p.add_argument(
        "--backend",
        choices=("nccl", "gloo"),
        default=None,
        help="process group backend (default: nccl with GPUs, else gloo)",
    )
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the other ranks (default 300)")
    p.add_argument("--watch", metavar="RUN_DIR", default=None,
                   help="print the running job's straggler reports (RUN_DIR's stragglers.jsonl) as a per-node "
                        "table, again every --interval seconds until interrupted (--once: one table)")
    p.add_argument("--interval", type=float, default=10.0, help="seconds between --watch tables (default 10)")
    p.add_argument("--once", action="store_true", help="with --watch: print the table once and exit")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.watch:
        return _watch(args)
    env = os.environ
    cluster_mode = args.cluster or ("RANK" in env and "WORLD_SIZE" in env)
    if args.sizes and not args.bandwidth:
        print("error: --sizes sets the message sizes of --bandwidth; add --bandwidth", file=sys.stderr)
        return EXIT_USAGE
    if args.from_smi:
        return _run_smi(args)
    if not cluster_mode:
        if args.bandwidth:
            print(
                "error: --bandwidth measures between ranks; run under torchrun "
                "(torchrun --nproc-per-node=N -m hybridshard topo --bandwidth) or pass --cluster",
                file=sys.stderr,
            )
            return EXIT_USAGE
        return _run_local(args)
    try:
        return _run_cluster(args, env)
    except (RuntimeError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE


def _run_local(args: argparse.Namespace) -> int:
    from hybridshard.topology.probe import probe_node

    try:
        probe = probe_node()
    except ValueError as err:  # a network path source set wrongly (see topology/netpath.py)
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    return _print_node(args, probe)


def _run_smi(args: argparse.Namespace) -> int:
    from hybridshard.topology.smi import read_topo_matrix

    if args.cluster or args.bandwidth:
        print("error: --from-smi reports one machine from its text; drop --cluster and --bandwidth", file=sys.stderr)
        return EXIT_USAGE
    try:
        probe = read_topo_matrix(args.from_smi, query_path=args.smi_query)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    return _print_node(args, probe)


def _print_node(args: argparse.Namespace, probe: Any) -> int:
    from hybridshard.topology.findings import node_findings
    from hybridshard.topology.report import render_node

    findings = node_findings(probe)
    if args.json:
        print(json.dumps({**probe.to_dict(), "warnings": [f.to_dict() for f in findings]}, indent=2))
    else:
        print(render_node(probe))
        lines = [f"  [{f.level.value}] {f.code}: {f.message}" for f in findings]
        print("\n".join(["warnings:", *lines]) if lines else "no warnings")
    return EXIT_FINDINGS if has_errors(findings) else EXIT_OK


def _job_env(env: Mapping[str, str]) -> tuple[int, int, int]:
    """``(rank, world_size, local_rank)`` from torchrun's variables, else SLURM's, else a lone process."""
    for rank_var, world_var, local_var in (
        ("RANK", "WORLD_SIZE", "LOCAL_RANK"),
        ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
    ):
        if rank_var in env and world_var in env:
            try:
                return int(env[rank_var]), int(env[world_var]), int(env.get(local_var, "0"))
            except ValueError:
                raise ValueError(
                    f"{rank_var}, {world_var} and {local_var} must be integers, found "
                    f"{env.get(rank_var)!r}, {env.get(world_var)!r}, {env.get(local_var)!r}; fix the launcher"
                ) from None
    return 0, 1, 0


def _init_default_group(args: argparse.Namespace, env: Mapping[str, str], rank: int, world_size: int) -> None:
    import torch
    import torch.distributed as dist

    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    timeout = datetime.timedelta(seconds=args.timeout)
    try:
        if world_size == 1 and "MASTER_ADDR" not in env:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        else:
            dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size, timeout=timeout)
    except (RuntimeError, ValueError) as err:
        raise RuntimeError(
            f"could not start the {backend} process group (rank {rank} of {world_size}, env://): {err}. "
            "torchrun sets MASTER_ADDR and MASTER_PORT; outside it set both, plus RANK and WORLD_SIZE"
        ) from err


def _run_cluster(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    import torch
    import torch.distributed as dist

    from hybridshard.topology.groups import local_device
    from hybridshard.topology.cluster import gather_cluster
    from hybridshard.topology.planner import plan_groups
    from hybridshard.topology.probe import probe_rank

    owns_group = not dist.is_initialized()
    if owns_group:
        rank, world_size, local_rank = _job_env(env)
    else:
        rank, world_size = dist.get_rank(), dist.get_world_size()
        local_rank = _job_env(env)[2]
    probe = probe_rank(rank=rank, local_rank=local_rank, world_size=world_size)
    device = local_device(probe)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # the NCCL gather moves the probes through this device
    if owns_group:
        _init_default_group(args, env, rank, world_size)
    try:
        cluster = gather_cluster(probe)
        plan = plan_error = None
        try:
            plan = plan_groups(cluster, shard_size=args.shard_size, domain=args.domain)
        except ValueError as err:
            plan_error = str(err)
        findings = list(cluster_findings(cluster, plan, plan_error=plan_error))
        bandwidth = _measure(args, plan, cluster, device, rank, findings) if args.bandwidth else None
        if rank == 0:
            _print_cluster(args, cluster, plan, findings, bandwidth)
        return EXIT_FINDINGS if has_errors(findings) else EXIT_OK
    finally:
        if owns_group:
            dist.destroy_process_group()


def _measure(args: argparse.Namespace, plan: Any, cluster: Any, device: Any, rank: int, findings: list[Finding]) -> Any:
    if plan is None:
        return None  # every rank failed planning alike, so no rank enters the collectives
    from hybridshard.diagnostics.bandwidth import measure_bandwidth
    from hybridshard.topology.groups import build_groups

    groups = build_groups(plan, backend=args.backend, cluster=cluster, device=device)
    kwargs = {"sizes_bytes": args.sizes} if args.sizes else {}
    result = measure_bandwidth(groups, progress=rank == 0, **kwargs)
    findings += [Finding(Level.WARNING, "bandwidth", w) for w in result.warnings]
    return result


def _print_cluster(args: argparse.Namespace, cluster: Any, plan: Any, findings: list[Finding], bandwidth: Any) -> None:
    from hybridshard.topology.report import cluster_report_dict, render_cluster

    if args.json:
        report = cluster_report_dict(
            cluster, plan, findings, bandwidth=bandwidth.to_dict() if bandwidth is not None else None
        )
        print(json.dumps(report, indent=2))
    else:
        table = bandwidth.table() if bandwidth is not None else None
        print(render_cluster(cluster, plan, findings, bandwidth_table=table))
    sys.stdout.flush()


def _watch(args: argparse.Namespace) -> int:
    import time

    while True:
        path = find_log(args.watch)
        if path is None and args.once:
            print(f"error: no stragglers.jsonl in {args.watch} or its node directories; run the job with "
                  "HYBRIDSHARD_STRAGGLERS=1 under hybridshard launch (or set HYBRIDSHARD_STRAGGLER_LOG)", file=sys.stderr)
            return EXIT_USAGE
        print("\n".join(render_watch(read_reports(path)) if path else ["waiting for stragglers.jsonl ..."]), flush=True)
        if args.once:
            return 0
        try:
            time.sleep(args.interval)
        except KeyboardInterrupt:
            return 0
