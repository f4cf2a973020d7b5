"""GPU records and the GPU x GPU connection matrix, built from raw NVML answers.

:func:`probe_gpus` asks an :class:`~hybridshard.topology.nvml.NvmlSource` and never raises for a failed query:
the GPU keeps every other fact and records the reason (see [Note: failure is data]).

[Note: NVLink matrix]
``nvidia-smi topo -m`` prints ``NV#`` for two GPUs joined by # NVLinks and otherwise the closest
PCIe level (``PIX`` < ``PXB`` < ``PHB`` < ``NODE`` < ``SYS``). Links come in two kinds:

* direct: the far end of a link is the other GPU (PCIe cards with NVLink bridges, older SXM boards);
  the pair gets one count per link.
* through switches: every link of the GPU goes to an NVSwitch, and every GPU attached to the same
  switches reaches every other at the full width of its links. nvidia-smi shows ``NV18`` between all
  pairs of an 8 x H100 HGX board for that reason. We model it the same way: two GPUs whose switch
  links share a switch (same remote PCI bus id), or whose fabric info names the same cluster UUID and
  clique (multi-node NVLink, where the switches sit outside the node and report no PCI id), are
  ``NV<min(switch links of a, switch links of b)>`` apart.

A pair with neither kind falls back to NVML's common-ancestor level; when that query fails too the
code is ``?`` and the reason is recorded under ``gpu_matrix``.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, TypeVar

from hybridshard.topology.nvml import (
    FABRIC_STATE_COMPLETED,
    LINK_TYPE_GPU,
    LINK_TYPE_SWITCH,
    TOPOLOGY_CODES,
    NvmlQueryError,
    NvmlSource,
    NvmlUnavailable,
)
from hybridshard.topology.records import GpuInfo, NumaNode, NvLink

logger = logging.getLogger(__name__)

__all__ = ["GpuFacts", "probe_gpus", "UNKNOWN_CODE"]

UNKNOWN_CODE = "?"
_LINK_LIST_END = ("Invalid Argument", "Not Supported")  # what NVML answers past a GPU's last link
_FABRIC_STATES = {0: "not supported", 1: "not started", 2: "in progress", 3: "completed"}
_ZERO_UUID = "00000000-0000-0000-0000-000000000000"

T = TypeVar("T")


@dataclass(frozen=True)
class GpuFacts:
    """What NVML told us about the node's GPUs."""

    gpus: tuple[GpuInfo, ...] = ()
    matrix: tuple[tuple[str, ...], ...] = ()
    driver_version: str | None = None
    nvml_version: str | None = None
    cuda_driver_version: int | None = None
    unavailable: Mapping[str, str] = field(default_factory=dict)
    """Node-level ``field -> reason`` (``gpus``, ``driver_version``, ``gpu_matrix``, ...)."""
    mig_parents: Mapping[str, str] = field(default_factory=dict)
    """MIG instance UUID -> UUID of the GPU it lives on."""


@dataclass(frozen=True)
class _Link:
    link: int
    active: bool
    remote_pci_bus_id: str | None
    remote_type: int | None


def probe_gpus(
    source: NvmlSource, *, numa_nodes: tuple[NumaNode, ...] = (), sysfs_root: Path = Path("/sys")
) -> GpuFacts:
    """Query every GPU NVML numbers; see [Note: NVLink matrix] for ``matrix``."""
    try:
        source.init()
    except NvmlUnavailable as exc:
        logger.info("no GPUs: %s", exc.reason)
        return GpuFacts(unavailable={"gpus": exc.reason})
    try:
        return _probe_all(source, numa_nodes, sysfs_root)
    finally:
        source.shutdown()


