"""Where a node sits in the network: its switches or blocks, top level first, without the node itself.

[Note: network path sources]
A node's path (``("pod1", "rack07")``, as text ``pod1/rack07``) comes from the first of these that
gives one, and :class:`NetworkPath` records which:

1. ``HYBRIDSHARD_NETWORK_PATH`` (``hybridshard launch --network-path`` sets it): ``pod1/rack07``.
2. Slurm's ``SLURM_TOPOLOGY_ADDR`` by ``SLURM_TOPOLOGY_ADDR_PATTERN``: ``s0.s4.tux1`` by
   ``switch.switch.node`` (topology/tree), ``b8.tux1`` by ``block.node`` (topology/block).
3. ``HYBRIDSHARD_TOPOLOGY_FILE``: a Slurm ``topology.conf`` or ``topology.yaml`` naming this node
   (:mod:`hybridshard.topology.topofile`).
4. The node's Kubernetes labels (:data:`K8S_FAMILIES`), which a pod cannot read itself: in
   ``HYBRIDSHARD_K8S_LABELS``, or a file named by ``HYBRIDSHARD_K8S_LABELS_FILE``, as a JSON object
   (the labels, or the whole Node) or ``key=value`` lines.

A source present but without a path passes to the next (Slurm's default topology/flat sets the
address to the node's own name, pattern ``node``). A source present and wrong raises ``ValueError``
naming it, what was found and the form expected: it is a setting someone got wrong, not a fact the
machine lacks ([Note: failure is data] in records.py), and a plan on a guessed rack is quietly wrong.

[Note: a range as a level]
Slurm prints a level as a host-list range (``s[0-1].s4.tux1``) when the node hangs under several
switches at that level. The range is kept verbatim as the level's name: every node under the same
switches prints the same range, so such nodes share the level, and a node under ``s[0-1]`` and one
under ``s1`` are in different racks, which is how far apart the scheduler considers them.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from hybridshard.topology.ranges import format_ranges
from hybridshard.topology.records import ClusterNode, ClusterView
from hybridshard.topology.topofile import read_topology_file

logger = logging.getLogger(__name__)

__all__ = ["K8S_FAMILIES", "K8S_LABELS_ENV", "K8S_LABELS_FILE_ENV", "NETWORK_PATH_ENV", "TOPOLOGY_FILE_ENV",
           "NetworkPath", "check_levels", "format_tree", "k8s_path", "own_names", "parse_k8s_labels", "parse_path",
           "path_notes", "racks", "resolve_network_path", "slurm_path"]

NETWORK_PATH_ENV = "HYBRIDSHARD_NETWORK_PATH"
TOPOLOGY_FILE_ENV = "HYBRIDSHARD_TOPOLOGY_FILE"
K8S_LABELS_ENV = "HYBRIDSHARD_K8S_LABELS"
K8S_LABELS_FILE_ENV = "HYBRIDSHARD_K8S_LABELS_FILE"
SLURM_ADDR_ENV, SLURM_PATTERN_ENV = "SLURM_TOPOLOGY_ADDR", "SLURM_TOPOLOGY_ADDR_PATTERN"
_PATTERN_WORDS = ("switch", "block", "node")
_MAX_NAMED = 8

K8S_FAMILIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("Topograph", ("network.topology.nvidia.com/core", "network.topology.nvidia.com/spine",
                   "network.topology.nvidia.com/leaf")),
    ("Topograph", ("network.topology.nvidia.com/accelerator",)),
    ("GKE", ("cloud.google.com/gce-topology-block", "cloud.google.com/gce-topology-subblock")),
    ("EKS", tuple(f"topology.k8s.aws/network-node-layer-{i}" for i in range(1, 5))),
)
"""Node labels read, top level first, by family; the first family with a label set gives the path.
Topograph's switch labels come before its ``accelerator`` (an NVLink domain, Slurm's topology/block
counterpart), which is used only without them. GKE's ``cloud.google.com/gce-topology-host`` names the
physical machine, which is the node itself (see [Note: one machine, one node] in probe.py), so it is
no level of the path. Levels may be missing at the top or the bottom (Topograph without ``core``, EKS
without layer 4), not between two that are set."""


@dataclass(frozen=True)
class NetworkPath:
    path: tuple[str, ...] = ()
    """Top level first, without the node; empty when no source says."""
    source: str | None = None
    """``HYBRIDSHARD_NETWORK_PATH``, ``SLURM_TOPOLOGY_ADDR``, ``topology.conf:<path>``,
    ``topology.yaml:<path>`` or ``kubernetes labels (<family>)``; ``None`` with no path."""


def parse_path(text: str, source: str = NETWORK_PATH_ENV) -> tuple[str, ...]:
    """``"pod1/rack07"`` -> ``("pod1", "rack07")``; one slash at either end is allowed."""
    levels = tuple(part.strip() for part in text.strip().strip("/").split("/"))
    return check_levels(levels, source, text, "a slash-separated path, top level first, such as 'pod1/rack07'")


def check_levels(levels: Sequence[str], source: str, found: str, expected: str) -> tuple[str, ...]:
    """``levels`` as a path, or ``ValueError`` when one is empty or holds a slash or a space."""
    for level in levels:
        if not level or "/" in level or any(c.isspace() for c in level):
            raise ValueError(f"{source}: expected {expected}, found {found!r} (level {level!r}); fix {source}")
    return tuple(levels)


def slurm_path(addr: str, pattern: str) -> tuple[str, ...]:
    """The path in ``SLURM_TOPOLOGY_ADDR`` (``s0.s4.tux1``) by ``SLURM_TOPOLOGY_ADDR_PATTERN``
    (``switch.switch.node``), its ``node`` elements dropped; see [Note: a range as a level]."""
    expected = ("dot-separated names matching a pattern of the words switch, block and node, such as "
                "SLURM_TOPOLOGY_ADDR='s0.s4.tux1' with SLURM_TOPOLOGY_ADDR_PATTERN='switch.switch.node'")
    found = f"SLURM_TOPOLOGY_ADDR={addr!r} with SLURM_TOPOLOGY_ADDR_PATTERN={pattern!r}"
    words = [w.strip().lower() for w in pattern.split(".")]
    levels = _split_outside_brackets(addr.strip(), ".")
    bad = [w for w in words if w not in _PATTERN_WORDS]
    if bad or len(words) != len(levels):
        why = f"pattern word {bad[0]!r}" if bad else f"{len(levels)} names for {len(words)} pattern words"
        raise ValueError(f"{SLURM_ADDR_ENV}: expected {expected}, found {found} ({why}); "
                         "unset both or set HYBRIDSHARD_NETWORK_PATH, which is read first")
    kept = [level for level, word in zip(levels, words) if word != "node"]
    return check_levels(kept, SLURM_ADDR_ENV, found, expected)


def parse_k8s_labels(text: str, source: str = K8S_LABELS_ENV) -> dict[str, str]:
    """Labels from a JSON object (the labels, or a whole Node) or from ``key=value`` lines."""
    body = text.strip()
    if body.startswith("{"):
        try:
            data = json.loads(body)
        except json.JSONDecodeError as err:
            raise ValueError(f"{source}: expected a JSON object of node labels, found invalid JSON ({err}); "
                             "write it with kubectl get node NAME -o jsonpath='{.metadata.labels}'") from None
        labels = data.get("metadata", {}).get("labels", {}) if isinstance(data.get("metadata"), dict) else data
        return {str(k): str(v) for k, v in labels.items()}
    out = {}
    for line in body.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, eq, value = line.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"{source}: expected key=value lines or a JSON object of node labels, found {line!r}; "
                             "write one label a line, e.g. network.topology.nvidia.com/leaf=s1")
        value = value.strip()
        out[key.strip()] = value[1:-1] if len(value) >= 2 and value[0] == value[-1] == '"' else value
    return out


def k8s_path(labels: Mapping[str, str]) -> NetworkPath:
    """The path in a node's labels by :data:`K8S_FAMILIES`; no path when none of them is set."""
    for family, keys in K8S_FAMILIES:
        present = [i for i, key in enumerate(keys) if labels.get(key, "").strip()]
        if not present:
            continue
        source = f"kubernetes labels ({family})"
        if present != list(range(present[0], present[-1] + 1)):
            found = {keys[i]: labels[keys[i]] for i in present}
            missing = [keys[i] for i in range(present[0], present[-1]) if i not in present]
            raise ValueError(f"{source}: expected the labels {list(keys)} set without a gap, top level first, "
                             f"found {found} without {missing}; label the node fully or set HYBRIDSHARD_NETWORK_PATH")
        levels = [labels[keys[i]].strip() for i in present]
        path = check_levels(levels, source, "/".join(levels), f"label values without '/' or spaces for {list(keys)}")
        return NetworkPath(path, source)
    return NetworkPath()


