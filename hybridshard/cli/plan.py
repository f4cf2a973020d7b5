"""``hybridshard plan``: the group plan of a cluster, without running a job.

Plan a saved cluster view (``--from``, e.g. the ``cluster`` of ``hybridshard topo --cluster --json``)
or a synthetic one (``--nodes``/``--gpus-per-node``), to see who will shard with whom before the
job is queued. With ``--model-params``, size a model on that cluster instead: per-GPU memory and
per-step traffic of every strategy and shard size, and the one to use (see docs/planning.md).
"""

from __future__ import annotations

import argparse
import json
import sys

from hybridshard.estimates import multinode, sizing
from hybridshard.estimates.levels import RackLayout, rack_estimate
from hybridshard.estimates.format import parse_bytes, parse_count, render_text, to_dict
from hybridshard.topology.planner import DOMAINS, format_plan, plan_groups
from hybridshard.topology.records import ClusterView
from hybridshard.topology.synthetic import LAYOUTS, NVLINK_SHAPES, replicated_cluster, synthetic_cluster


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="show the shard/replicate group plan of a cluster", description=__doc__)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--from", dest="source", metavar="JSON", help="a saved cluster view (JSON file)")
    src.add_argument("--from-smi", metavar="FILE",
                     help="plan --nodes copies of the machine whose `nvidia-smi topo -m` output is in FILE")
    p.add_argument("--nodes", type=int, default=2, help="number of nodes (synthetic or --from-smi; default 2)")
    p.add_argument("--smi-query", metavar="FILE",
                   help="with --from-smi: the machine's `nvidia-smi -q` output, for its multi-node NVLink Fabric")
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
    size = p.add_argument_group("sizing a model (with --model-params)")
    size.add_argument("--model-params", metavar="N", help="size this model: parameter count (7e9, 7B, 350M)")
    unit = size.add_mutually_exclusive_group()
    unit.add_argument("--unit-params", metavar="N", help="parameters of the largest wrapped unit")
    unit.add_argument("--layers", type=int, default=None, help=f"layers (units) of equal size (default {_DEFAULT_LAYERS})")
    size.add_argument("--root-params", metavar="N", default="0", help="parameters outside every unit (default 0)")
    size.add_argument("--gpu-memory", metavar="SIZE", default=None,
                      help="memory per GPU, e.g. 80GB or 80GiB (default: --from's GPUs, else 80GB)")
    size.add_argument("--intra-node-gbps", type=float, default=3600.0,
                      help="NVLink Gb/s per GPU and direction (default 3600)")
    size.add_argument("--inter-node-gbps", type=float, default=200.0,
                      help="network Gb/s per GPU and direction (default 200)")
    size.add_argument("--optimizer", choices=[o.value for o in sizing.Optimizer], default="adamw")
    for name, default, what in (("param", "bf16", "compute"), ("reduce", "fp32", "gradient reduction"),
                                ("master", "fp32", "master parameter, gradient and optimizer state")):
        size.add_argument(f"--{name}-dtype", choices=list(sizing.DTYPE_BYTES), default=default,
                          help=f"{what} dtype (default {default})")
    size.add_argument("--multi-node", action="store_true",
                      help="size shard groups over k = 1, 2, 4 ... whole nodes instead (docs/planning.md, "
                           "'Shard groups over nodes')")
    size.add_argument("--headroom", type=float, default=0.10, metavar="F",
                      help="with --multi-node: fraction of GPU memory kept for activations (default 0.1)")
    net = p.add_argument_group("racks (with --model-params; docs/planning.md, 'Racks')")
    net.add_argument("--racks", type=int, default=None, metavar="P",
                     help="split the nodes evenly over P racks (default: --from's network paths, else none)")
    net.add_argument("--rack-layout", choices=LAYOUTS, default="block",
                     help="with --racks: consecutive nodes in one rack (block), or dealt round-robin over racks (cyclic)")
    net.add_argument("--spine-oversubscription", type=float, default=1.0, metavar="X",
                     help="a rack's uplink is its GPUs' network rate / X (default 1; 7 for 1:7)")
    net.add_argument("--spine-gbps", type=float, default=None, metavar="G",
                     help="a rack's whole uplink to the spine, Gb/s per direction (overrides --spine-oversubscription)")
    p.set_defaults(func=run)


