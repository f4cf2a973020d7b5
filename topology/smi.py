"""Read the text of ``nvidia-smi topo -m`` into the node description NVML discovery produces.

Users can paste this one command's output before the package is on their machine; ``hybridshard topo
--from-smi``, ``plan --from-smi`` and ``launch --dry-run --from-smi`` then report, plan and bind from it.

[Note: reading topo -m]
nvidia-smi separates cells with tabs and pads wide headers with extra tabs; pasted into an issue or a
terminal the tabs become runs of spaces, and pagers re-indent the block. So cells are read as
whitespace-separated tokens, never by tab count:

* the header is the first line that starts with ``GPU0``; after the GPU and NIC columns come up to
  three named columns: ``CPU Affinity``, ``NUMA Affinity`` (drivers since ~450) and ``GPU NUMA ID``;
* a row is its label, one level per GPU and NIC column (``X``, ``NV#``, ``PIX``, ``PXB``, ``PHB``,
  ``NODE``, ``SYS``; older drivers wrote ``SOC`` for ``SYS``), then the named columns. A named cell
  may be blank (e.g. ``NUMA Affinity`` on a VM); when a row has fewer named tokens than the header,
  each token goes to the named column whose header starts nearest to it once tabs are expanded to
  8 columns, which is how nvidia-smi aligned them (a tie goes to the later column: a blank cell
  still ends in a tab, which pushes the next value halfway);
* ``NIC Legend:`` maps ``NIC#`` columns to device names (``NIC0: mlx5_0``); without it the column
  names stay.

A truncated, misaligned or non-matrix text is a ``ValueError`` naming the line; nothing is guessed.
The ``Fabric`` sections of ``nvidia-smi -q`` add the multi-node NVLink clique (:func:`apply_fabric`).
Facts the text does not hold (UUIDs, PCI ids, memory, per-link NVLink state, NIC speed) are recorded
as unavailable, as a failed NVML query would be (see [Note: failure is data]).
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Sequence

from hybridshard.topology.probe import parse_cpu_list
from hybridshard.topology.records import GpuInfo, NetInterface, NodeProbe, NumaNode

__all__ = ["LEVELS", "apply_fabric", "nearest_nics", "parse_topo_matrix", "read_topo_matrix"]

LEVELS = ("PIX", "PXB", "PHB", "NODE", "SYS")
"""PCIe levels, nearest first (``nvidia-smi topo -m``'s legend)."""
_NAMED = ("CPU Affinity", "NUMA Affinity", "GPU NUMA ID")
_CODE = re.compile(r"^(X|NV\d+|PIX|PXB|PHB|NODE|SYS|SOC)$")
_GPU = re.compile(r"^GPU(\d+)$")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
"""Terminal styling: recent drivers underline the header (ESC[4m ... ESC[0m), also into a file."""
_LEGEND_ENTRY = re.compile(r"^\s*(NIC\d+)\s*:\s*(\S+)\s*$")
_FROM = "not in nvidia-smi topo -m"


def _read(path: str, what: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError as err:
        raise ValueError(f"{path!r}: expected a readable file with {what}; {err}") from err


def read_topo_matrix(path: str, *, node_name: str | None = None, query_path: str | None = None) -> NodeProbe:
    """:func:`parse_topo_matrix` of a file; ``node_name`` defaults to the file's base name. With
    ``query_path`` (``nvidia-smi -q`` output) its Fabric sections are applied (:func:`apply_fabric`)."""
    import os

    name = node_name or os.path.splitext(os.path.basename(path))[0]
    try:
        probe = parse_topo_matrix(_read(path, "`nvidia-smi topo -m` output"), node_name=name)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
    if query_path is None:
        return probe
    try:
        return apply_fabric(probe, _read(query_path, "`nvidia-smi -q` output"))
    except ValueError as err:
        raise ValueError(f"{query_path}: {err}") from None


_ZERO_UUID = "00000000-0000-0000-0000-000000000000"


def apply_fabric(probe: NodeProbe, query_text: str) -> NodeProbe:
    """``probe`` with each GPU's multi-node NVLink fabric (cluster UUID, clique) from the ``Fabric``
    sections of ``nvidia-smi -q``, one per GPU in GPU order; a GPU whose fabric is not registered
    records why, as NVML discovery does."""
    blocks: list[tuple[int, dict[str, str]]] = []
    depth = None  # indentation of the open Fabric line; the section ends at a line not deeper
    for lineno, line in enumerate(query_text.splitlines(), start=1):
        indent = len(line) - len(line.lstrip())
        if line.strip() == "Fabric":
            depth = indent
            blocks.append((lineno, {}))
        elif depth is not None and line.strip() and indent <= depth:
            depth = None
        elif depth is not None:
            key, sep, value = line.partition(":")
            if sep and key.strip() in ("State", "Status", "CliqueId", "ClusterUUID"):
                blocks[-1][1][key.strip()] = value.strip()
    if len(blocks) != probe.num_gpus:
        raise ValueError(
            f"line {blocks[-1][0] if blocks else 1}: expected one Fabric section per GPU ({probe.num_gpus}), "
            f"found {len(blocks)}; pass the whole output of `nvidia-smi -q`"
        )
    gpus = []
    for gpu, (lineno, fields) in zip(probe.gpus, blocks):
        missing = dict(gpu.unavailable)
        state, status = fields.get("State", "N/A"), fields.get("Status", "N/A")
        uuid, clique = fields.get("ClusterUUID", "N/A"), fields.get("CliqueId", "N/A")
        if state != "Completed" or status != "Success":
            missing["fabric"] = "not supported" if state == "N/A" else f"fabric registration {state}, status {status}"
            gpus.append(replace(gpu, unavailable=tuple(sorted(missing.items()))))
            continue
        if uuid in ("N/A", _ZERO_UUID) or not clique.isdigit():
            raise ValueError(
                f"line {lineno}: expected a ClusterUUID and a numeric CliqueId for a registered fabric, "
                f"found {uuid!r} and {clique!r}"
            )
        gpus.append(replace(gpu, fabric_cluster_uuid=uuid, fabric_clique_id=int(clique)))
    return replace(probe, gpus=tuple(gpus))


def parse_topo_matrix(text: str, *, node_name: str = "smi") -> NodeProbe:
    """The :class:`NodeProbe` that ``text`` (``nvidia-smi topo -m`` output) describes; see
    [Note: reading topo -m]. Raises ``ValueError`` naming the line for text that is not one matrix."""
    lines = _ANSI.sub("", text).splitlines()
    head = next((i for i, line in enumerate(lines) if line.split()[:1] == ["GPU0"]), None)
    if head is None:
        first = next(((i, l) for i, l in enumerate(lines) if l.strip()), (0, ""))
        raise ValueError(
            f"line {first[0] + 1}: expected the header of `nvidia-smi topo -m` (GPU0 GPU1 ... CPU Affinity), "
            f"found {_show(first[1])}; paste the whole output of `nvidia-smi topo -m`"
        )
    columns, named = _header(lines[head], head + 1)
    num_gpus = sum(1 for c in columns if _GPU.match(c))
    rows: dict[str, tuple[int, list[str], dict[str, str]]] = {}
    k = head + 1
    while k < len(lines) and len(rows) < len(columns):
        line = lines[k]
        if not line.strip():
            break
        label = line.split()[0]
        expected = columns[len(rows)]
        if label != expected:
            raise ValueError(
                f"line {k + 1}: expected the row of {expected} (rows follow the header's column order), "
                f"found {_show(line)}"
            )
        rows[label] = (k + 1, *_row(line, lines[head], columns, named, label, k + 1))
        k += 1
    if len(rows) < len(columns):
        missing = columns[len(rows)]
        raise ValueError(
            f"line {k + 1}: expected the row of {missing} ({len(columns)} rows for the header's "
            f"{len(columns)} columns), found {_show(lines[k]) if k < len(lines) else 'the end of the text'}; "
            "the paste is truncated"
        )
    _check_matrix(columns, rows)
    legend = _nic_legend(lines[k:])
    return _node(node_name, columns, num_gpus, named, rows, legend)


def _show(line: str) -> str:
    text = line.strip()
    return repr(text[:60] + ("..." if len(text) > 60 else "")) if text else "a blank line"


def _header(line: str, lineno: int) -> tuple[list[str], list[str]]:
    tokens = line.split()
    columns: list[str] = []
    k = 0
    while k < len(tokens) and not any(tokens[k:k + len(n.split())] == n.split() for n in _NAMED):
        columns.append(tokens[k])
        k += 1
    named: list[str] = []
    while k < len(tokens):
        match = next((n for n in _NAMED if tokens[k:k + len(n.split())] == n.split()), None)
        if match is None:
            raise ValueError(f"line {lineno}: expected one of {list(_NAMED)} after the device columns, found {tokens[k]!r}")
        named.append(match)
        k += len(match.split())
    gpus = [c for c in columns if _GPU.match(c)]
    if gpus != [f"GPU{i}" for i in range(len(gpus))] or columns[: len(gpus)] != gpus:
        raise ValueError(f"line {lineno}: expected GPU columns GPU0, GPU1, ... first, found {columns}")
    if len(set(columns)) != len(columns):
        raise ValueError(f"line {lineno}: expected each column once, found {columns}")
    return columns, named


def _row(
    line: str, header: str, columns: list[str], named: list[str], label: str, lineno: int
) -> tuple[list[str], dict[str, str]]:
    tokens = line.split()[1:]
    cells = tokens[: len(columns)]
    bad = next((c for c in cells if not _CODE.match(c)), None)
    if len(cells) < len(columns) or bad is not None:
        found = f"{bad!r} in column {columns[cells.index(bad)]}" if bad is not None else f"{len(cells)} levels"
        raise ValueError(
            f"line {lineno}: expected {len(columns)} levels (X, NV#, PIX, PXB, PHB, NODE, SYS) in the row of "
            f"{label}, found {found}; the row is truncated or its columns are misaligned"
        )
    rest = tokens[len(columns):]
    if not _GPU.match(label):
        if rest:
            raise ValueError(f"line {lineno}: expected only levels in the row of {label}, found extra cells {rest}")
        return ["SYS" if c == "SOC" else c for c in cells], {}
    if len(rest) > len(named):
        raise ValueError(
            f"line {lineno}: expected at most {len(named)} cells after the levels ({', '.join(named)}), "
            f"found {rest}; the columns are misaligned"
        )
    values = dict(zip(named, rest)) if len(rest) == len(named) else _by_position(line, header, named, rest)
    return ["SYS" if c == "SOC" else c for c in cells], values


def _by_position(line: str, header: str, named: list[str], rest: list[str]) -> dict[str, str]:
    """Blank named cells: give each token the named column whose header starts nearest to it."""
    wide_header = header.expandtabs(8)
    starts = [wide_header.find(n) for n in named]
    spans = [m.start() for m in re.finditer(r"\S+", line.expandtabs(8))][-len(rest):]
    out: dict[str, str] = {}
    first_free = 0
    for k, (token, at) in enumerate(zip(rest, spans)):
        best = min(range(first_free, len(named)), key=lambda i: (abs(starts[i] - at), -i))  # a tie: the later
        best = min(best, len(named) - (len(rest) - k))  # leave a column for every later token
        out[named[best]] = token
        first_free = best + 1
    return out


def _check_matrix(columns: list[str], rows: dict[str, tuple[int, list[str], dict[str, str]]]) -> None:
    for i, a in enumerate(columns):
        lineno, cells, _ = rows[a]
        if cells[i] != "X":
            raise ValueError(f"line {lineno}: expected X where row {a} meets column {a}, found {cells[i]!r}")
    for i, a in enumerate(columns):
        lineno, cells, _ = rows[a]
        for j, b in enumerate(columns):
            if i != j and cells[j] == "X":
                raise ValueError(f"line {lineno}: expected X only on the diagonal, found it at {a}/{b}")
            back = rows[b][1][i]
            if j > i and cells[j] != back:
                raise ValueError(
                    f"line {rows[b][0]}: expected {b}/{a} to equal {a}/{b} ({cells[j]}, line {lineno}), found "
                    f"{back}; the matrix is not symmetric, so its columns are misaligned"
                )


def _nic_legend(lines: Sequence[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    inside = False
    for line in lines:
        if line.strip() == "NIC Legend:":
            inside = True
            continue
        if inside:
            match = _LEGEND_ENTRY.match(line)
            if match:
                out[match.group(1)] = match.group(2)
            elif line.strip():
                break
    return out


def _int_or_none(text: str | None) -> int | None:
    return int(text) if text is not None and text.isdigit() else None


def _node(
    node_name: str,
    columns: list[str],
    num_gpus: int,
    named: list[str],
    rows: dict[str, tuple[int, list[str], dict[str, str]]],
    legend: dict[str, str],
) -> NodeProbe:
    missing = {f: _FROM for f in ("uuid", "name", "pci_bus_id", "memory_total_bytes")}
    missing["nvlinks"] = "per-link state is not in nvidia-smi topo -m; the matrix holds NVLink counts per pair"
    gpus = []
    for i in range(num_gpus):
        lineno, _, values = rows[f"GPU{i}"]
        gpu_missing = dict(missing)
        cpus_text = values.get("CPU Affinity")
        try:
            cpus = parse_cpu_list(cpus_text) if cpus_text and cpus_text != "N/A" else ()
        except ValueError:
            raise ValueError(
                f"line {lineno}: expected a CPU list such as 0-19,40-59 under CPU Affinity, found {cpus_text!r}"
            ) from None
        if not cpus:
            gpu_missing["cpu_affinity"] = "CPU Affinity is blank" if "CPU Affinity" in named else "no CPU Affinity column"
        numa_text = values.get("NUMA Affinity")
        numa = _int_or_none(numa_text)
        if numa is None:
            gpu_missing["numa_node"] = (
                "no NUMA Affinity column (older driver)" if "NUMA Affinity" not in named
                else f"NUMA Affinity is {numa_text or 'blank'!s}"
            )
        gpus.append(GpuInfo(index=i, numa_node=numa, cpu_affinity=cpus, unavailable=tuple(sorted(gpu_missing.items()))))
    nics = []
    for j, column in enumerate(columns[num_gpus:], start=num_gpus):
        levels = tuple(rows[f"GPU{i}"][1][j] for i in range(num_gpus))
        near = {gpus[i].numa_node for i, lv in enumerate(levels) if lv != "SYS"}
        nics.append(
            NetInterface(
                name=legend.get(column, column),
                is_up=None,
                is_rdma=None,
                numa_node=next(iter(near)) if len(near) == 1 else None,
                gpu_levels=levels,
            )
        )
    matrix = tuple(tuple(rows[f"GPU{i}"][1][:num_gpus]) for i in range(num_gpus))
    unavailable = {
        "numa_nodes": "from nvidia-smi topo -m: only NUMA nodes near a GPU, their CPUs from the GPUs' CPU affinity",
        "memory_total_bytes": _FROM,
        "driver_version": _FROM,
    }
    if nics:
        unavailable["nics"] = "from nvidia-smi topo -m: names and PCIe levels only (no state, speed or link layer)"
        if any(c.startswith("NIC") for c in columns[num_gpus:]) and not legend:
            unavailable["nics"] += "; no NIC Legend, so NICs keep their column names"
    return NodeProbe(
        node_name=node_name,
        hostname=node_name,
        numa_nodes=_numa_nodes(gpus),
        nics=tuple(nics),
        gpus=tuple(gpus),
        gpu_matrix=matrix,
        unavailable=tuple(sorted(unavailable.items())),
    )


def _numa_nodes(gpus: Sequence[GpuInfo]) -> tuple[NumaNode, ...]:
    cpus: dict[int, set[int]] = {}
    for g in gpus:
        if g.numa_node is not None:
            cpus.setdefault(g.numa_node, set()).update(g.cpu_affinity)
    return tuple(NumaNode(id=k, cpus=tuple(sorted(v))) for k, v in sorted(cpus.items()))


def nearest_nics(probe: NodeProbe, gpu_index: int) -> tuple[tuple[str, ...], str | None]:
    """``(names, level)``: the NICs nearest GPU ``gpu_index`` by PCIe level, ``((), None)`` when the
    probe records no levels for it."""
    levels = [(n.name, n.gpu_levels[gpu_index]) for n in probe.nics if gpu_index < len(n.gpu_levels)]
    levels = [(name, lv) for name, lv in levels if lv in LEVELS]
    if not levels:
        return (), None
    best = min(LEVELS.index(lv) for _, lv in levels)
    return tuple(name for name, lv in levels if LEVELS.index(lv) == best), LEVELS[best]


def with_name(probe: NodeProbe, name: str) -> NodeProbe:
    """``probe`` as node ``name``, its GPUs given placeholder UUIDs where it has none, so that rank
    probes can point at them (``plan --from-smi`` builds N such nodes)."""
    gpus = tuple(g if g.uuid else replace(g, uuid=f"GPU-{name}-{g.index}") for g in probe.gpus)
    return replace(probe, node_name=name, hostname=name, gpus=gpus)
