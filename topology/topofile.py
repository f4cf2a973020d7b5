"""Where one node sits, read from a Slurm topology file: ``topology.conf`` or ``topology.yaml``.

``topology.conf`` (topology/tree and topology/block)::

    SwitchName=s0 Nodes=tux[0-3]          # a leaf switch and its nodes
    SwitchName=s1 Nodes=tux[4-7]
    SwitchName=s4 Switches=s[0-1]         # a switch above switches; LinkSpeed= and the like are ignored
    BlockName=b1 Nodes=tux[0-3]           # topology/block: a block and its nodes

``topology.yaml`` (Slurm 25.05): a list of topologies, each with ``topology`` (its name),
``cluster_default`` and one of ``tree: {switches: [{switch, children, nodes}]}``,
``block: {block_sizes, blocks: [{block, nodes}]}`` or ``flat: true``. The first topology with
``cluster_default: true`` is read, else the first one. ``nodes`` and ``children`` are Slurm host lists
(``tux[0-3,7]``), expanded by :func:`~hybridshard.topology.hostlist.parse_nodelist`.

[Note: a node's chain of switches]
The path is the chain from the top switch down to the leaf switch that lists the node: the leaf is
the first switch, in file order, whose nodes include one of the node's names, and each switch's
parent is the first switch that lists it among its children. A node under several leaf switches,
or a switch under several parents, thus gets one path, the first; Slurm's own
``SLURM_TOPOLOGY_ADDR`` (read before this file) names every switch of such a level. A block is a
one-level path; the larger blocks of ``block_sizes`` (runs of consecutive base blocks) are not levels
of it. A node the file does not list has no path from it, which is not an error: a shared file may
describe part of a cluster.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Sequence

from hybridshard.topology.hostlist import parse_nodelist

logger = logging.getLogger(__name__)

__all__ = ["conf_path", "read_topology_file", "yaml_path"]

Switch = tuple[str, tuple[str, ...], tuple[str, ...]]
"""(name, child switches, nodes)."""

_CONF_FORM = "lines such as 'SwitchName=s0 Nodes=tux[0-3]', 'SwitchName=s4 Switches=s[0-1]' or 'BlockName=b1 Nodes=tux[0-3]'"
_YAML_FORM = ("a list of topologies such as '- topology: topo1', 'cluster_default: true', "
              "'tree: {switches: [{switch: s0, nodes: tux[0-3]}]}' (or 'block: {blocks: [{block: b1, nodes: ...}]}')")


def read_topology_file(path: str, names: Sequence[str]) -> tuple[tuple[str, ...], str]:
    """``(path of the node named by one of names, source)``; a file ending in ``.yaml``/``.yml`` is read
    as ``topology.yaml``, any other as ``topology.conf``. Raises ``ValueError`` for a file that cannot
    be read or parsed."""
    kind = "topology.yaml" if path.endswith((".yaml", ".yml")) else "topology.conf"
    source = f"{kind}:{path}"
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError as err:
        raise ValueError(
            f"HYBRIDSHARD_TOPOLOGY_FILE: expected a readable Slurm {kind}, found {path!r} ({err.strerror or err}); "
            "fix the path or unset the variable"
        ) from None
    found = yaml_path(_load_yaml(text, source), names, source) if kind == "topology.yaml" else conf_path(text, names, source)
    if not found:
        logger.warning("%s lists none of this node's names %s; no network path from it", source, list(names))
    return found, source


def conf_path(text: str, names: Sequence[str], source: str = "topology.conf") -> tuple[str, ...]:
    """This node's path in a ``topology.conf`` (see [Note: a node's chain of switches])."""
    switches: list[Switch] = []
    blocks: list[Switch] = []
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        words = {}
        for word in line.split():
            key, eq, value = word.partition("=")
            if not eq or not key or not value:
                raise ValueError(
                    f"{source}:{lineno}: expected Key=Value words ({_CONF_FORM}), found {word!r} in {line!r}; fix that line"
                )
            words[key.lower()] = value
        where = f"{source}:{lineno}"
        if "switchname" in words:
            switches.append((words["switchname"], _hosts(words.get("switches"), where), _hosts(words.get("nodes"), where)))
        elif "blockname" in words:
            blocks.append((words["blockname"], (), _hosts(words.get("nodes"), where)))
    if switches and blocks:
        raise ValueError(f"{source}: expected SwitchName lines (topology/tree) or BlockName lines (topology/block), "
                         "found both; keep the lines of one plugin")
    return _tree_path(switches or blocks, names, source)


def yaml_path(data: Any, names: Sequence[str], source: str = "topology.yaml") -> tuple[str, ...]:
    """This node's path in a parsed ``topology.yaml`` (see [Note: a node's chain of switches])."""
    if not isinstance(data, list) or not data or not all(isinstance(t, dict) for t in data):
        raise ValueError(f"{source}: expected {_YAML_FORM}, found {type(data).__name__} {_short(data)}; fix the file")
    chosen = next((t for t in data if t.get("cluster_default") is True), data[0])
    name = chosen.get("topology", "?")
    where = f"{source} (topology {name!r})"
    if chosen.get("flat"):
        return ()
    if isinstance(chosen.get("tree"), dict):
        entries, key, children = chosen["tree"].get("switches"), "switch", "children"
    elif isinstance(chosen.get("block"), dict):
        entries, key, children = chosen["block"].get("blocks"), "block", None
    else:
        raise ValueError(f"{where}: expected one of 'tree', 'block' or 'flat', found keys {sorted(chosen)}; "
                         f"the file's form is {_YAML_FORM}")
    if not isinstance(entries, list) or not all(isinstance(e, dict) and e.get(key) for e in entries):
        raise ValueError(f"{where}: expected a list of entries each with a '{key}' name, found {_short(entries)}; "
                         f"the file's form is {_YAML_FORM}")
    switches = [
        (str(e[key]), _hosts(e.get(children), where) if children else (), _hosts(e.get("nodes"), where))
        for e in entries
    ]
    return _tree_path(switches, names, where)


def _tree_path(switches: Sequence[Switch], names: Sequence[str], where: str) -> tuple[str, ...]:
    wanted = set(names)
    leaf = next((name for name, _, nodes in switches if wanted.intersection(nodes)), None)
    if leaf is None:
        return ()
    parent: dict[str, str] = {}
    for name, children, _ in switches:
        for child in children:
            parent.setdefault(child, name)
    chain = [leaf]
    while chain[-1] in parent:
        up = parent[chain[-1]]
        if up in chain:
            raise ValueError(f"{where}: expected switches to form a tree, found a cycle "
                             f"{' -> '.join(reversed(chain + [up]))}; fix the Switches/children entries")
        chain.append(up)
    return tuple(reversed(chain))


def _hosts(value: Any, where: str) -> tuple[str, ...]:
    """A Slurm host list (``tux[0-3,7]``) or a YAML list of them, expanded."""
    if value is None:
        return ()
    items = value if isinstance(value, list) else [value]
    out: list[str] = []
    for item in items:
        try:
            out += parse_nodelist(str(item))
        except ValueError as err:
            raise ValueError(f"{where}: expected a Slurm host list such as 'tux[0-3,7]', found {item!r} ({err})") from None
    return tuple(out)


def _load_yaml(text: str, source: str) -> Any:
    try:
        import yaml
    except ImportError:  # JSON is YAML too, and needs no package
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            raise ValueError(f"{source}: reading topology.yaml needs PyYAML, found it not installed; "
                             "pip install pyyaml, or give the file as JSON") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ValueError(f"{source}: expected YAML ({_YAML_FORM}), found a syntax error: {err}") from None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