_DEFAULT_LAYERS = 32
_DEFAULT_GPU_MEMORY = "80GB"


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


def _cluster(args: argparse.Namespace) -> ClusterView:
    if args.source:
        return _load(args.source)
    if args.from_smi:
        from hybridshard.topology.smi import read_topo_matrix

        node = read_topo_matrix(args.from_smi, query_path=args.smi_query)
        return replicated_cluster(node, args.nodes, layout=args.layout)
    counts = args.gpus_per_node
    if len(counts) not in (1, args.nodes):
        raise ValueError(f"--gpus-per-node takes one count or one per node ({args.nodes}); got {len(counts)} values")
    return synthetic_cluster(
        args.nodes,
        counts[0] if len(counts) == 1 else counts,
        layout=args.layout,
        nvlink=args.nvlink,
        fabric_nodes_per_clique=args.fabric_nodes_per_clique,
    )


def _gpu_memory(args: argparse.Namespace, cluster: ClusterView) -> int:
    """``--gpu-memory``, else the smallest GPU the cluster view records, else 80GB."""
    if args.gpu_memory is not None:
        return parse_bytes(args.gpu_memory)
    if args.from_smi:
        raise ValueError("--model-params with --from-smi needs --gpu-memory (nvidia-smi topo -m does not show "
                         "GPU memory), e.g. --gpu-memory 80GB")
    found = [g.memory_total_bytes for n in cluster.nodes for g in n.probe.gpus if g.memory_total_bytes]
    return min(found) if found else parse_bytes(_DEFAULT_GPU_MEMORY)