def own_names(env: Mapping[str, str]) -> tuple[str, ...]:
    """The names this node may have in a topology file: ``HYBRIDSHARD_NODE_NAME``, ``SLURMD_NODENAME``,
    the hostname and its first label."""
    host = socket.gethostname()
    names = [env.get("HYBRIDSHARD_NODE_NAME", ""), env.get("SLURMD_NODENAME", ""), host, host.split(".")[0]]
    return tuple(dict.fromkeys(n.strip() for n in names if n.strip()))


def resolve_network_path(env: Mapping[str, str] | None = None, *, names: Sequence[str] | None = None) -> NetworkPath:
    """This node's path from the first source that gives one (see [Note: network path sources]).
    ``names`` are the node's names in a topology file (default: :func:`own_names`)."""
    env = os.environ if env is None else env
    text = env.get(NETWORK_PATH_ENV, "")
    if text.strip():
        return NetworkPath(parse_path(text), NETWORK_PATH_ENV)
    addr, pattern = env.get(SLURM_ADDR_ENV, "").strip(), env.get(SLURM_PATTERN_ENV, "").strip()
    if addr or pattern:
        if not (addr and pattern):
            missing = SLURM_PATTERN_ENV if addr else SLURM_ADDR_ENV
            raise ValueError(f"{SLURM_ADDR_ENV}: expected both {SLURM_ADDR_ENV} and {SLURM_PATTERN_ENV}, found "
                             f"{missing} unset; Slurm sets both in a job step: unset the other or set both")
        path = slurm_path(addr, pattern)
        if path:
            return NetworkPath(path, SLURM_ADDR_ENV)
    file = env.get(TOPOLOGY_FILE_ENV, "").strip()
    if file:
        path, source = read_topology_file(file, own_names(env) if names is None else names)
        if path:
            return NetworkPath(path, source)
    found = k8s_path(_k8s_labels(env))
    if not found.path:
        logger.debug("no network path: none of %s gives one", (NETWORK_PATH_ENV, SLURM_ADDR_ENV, TOPOLOGY_FILE_ENV,
                                                               K8S_LABELS_ENV, K8S_LABELS_FILE_ENV))
    return found


