"""The real NVML adapter (``PynvmlSource``), over a stand-in ``pynvml`` built from the real bindings' types.

No GPU is needed: the stand-in module answers like a driver would, through the same ctypes structures
nvidia-ml-py defines, so the adapter's calls, conversions and failure handling are exercised as written.
"""

from __future__ import annotations

import sys
import types

import pytest

from hybridshard.topology.nvml_recorded import FakeNvml, record
from hybridshard.topology.probe import probe_node


def _stand_in_pynvml():
    """A module with pynvml's error classes, constants and ctypes structs, whose query functions
    answer like a 2-GPU PCIe box (GPU 0 <-> GPU 1 over 2 NVLinks) on a driver without
    ``nvmlSystemGetCudaDriverVersion`` and with fabric info only on GPU 0."""
    import ctypes

    import pynvml as real

    m = types.ModuleType("pynvml")
    for name in dir(real):
        if name.startswith(("NVML_", "NVMLError", "c_nvml", "nvmlPciInfo_t")) or name == "byref":
            setattr(m, name, getattr(real, name))
    err = real.NVMLError
    pci = ["00000000:1B:00.0", "00000000:43:00.0"]

    def words(bits, n):
        arr = (ctypes.c_ulonglong * n)()
        for b in bits:
            arr[b // 64] |= 1 << (b % 64)
        return arr

    def pci_info(bus_id):
        info = real.nvmlPciInfo_t()
        info.busId = bus_id.encode()
        return info

    def fabric(h, ref):
        if h == 1:
            raise err(real.NVML_ERROR_NOT_SUPPORTED)
        info = ref._obj
        info.clusterUuid[:] = list(range(16))
        info.cliqueId, info.state, info.status = 7, real.NVML_GPU_FABRIC_STATE_COMPLETED, 0

    def link_state(h, link):
        if link >= 2:
            raise err(real.NVML_ERROR_INVALID_ARGUMENT)
        return 1

    def mig_mode(h):
        raise err(real.NVML_ERROR_NOT_SUPPORTED)

    m.nvmlInit = lambda: None
    m.nvmlShutdown = lambda: None
    m.nvmlSystemGetDriverVersion = lambda: "550.54.15"
    m.nvmlSystemGetNVMLVersion = lambda: b"12.550.54.15"
    m.nvmlDeviceGetCount = lambda: 2
    m.nvmlDeviceGetHandleByIndex = lambda i: i
    m.nvmlDeviceGetName = lambda h: "NVIDIA H100 PCIe"
    m.nvmlDeviceGetUUID = lambda h: f"GPU-0000000{h}-1111-2222-3333-444444444444"
    m.nvmlDeviceGetPciInfo = lambda h: pci_info(pci[h].lower().replace("00000000:", "0000:"))
    m.nvmlDeviceGetMemoryInfo = lambda h: real.c_nvmlMemory_t(total=80 * 2**30, free=0, used=0)
    m.nvmlDeviceGetCpuAffinity = lambda h, n: words([h * 8 + c for c in range(8)] + [70], max(n, 2))
    m.nvmlDeviceGetMemoryAffinity = lambda h, n, scope: words([h], n)
    m.nvmlDeviceGetNvLinkState = link_state
    m.nvmlDeviceGetNvLinkRemotePciInfo = lambda h, link: pci_info(pci[1 - h])
    m.nvmlDeviceGetNvLinkRemoteDeviceType = lambda h, link: real.NVML_NVLINK_DEVICE_TYPE_GPU
    m.nvmlDeviceGetGpuFabricInfoV = fabric
    m.nvmlDeviceGetMigMode = mig_mode
    m.nvmlDeviceGetTopologyCommonAncestor = lambda a, b: real.NVML_TOPOLOGY_HOSTBRIDGE
    return m


def test_pynvml_source_adapts_the_bindings(monkeypatch, tmp_path):
    from hybridshard.topology.nvml import PynvmlSource

    monkeypatch.setitem(sys.modules, "pynvml", _stand_in_pynvml())
    node = probe_node(PynvmlSource(), sysfs_root=tmp_path)
    g0, g1 = node.gpus
    assert (g0.name, g0.uuid, g0.pci_bus_id) == (
        "NVIDIA H100 PCIe",
        "GPU-00000000-1111-2222-3333-444444444444",
        "00000000:1B:00.0",
    )
    assert g0.memory_total_bytes == 80 * 2**30 and g0.cpu_affinity == (*range(8), 70) and g1.numa_node == 1
    assert [l.peer_index for l in g0.nvlinks] == [1, 1] and node.gpu_matrix == (("X", "NV2"), ("NV2", "X"))
    assert (g0.fabric_cluster_uuid, g0.fabric_clique_id) == ("00010203-0405-0607-0809-0a0b0c0d0e0f", 7)
    assert g1.unavailable_map == {"fabric": "Not Supported"} and g1.fabric_cluster_uuid is None
    assert node.driver_version == "550.54.15" and node.nvml_version == "12.550.54.15"
    assert node.cuda_driver_version is None and node.unavailable_map["cuda_driver_version"].startswith(
        "Function Not Found"
    )
    data = record(PynvmlSource())
    assert data["devices"][0]["cpu_affinity"] == ["0x00000000000000ff", "0x0000000000000040"]
    assert data["devices"][1]["fabric"] == {"error": "Not Supported"} and data["topology"][0][1] == 30
    assert probe_node(FakeNvml(data), sysfs_root=tmp_path) == node  # a recording probes the same


def test_pynvml_source_without_library(monkeypatch, tmp_path):
    import pynvml as real

    from hybridshard.topology.nvml import NvmlUnavailable, PynvmlSource

    def no_library():
        raise real.NVMLError(real.NVML_ERROR_LIBRARY_NOT_FOUND)

    stub = types.ModuleType("pynvml")
    stub.NVMLError = real.NVMLError
    stub.nvmlInit = no_library
    monkeypatch.setitem(sys.modules, "pynvml", stub)
    with pytest.raises(NvmlUnavailable, match="NVML Shared Library Not Found"):
        PynvmlSource().init()
    monkeypatch.setitem(sys.modules, "pynvml", None)  # bindings not installed
    node = probe_node(PynvmlSource(), sysfs_root=tmp_path)
    assert node.gpus == () and "nvidia-ml-py is not installed" in node.unavailable_map["gpus"]