def _probe_all(source: NvmlSource, numa_nodes: tuple[NumaNode, ...], root: Path) -> GpuFacts:
    unavailable: dict[str, str] = {}
    driver = _ask(unavailable, "driver_version", source.driver_version)
    nvml_version = _ask(unavailable, "nvml_version", source.nvml_version)
    cuda_version = _ask(unavailable, "cuda_driver_version", source.cuda_driver_version)
    count = _ask(unavailable, "gpus", source.device_count)
    if not count:
        unavailable.setdefault("gpus", "NVML reports no GPUs")
        return GpuFacts(
            driver_version=driver, nvml_version=nvml_version, cuda_driver_version=cuda_version, unavailable=unavailable
        )

    mig_parents: dict[str, str] = {}
    probed = [_probe_one(source, i, numa_nodes, root, mig_parents) for i in range(count)]
    by_pci = {g.pci_bus_id: g.index for g, _, _ in probed if g.pci_bus_id is not None}
    gpus = []
    for gpu, links, _ in probed:
        nvlinks = tuple(
            NvLink(
                link=l.link,
                active=l.active,
                remote_pci_bus_id=l.remote_pci_bus_id,
                peer_index=None if l.remote_type == LINK_TYPE_SWITCH else by_pci.get(l.remote_pci_bus_id),
            )
            for l in links
        )
        gpus.append(_replace(gpu, nvlinks=nvlinks))
    matrix = _connection_matrix(source, probed, by_pci, unavailable)
    return GpuFacts(
        gpus=tuple(gpus),
        matrix=matrix,
        driver_version=driver,
        nvml_version=nvml_version,
        cuda_driver_version=cuda_version,
        unavailable=unavailable,
        mig_parents=mig_parents,
    )


def _probe_one(
    source: NvmlSource, index: int, numa_nodes: tuple[NumaNode, ...], root: Path, mig_parents: dict[str, str]
) -> tuple[GpuInfo, list[_Link], tuple[str, int] | None]:
    unavailable: dict[str, str] = {}
    gpu = GpuInfo(
        index=index,
        name=_ask(unavailable, "name", source.name, index),
        uuid=_ask(unavailable, "uuid", source.uuid, index),
        pci_bus_id=_ask(unavailable, "pci_bus_id", source.pci_bus_id, index),
        memory_total_bytes=_ask(unavailable, "memory_total_bytes", source.memory_total, index),
        cpu_affinity=_ask(unavailable, "cpu_affinity", source.cpu_affinity, index) or (),
    )
    numa = _gpu_numa(source, gpu, numa_nodes, root, unavailable)
    links = _links(source, index, unavailable)
    fabric = _fabric(source, index, unavailable)
    for mig in _ask(unavailable, "mig", source.mig_devices, index) or ():
        if gpu.uuid is not None:
            mig_parents[mig] = gpu.uuid
    gpu = _replace(
        gpu,
        numa_node=numa,
        fabric_cluster_uuid=fabric[0] if fabric else None,
        fabric_clique_id=fabric[1] if fabric else None,
        unavailable=tuple(sorted(unavailable.items())),
    )
    return gpu, links, fabric


def _gpu_numa(
    source: NvmlSource, gpu: GpuInfo, numa_nodes: tuple[NumaNode, ...], root: Path, unavailable: dict[str, str]
) -> int | None:
    """NUMA node of the CPUs and memory nearest the GPU.

    NVML's memory affinity first; then the kernel's view of the GPU's PCI function; then the one
    NUMA node whose CPUs hold the GPU's CPU affinity. (``nvmlDeviceGetNumaNodeId`` is not used: on
    coherent CPU-GPU systems it names the GPU's own memory node, which has no CPUs.)
    """
    reasons = []
    try:
        nodes = source.memory_affinity(gpu.index)
        if len(nodes) == 1:
            return nodes[0]
        reasons.append(f"memory affinity spans NUMA nodes {list(nodes)}")
    except NvmlQueryError as exc:
        reasons.append(f"memory affinity: {exc.reason}")
    if gpu.pci_bus_id is not None:
        domain, rest = gpu.pci_bus_id.split(":", 1)
        path = root / "bus/pci/devices" / f"{int(domain, 16):04x}:{rest.lower()}" / "numa_node"
        try:
            value = int(path.read_text().strip())
            if value >= 0:
                return value
            reasons.append(f"{path} is {value}")
        except (OSError, ValueError):
            reasons.append(f"no {path}")
    affinity = set(gpu.cpu_affinity)
    holders = [n.id for n in numa_nodes if affinity and affinity <= set(n.cpus)]
    if len(holders) == 1:
        return holders[0]
    unavailable["numa_node"] = "; ".join(reasons + ["CPU affinity is not inside one NUMA node"])
    return None