def _k8s_labels(env: Mapping[str, str]) -> dict[str, str]:
    labels = parse_k8s_labels(env[K8S_LABELS_ENV]) if env.get(K8S_LABELS_ENV, "").strip() else {}
    file = env.get(K8S_LABELS_FILE_ENV, "").strip()
    if file and not labels:
        try:
            text = Path(file).read_text(encoding="utf-8", errors="replace")
        except OSError as err:
            raise ValueError(f"{K8S_LABELS_FILE_ENV}: expected a readable file of node labels, found {file!r} "
                             f"({err.strerror or err}); check the init container that writes it") from None
        labels = parse_k8s_labels(text, f"{K8S_LABELS_FILE_ENV}={file}")
    return labels


def _split_outside_brackets(text: str, sep: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += (ch == "[") - (ch == "]")
        if ch == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return parts + [text[start:]]


# -- the job's racks ------------------------------------------------------------------------------


def racks(cluster: ClusterView) -> dict[tuple[str, ...], list[str]]:
    """Full path -> the names of the nodes under it, in node order; nodes with no path under ``()``.
    A rack is a distinct full path: the last level is the node's leaf switch or block."""
    out: dict[tuple[str, ...], list[str]] = {}
    for node in cluster.nodes:
        out.setdefault(node.network_path, []).append(node.name)
    return out


def path_notes(cluster: ClusterView) -> list[str]:
    """What does not fit in one tree: paths of different depths, and nodes with a path beside nodes
    without one, naming the nodes."""
    notes = []
    by_depth: dict[int, list[str]] = {}
    for node in cluster.nodes:
        by_depth.setdefault(len(node.network_path), []).append(node.name)
    unknown = by_depth.pop(0, [])
    if len(by_depth) > 1:
        shown = "; ".join(f"{depth} level{'s' if depth != 1 else ''} on {_names(names)}"
                          for depth, names in sorted(by_depth.items()))
        notes.append(f"network paths differ in depth ({shown})")
    if unknown and by_depth:
        known = [name for names in by_depth.values() for name in names]
        notes.append(f"no network path on {_names(unknown)}, while {_names(known)} have one")
    return notes


def format_tree(cluster: ClusterView, *, max_racks: int = 64, max_nodes: int = 8) -> str:
    """The job's network tree: each level indented under the one above, each rack's nodes with their
    ranks (at most ``max_nodes`` a rack, ``max_racks`` racks), and where the paths came from."""
    groups = racks(cluster)
    sources = sorted({n.probe.network_source for n in cluster.nodes if n.network_path and n.probe.network_source})
    first: dict[tuple[str, ...], int] = {}  # each prefix's first appearance: racks of one pod print together
    for path in groups:
        for depth in range(1, len(path) + 1):
            first.setdefault(path[:depth], len(first))
    known = sorted((p for p in groups if p), key=lambda p: [first[p[:d]] for d in range(1, len(p) + 1)])
    if not known:
        return "network: no node reports a network path (see docs/topology.md, \"Racks and pods\")"
    by_name = {n.name: n for n in cluster.nodes}
    count = f"{len(known)} rack{'s' if len(known) != 1 else ''} of {_nodes(cluster.num_nodes)}"
    lines = [f"network: {count}, paths from {', '.join(sources) or 'unknown'}"]
    printed: tuple[str, ...] = ()
    for path in known[:max_racks]:
        common = next((i for i, (a, b) in enumerate(zip(printed, path)) if a != b), min(len(printed), len(path)))
        for depth in range(common, len(path)):
            size = f"  ({_nodes(len(groups[path]))})" if depth == len(path) - 1 else ""
            lines.append("  " * (depth + 1) + path[depth] + size)
        lines += _node_lines([by_name[n] for n in groups[path]], "  " * (len(path) + 1), max_nodes)
        printed = path
    if len(known) > max_racks:
        lines.append(f"  ... {len(known) - max_racks} more racks")
    if () in groups:
        lines.append("  (no path)")
        lines += _node_lines([by_name[n] for n in groups[()]], "    ", max_nodes)
    return "\n".join(lines)


def _node_lines(nodes: Sequence[ClusterNode], indent: str, max_nodes: int) -> list[str]:
    width = max(len(n.name) for n in nodes)
    lines = [f"{indent}{n.name.ljust(width)}  ranks {format_ranges(n.global_ranks)}" for n in nodes[:max_nodes]]
    if len(nodes) > max_nodes:
        rest = [r for n in nodes[max_nodes:] for r in n.global_ranks]
        lines.append(f"{indent}... {len(nodes) - max_nodes} more nodes, ranks {format_ranges(rest)}")
    return lines


def _nodes(count: int) -> str:
    return f"{count} node{'s' if count != 1 else ''}"


def _names(names: Sequence[str]) -> str:
    more = f" and {len(names) - _MAX_NAMED} more" if len(names) > _MAX_NAMED else ""
    return ", ".join(names[:_MAX_NAMED]) + more
