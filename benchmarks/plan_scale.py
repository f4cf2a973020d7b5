"""How long planning takes for large clusters (target: 100,000 ranks in under a second).

    python benchmarks/plan_scale.py [--ranks 100000] [--gpus-per-node 8] [--layout cyclic]

Prints the time to plan (``plan_groups``) apart from the time to assemble the cluster view, which
in a real job is spent by ``all_gather_object`` anyway.
"""

from __future__ import annotations

import argparse
import time

from hybridshard.topology.planner import plan_groups
from hybridshard.topology.synthetic import synthetic_cluster


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=100_000)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--layout", choices=("block", "cyclic"), default="block")
    parser.add_argument("--domain", choices=("node", "nvlink", "numa"), default="node")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    num_nodes = args.ranks // args.gpus_per_node
    t0 = time.perf_counter()
    cluster = synthetic_cluster(num_nodes, args.gpus_per_node, layout=args.layout)
    assemble_s = time.perf_counter() - t0
    times = []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        plan = plan_groups(cluster, domain=args.domain)
        times.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    for rank in range(0, cluster.world_size, max(1, cluster.world_size // 1000)):
        plan.coords(rank)
    lookup_s = time.perf_counter() - t0
    best = min(times)
    print(f"ranks={cluster.world_size} nodes={num_nodes} layout={args.layout} domain={args.domain}")
    print(f"shard_size={plan.shard_size} replicate_size={plan.replicate_size}")
    print(f"assemble cluster view: {assemble_s:.3f} s (synthetic probes)")
    print(f"plan_groups: best {best:.3f} s, all {', '.join(f'{t:.3f}' for t in times)} s")
    print(f"first coords() lookups (builds the index): {lookup_s:.3f} s")
    print(f"target 1.0 s: {'met' if best < 1.0 else 'MISSED'} (ratio {best / 1.0:.2f})")


if __name__ == "__main__":
    main()