def _links(source: NvmlSource, index: int, unavailable: dict[str, str]) -> list[_Link]:
    links: list[_Link] = []
    for link in range(source.max_nvlinks()):
        try:
            active = source.nvlink_state(index, link)
        except NvmlQueryError as exc:
            if link == 0 or exc.reason not in _LINK_LIST_END:
                unavailable["nvlinks"] = exc.reason if link == 0 else f"link {link}: {exc.reason}"
            break
        remote = remote_type = None
        if active:
            remote = _ask(unavailable, "nvlinks", source.nvlink_remote_pci_bus_id, index, link)
            remote_type = _ask(unavailable, "nvlinks", source.nvlink_remote_type, index, link)
        links.append(_Link(link, active, remote, remote_type))
    return links


def _fabric(source: NvmlSource, index: int, unavailable: dict[str, str]) -> tuple[str, int] | None:
    info = _ask(unavailable, "fabric", source.fabric_info, index)
    if info is None:
        return None
    state = int(info.get("state", 0))
    if state != FABRIC_STATE_COMPLETED:
        unavailable["fabric"] = f"fabric registration {_FABRIC_STATES.get(state, state)}"
        return None
    if int(info.get("status", 0)) != 0:
        unavailable["fabric"] = f"fabric registration failed (NVML status {info.get('status')})"
        return None
    uuid = str(info.get("cluster_uuid") or _ZERO_UUID)
    if uuid == _ZERO_UUID:
        unavailable["fabric"] = "not part of a multi-node NVLink fabric (cluster UUID is zero)"
        return None
    return uuid, int(info.get("clique_id", 0))


def _connection_matrix(
    source: NvmlSource,
    probed: list[tuple[GpuInfo, list[_Link], tuple[str, int] | None]],
    by_pci: dict[str, int],
    unavailable: dict[str, str],
) -> tuple[tuple[str, ...], ...]:
    # See [Note: NVLink matrix].
    n = len(probed)
    direct = [[0] * n for _ in range(n)]
    switch_links = [0] * n
    domains: list[set[Any]] = [set() for _ in range(n)]
    for i, (_, links, fabric) in enumerate(probed):
        for l in links:
            if not l.active:
                continue
            peer = by_pci.get(l.remote_pci_bus_id) if l.remote_pci_bus_id else None
            if l.remote_type == LINK_TYPE_SWITCH:
                switch_links[i] += 1
                if l.remote_pci_bus_id is not None:
                    domains[i].add(("switch", l.remote_pci_bus_id))
            elif peer is not None and peer != i and l.remote_type in (LINK_TYPE_GPU, None):
                direct[i][peer] += 1
        if fabric is not None and switch_links[i]:
            domains[i].add(("fabric",) + fabric)
    failures = []
    rows = []
    for i in range(n):
        row = []
        for j in range(n):
            if i == j:
                row.append("X")
                continue
            nv = max(direct[i][j], direct[j][i])
            if switch_links[i] and switch_links[j] and domains[i] & domains[j]:
                nv += min(switch_links[i], switch_links[j])
            if nv:
                row.append(f"NV{nv}")
                continue
            try:
                level = source.common_ancestor(i, j)
                row.append(TOPOLOGY_CODES.get(level, UNKNOWN_CODE))
            except NvmlQueryError as exc:
                failures.append(f"GPU{i}-GPU{j}: {exc.reason}")
                row.append(UNKNOWN_CODE)
        rows.append(tuple(row))
    if failures:
        unavailable["gpu_matrix"] = f"common ancestor query failed for {len(failures)} pairs, e.g. {failures[0]}"
    return tuple(rows)


def _ask(unavailable: dict[str, str], field_name: str, fn: Callable[..., T], *args: Any) -> T | None:
    try:
        return fn(*args)
    except NvmlQueryError as exc:
        unavailable.setdefault(field_name, exc.reason)
        return None


def _replace(gpu: GpuInfo, **changes: Any) -> GpuInfo:
    return dataclasses.replace(gpu, **changes)
