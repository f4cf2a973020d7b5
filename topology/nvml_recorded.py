"""Recorded NVML answers: :class:`FakeNvml` serves them, :func:`record` writes them.

Fixtures in ``tests/fixtures/nvml`` use the format below; ``python -m hybridshard.topology.nvml record -o FILE`` saves a
real machine's answers in it, so what a GPU machine reports can become a test fixture.

Recorded-answer format (``"format": "hybridshard-nvml/1"``), written by ``python -m hybridshard.topology.nvml
record`` and served by :class:`hybridshard.topology.nvml_recorded.FakeNvml`. Any answer may be replaced by
``{"error": "<reason>"}``::

    {
      "format": "hybridshard-nvml/1",
      "description": "free text",
      "init_error": null,                        # or the reason NVML could not start
      "system": {"driver_version": "550.54.15", "nvml_version": "12.550.54.15",
                 "cuda_driver_version": 12040},
      "devices": [                               # NVML index order
        {"name": "NVIDIA H100 80GB HBM3",
         "uuid": "GPU-....",
         "pci_bus_id": "00000000:1B:00.0",
         "memory_total": 85520809984,            # bytes
         "cpu_affinity": ["0x00ffffffffffffff", ...],   # nvmlDeviceGetCpuAffinity words, low first
         "memory_affinity": ["0x1"],             # nvmlDeviceGetMemoryAffinity(scope NODE) words
         "nvlinks": [                            # links 0..n-1; the first link NVML refuses ends the list
           {"state": 1, "remote_pci_bus_id": "00000000:05:00.0", "remote_type": 2}, ...],
         "fabric": {"cluster_uuid": "....", "clique_id": 32766, "state": 3, "status": 0},
         "mig_devices": ["MIG-...."],            # UUIDs of MIG instances (empty when MIG is off)
         "clocks": {"sm_mhz": 1095, "sm_max_mhz": 1980, "temperature_c": 87, "reasons": 32}},  # optional,
                                                 # never recorded: a live reading (NvmlSource.clock_state)
        ...],
      "topology": [[null, 40, ...], ...]         # nvmlDeviceGetTopologyCommonAncestor levels
    }

``remote_type`` and topology levels are NVML's numbers (``NVML_NVLINK_DEVICE_TYPE_*``:
0 GPU, 1 IBMNPU, 2 SWITCH, 255 UNKNOWN; ``NVML_TOPOLOGY_*``: 0 INTERNAL, 10 SINGLE, 20 MULTIPLE,
30 HOSTBRIDGE, 40 NODE, 50 SYSTEM). An inactive link has no remote fields.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Mapping

from hybridshard.topology.nvml import (
    FORMAT,
    NvmlQueryError,
    NvmlSource,
    NvmlUnavailable,
    bits_from_words,
    normalize_pci_bus_id,
    words_for,
)

__all__ = ["FakeNvml", "record"]

_MISSING: Any = object()
_WORD_BITS = 64


class FakeNvml(NvmlSource):
    """Serves recorded NVML answers (see the module docstring for the format).

    ``fail`` makes named queries fail with a reason, for testing failure paths: a key is a query name
    (``"fabric_info"``, ``"cpu_affinity"``, ``"common_ancestor"``, ``"init"``, ...) for every device,
    or ``"query:index"`` for one device.
    """

    def __init__(self, data: Mapping[str, Any], *, fail: Mapping[str, str] | None = None) -> None:
        if data.get("format") != FORMAT:
            raise ValueError(
                f"NVML fixture format must be {FORMAT!r}, found {data.get('format')!r}; "
                "record one with `python -m hybridshard.topology.nvml record -o FILE`"
            )
        self.data = data
        self.fail = dict(fail or {})
        self.initialised = False

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], *, fail: Mapping[str, str] | None = None) -> "FakeNvml":
        with open(path, encoding="utf-8") as f:
            return cls(json.load(f), fail=fail)

    def init(self) -> None:
        reason = self.fail.get("init") or self.data.get("init_error")
        if reason:
            raise NvmlUnavailable(reason)
        self.initialised = True

    def shutdown(self) -> None:
        self.initialised = False

    def _answer(self, query: str, value: Any, index: int | None = None) -> Any:
        if not self.initialised:
            raise NvmlQueryError(query, "Uninitialized")
        reason = self.fail.get(query) if index is None else self.fail.get(f"{query}:{index}", self.fail.get(query))
        if reason:
            raise NvmlQueryError(query, reason)
        if value is _MISSING:
            raise NvmlQueryError(query, "Not Found in recording")
        if isinstance(value, Mapping) and set(value) == {"error"}:
            raise NvmlQueryError(query, str(value["error"]))
        return value

    def _device(self, query: str, index: int) -> dict[str, Any]:
        devices = self.data.get("devices")
        if not isinstance(devices, list):
            raise NvmlQueryError(query, "Invalid Argument")
        if not 0 <= index < len(devices):
            raise NvmlQueryError(query, "Invalid Argument")
        return devices[index]

    def _field(self, query: str, index: int, key: str) -> Any:
        return self._answer(query, self._device(query, index).get(key, _MISSING), index)

    def _link(self, query: str, index: int, link: int) -> Mapping[str, Any]:
        links = self._field(query, index, "nvlinks")
        if not 0 <= link < len(links):
            raise NvmlQueryError(query, "Invalid Argument")
        return links[link]

    def driver_version(self) -> str:
        return self._answer("driver_version", self.data.get("system", {}).get("driver_version", _MISSING))

    def nvml_version(self) -> str:
        return self._answer("nvml_version", self.data.get("system", {}).get("nvml_version", _MISSING))

    def cuda_driver_version(self) -> int:
        return int(
            self._answer("cuda_driver_version", self.data.get("system", {}).get("cuda_driver_version", _MISSING))
        )

    def device_count(self) -> int:
        devices = self.data.get("devices")
        return len(self._answer("device_count", devices if devices is not None else _MISSING))

    def name(self, index: int) -> str:
        return str(self._field("name", index, "name"))

    def uuid(self, index: int) -> str:
        return str(self._field("uuid", index, "uuid"))

    def pci_bus_id(self, index: int) -> str:
        bus_id = normalize_pci_bus_id(self._field("pci_bus_id", index, "pci_bus_id"))
        if bus_id is None:
            raise NvmlQueryError("pci_bus_id", "NVML returned an empty PCI bus id")
        return bus_id

    def memory_total(self, index: int) -> int:
        return int(self._field("memory_total", index, "memory_total"))

    def cpu_affinity(self, index: int) -> tuple[int, ...]:
        return bits_from_words(self._field("cpu_affinity", index, "cpu_affinity"))

    def memory_affinity(self, index: int) -> tuple[int, ...]:
        return bits_from_words(self._field("memory_affinity", index, "memory_affinity"))

    def nvlink_state(self, index: int, link: int) -> bool:
        entry = self._link("nvlink_state", index, link)
        return bool(self._answer("nvlink_state", entry.get("state", _MISSING), index))

    def nvlink_remote_pci_bus_id(self, index: int, link: int) -> str | None:
        entry = self._link("nvlink_remote_pci", index, link)
        return normalize_pci_bus_id(self._answer("nvlink_remote_pci", entry.get("remote_pci_bus_id", _MISSING), index))

    def nvlink_remote_type(self, index: int, link: int) -> int:
        entry = self._link("nvlink_remote_type", index, link)
        return int(self._answer("nvlink_remote_type", entry.get("remote_type", _MISSING), index))

    def fabric_info(self, index: int) -> dict[str, Any]:
        return dict(self._field("fabric_info", index, "fabric"))

    def mig_devices(self, index: int) -> tuple[str, ...]:
        return tuple(self._field("mig_devices", index, "mig_devices"))

    def clock_state(self, index: int) -> dict[str, int]:
        return {k: int(v) for k, v in self._field("clock_state", index, "clocks").items()}

    def common_ancestor(self, index_a: int, index_b: int) -> int:
        self._device("common_ancestor", index_a)
        self._device("common_ancestor", index_b)
        matrix = self.data.get("topology")
        row = matrix[index_a] if matrix is not None and index_a < len(matrix) else _MISSING
        value = row[index_b] if row is not _MISSING and index_b < len(row) else _MISSING
        return int(self._answer("common_ancestor", value, index_a))


def record(source: NvmlSource, *, description: str = "") -> dict[str, Any]:
    """Ask ``source`` every query and return the answers in the recorded format."""
    data: dict[str, Any] = {"format": FORMAT, "description": description, "init_error": None}
    try:
        source.init()
    except NvmlUnavailable as exc:
        data["init_error"] = exc.reason
        return data
    try:
        data["system"] = {
            "driver_version": _ask(source.driver_version),
            "nvml_version": _ask(source.nvml_version),
            "cuda_driver_version": _ask(source.cuda_driver_version),
        }
        count = _ask(source.device_count)
        if isinstance(count, dict):
            data["devices"] = count
            return data
        data["devices"] = [_record_device(source, i) for i in range(count)]
        data["topology"] = [
            [None if a == b else _ask(source.common_ancestor, a, b) for b in range(count)] for a in range(count)
        ]
    finally:
        source.shutdown()
    return data


def _record_device(source: NvmlSource, index: int) -> dict[str, Any]:
    dev: dict[str, Any] = {
        "name": _ask(source.name, index),
        "uuid": _ask(source.uuid, index),
        "pci_bus_id": _ask(source.pci_bus_id, index),
        "memory_total": _ask(source.memory_total, index),
        "cpu_affinity": _ask_mask(source.cpu_affinity, index),
        "memory_affinity": _ask_mask(source.memory_affinity, index),
    }
    links: list[dict[str, Any]] = []
    for link in range(source.max_nvlinks()):
        state = _ask(source.nvlink_state, index, link)
        if isinstance(state, dict):
            if link == 0:
                links = state  # type: ignore[assignment]  # the whole list is one error answer
            break
        entry: dict[str, Any] = {"state": int(state)}
        if state:
            entry["remote_pci_bus_id"] = _ask(source.nvlink_remote_pci_bus_id, index, link) or "00000000:00:00.0"
            entry["remote_type"] = _ask(source.nvlink_remote_type, index, link)
        links.append(entry)
    dev["nvlinks"] = links
    dev["fabric"] = _ask(source.fabric_info, index)
    migs = _ask(source.mig_devices, index)
    dev["mig_devices"] = list(migs) if isinstance(migs, tuple) else migs
    return dev


def _ask(fn: Callable[..., Any], *args: Any) -> Any:
    try:
        return fn(*args)
    except NvmlQueryError as exc:
        return {"error": exc.reason}


def _ask_mask(fn: Callable[[int], tuple[int, ...]], index: int) -> Any:
    bits = _ask(fn, index)
    if isinstance(bits, dict):
        return bits
    words = [0] * words_for(max(bits, default=0) + 1)
    for b in bits:
        words[b // _WORD_BITS] |= 1 << (b % _WORD_BITS)
    return [f"0x{w:016x}" for w in words]
