"""``hybridshard plan``: the group plan of a cluster, without running a job.

Plan a saved cluster view (``--from``, e.g. the ``cluster`` of ``hybridshard topo --cluster --json``)
or a synthetic one (``--nodes``/``--gpus-per-node``), to see who will shard with whom before the
job is queued.
"""

from __future__ import annotations

import argparse
import json
import sys

from hybridshard.topology.planner import DOMAINS, format_plan, plan_groups
from hybridshard.topology.records import ClusterView
from hybridshard.topology.synthetic import LAYOUTS, NVLINK_SHAPES, synthetic_cluster


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="show the shard/replicate group plan of a cluster", description=__doc__)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--from", dest="source", metavar="JSON", help="a saved cluster view (JSON file)")
    src.add_argument("--nodes", type=int, default=2, help="synthetic cluster: number of nodes (default 2)")
    p.add_argument(
        "--gpus-per-node", type=int, nargs="+", default=[8], metavar="N",
        help="synthetic cluster: GPUs (= ranks) per node; one number, or one per node (default 8)",
    )
    p.add_argument("--layout", choices=LAYOUTS, default="block", help="global rank order (default block)")
    p.add_argument("--nvlink", choices=NVLINK_SHAPES, default="nvswitch", help="synthetic NVLink shape")
    p.add_argument("--fabric-nodes-per-clique", type=int, default=None, metavar="K",
                   help="synthetic multi-node NVLink: K consecutive nodes per fabric clique")
    p.add_argument("--shard-size", type=int, default=None, help="ranks per shard group (default: largest that tiles)")
    p.add_argument("--domain", choices=DOMAINS, default="node", help="fast domain to shard inside (default node)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=run)


def _load(path: str) -> ClusterView:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"--from {path!r}: expected a readable JSON cluster view, got: {err}") from err
    data = data.get("cluster", data) if isinstance(data, dict) else data
    if not isinstance(data, dict) or "nodes" not in data or "world_size" not in data:
        raise ValueError(
            f"--from {path!r}: expected a cluster view with 'world_size' and 'nodes' "
            "(the 'cluster' of `hybridshard topo --cluster --json`)"
        )
    return ClusterView.from_dict(data)


def run(args: argparse.Namespace) -> int:
    try:
        if args.source:
            cluster = _load(args.source)
        else:
            counts = args.gpus_per_node
            if len(counts) not in (1, args.nodes):
                raise ValueError(
                    f"--gpus-per-node takes one count or one per node ({args.nodes}); got {len(counts)} values"
                )
            cluster = synthetic_cluster(
                args.nodes,
                counts[0] if len(counts) == 1 else counts,
                layout=args.layout,
                nvlink=args.nvlink,
                fabric_nodes_per_clique=args.fabric_nodes_per_clique,
            )
        plan = plan_groups(cluster, shard_size=args.shard_size, domain=args.domain)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
    else:
        print(format_plan(plan))
    return 0