def _size(args: argparse.Namespace, cluster: ClusterView) -> str:
    if args.domain != "node":
        raise ValueError(f"--model-params sizes shard groups inside nodes; got --domain {args.domain}. Drop --domain")
    num_params = parse_count(args.model_params)
    if args.unit_params is not None:
        unit_params, source = parse_count(args.unit_params, what="--unit-params"), "--unit-params"
    else:
        layers = _DEFAULT_LAYERS if args.layers is None else args.layers
        if layers < 1:
            raise ValueError(f"--layers: expected a positive number of layers; got {layers}")
        source = f"model / {layers} layers" + ("; --layers or --unit-params to change" if args.layers is None else "")
        unit_params = -(-num_params // layers)
    root = parse_count(args.root_params, what="--root-params", minimum=0)
    model = sizing.ModelSpec(
        num_params=num_params, unit_params=unit_params, root_params=root, param_dtype=args.param_dtype,
        reduce_dtype=args.reduce_dtype, master_dtype=args.master_dtype, optimizer=sizing.Optimizer(args.optimizer),
    )
    spec = sizing.ClusterSpec(
        node_sizes=tuple(len(n.ranks) for n in cluster.nodes), gpu_memory_bytes=_gpu_memory(args, cluster),
        intra_node_gbps=args.intra_node_gbps, inter_node_gbps=args.inter_node_gbps,
    )
    if args.multi_node:
        return _size_nodes(args, cluster, model, spec)
    hybrid_sizes = None
    if args.shard_size is not None:
        if args.shard_size not in sizing.shard_sizes(spec):
            raise ValueError(f"--shard-size {args.shard_size} does not tile the nodes; pick one of {sizing.shard_sizes(spec)}")
        hybrid_sizes = [args.shard_size]
    estimates = sizing.estimate_all(model=model, cluster=spec, hybrid_shard_sizes=hybrid_sizes)
    rec = sizing.recommend(estimates, cluster=spec)
    layout = _rack_layout(args, cluster)
    racks = [rack_estimate(e, model=model, cluster=spec, layout=layout) for e in estimates] if layout else []
    if args.json:
        return json.dumps(to_dict(model, spec, estimates, rec, layout=layout, racks=racks), indent=2)
    return render_text(model, spec, estimates, rec, unit_source=source, layout=layout, racks=racks)


def _size_nodes(args: argparse.Namespace, cluster: ClusterView, model: sizing.ModelSpec, spec: sizing.ClusterSpec) -> str:
    """``--multi-node``: the settings of shard groups over k whole nodes, and the smallest k that fits."""
    layout = _rack_layout(args, cluster)
    settings = multinode.node_settings(model=model, cluster=spec, rack_sizes=layout.rack_sizes if layout else ())
    rec = multinode.recommend_nodes(settings, cluster=spec, headroom=args.headroom)
    if args.json:
        return json.dumps(multinode.settings_dict(settings, rec), indent=2)
    head = (f"model: {model.num_params / 1e9:.3g}B parameters, largest unit {model.unit_params / 1e9:.3g}B, "
            f"{model.param_dtype} compute, {model.reduce_dtype} reduce, {model.master_dtype} master, "
            f"{model.optimizer.value}; {spec.gpu_memory_bytes / 1e9:.0f} GB per GPU"
            + (f"; racks: {list(layout.rack_sizes)} nodes ({layout.source})" if layout else ""))
    return "\n".join([head] + multinode.render_nodes(settings, rec, cluster=spec))


def _rack_layout(args: argparse.Namespace, cluster: ClusterView) -> RackLayout | None:
    """Racks from ``--racks`` (nodes split evenly), else from the nodes' network paths, else none."""
    nodes = cluster.nodes
    if args.racks is not None:
        if args.racks < 1 or len(nodes) % args.racks:
            raise ValueError(f"--racks: expected a number of racks that divides the {len(nodes)} nodes, "
                             f"got {args.racks}; pick a divisor of {len(nodes)}")
        per = len(nodes) // args.racks
        node_racks = [n // per if args.rack_layout == "block" else n % args.racks for n in range(len(nodes))]
        names = [f"rack{k}" for k in range(args.racks)]
        source = f"--racks {args.racks}, nodes {'in blocks' if args.rack_layout == 'block' else 'dealt round-robin'}"
    else:
        paths = [n.network_path for n in nodes]
        if not any(paths):
            return None
        missing = [n.name for n in nodes if not n.network_path]
        if missing:
            raise ValueError(f"expected a network path for every node, found none for {', '.join(missing[:4])}"
                             f"{' ...' if len(missing) > 4 else ''}; give every node one, or pass --racks P")
        names = sorted({"/".join(p) for p in paths})
        node_racks = [names.index("/".join(p)) for p in paths]
        source = "the nodes' network paths"
    return RackLayout(node_racks=tuple(node_racks), rack_names=tuple(names),
                      launch_orders=_launch_orders(cluster, node_racks), source=source, oversubscription=args.spine_oversubscription, spine_gbps=args.spine_gbps)


def _launch_orders(cluster: ClusterView, node_racks: list[int]) -> tuple[tuple[int, ...], ...]:
    """The rack of each member of each replicate group of a node-filling shard group (the ``k``-th rank
    of every node), members in global-rank order; empty when the nodes differ in size."""
    sizes = {len(n.ranks) for n in cluster.nodes}
    if len(sizes) != 1:
        return ()
    return tuple(tuple(node_racks[i] for _, i in sorted((n.ranks[k].rank, i) for i, n in enumerate(cluster.nodes)))
                 for k in range(sizes.pop()))


def run(args: argparse.Namespace) -> int:
    try:
        cluster = _cluster(args)
        if args.model_params is not None:
            print(_size(args, cluster))
            return 0
        if args.racks is not None or args.spine_gbps is not None or args.spine_oversubscription != 1.0:
            raise ValueError("--racks, --spine-gbps and --spine-oversubscription size a model's replicate reduction; "
                             "add --model-params")
        plan = plan_groups(cluster, shard_size=args.shard_size, domain=args.domain)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
    else:
        print(format_plan(plan))
    return 0
