"""The NVML queries discovery (and the straggler report's clocks) needs, behind one injectable interface.

This is the only module that imports ``pynvml`` (from ``nvidia-ml-py``). :mod:`hybridshard.topology.probe` asks
an :class:`NvmlSource` for raw answers and turns them into records; it never touches NVML itself, so
tests pass a :class:`~hybridshard.topology.nvml_recorded.FakeNvml` that serves answers recorded in a JSON file.

Every query either returns a raw answer or raises :class:`NvmlQueryError` carrying the reason (the
NVML error string, e.g. ``"Not Supported"``, or ``"Function Not Found"`` when the installed driver or
bindings lack the function). :meth:`NvmlSource.init` raises :class:`NvmlUnavailable` when there is no
library or driver at all.

The recorded-answer format (``FORMAT``) that tests and ``python -m hybridshard.topology.nvml record`` use is
documented in :mod:`hybridshard.topology.nvml_recorded`.
"""

from __future__ import annotations

import abc
import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any, Callable, TypeVar

logger = logging.getLogger(__name__)

__all__ = [
    "FORMAT",
    "NvmlQueryError",
    "NvmlUnavailable",
    "NvmlSource",
    "PynvmlSource",
    "LINK_TYPE_GPU",
    "LINK_TYPE_SWITCH",
    "TOPOLOGY_CODES",
    "bits_from_words",
    "normalize_pci_bus_id",
    "words_for",
    "FakeNvml",
    "record",
]

FORMAT = "hybridshard-nvml/1"

LINK_TYPE_GPU = 0
LINK_TYPE_IBMNPU = 1
LINK_TYPE_SWITCH = 2
LINK_TYPE_UNKNOWN = 255

FABRIC_STATE_COMPLETED = 3

TOPOLOGY_CODES: dict[int, str] = {
    0: "PIX",  # NVML_TOPOLOGY_INTERNAL: two GPUs on one board; nothing closer exists on PCIe.
    10: "PIX",  # NVML_TOPOLOGY_SINGLE: at most one PCIe bridge
    20: "PXB",  # NVML_TOPOLOGY_MULTIPLE: several PCIe bridges, no host bridge
    30: "PHB",  # NVML_TOPOLOGY_HOSTBRIDGE: through a PCIe host bridge
    40: "NODE",  # NVML_TOPOLOGY_NODE: between host bridges inside one NUMA node
    50: "SYS",  # NVML_TOPOLOGY_SYSTEM: across the inter-socket link
}
"""NVML common-ancestor level -> the ``nvidia-smi topo -m`` code for it."""

_NVLINK_MAX_LINKS = 36  # NVML_NVLINK_MAX_LINKS in current bindings; the loop stops at the first refusal.
_WORD_BITS = 64

T = TypeVar("T")


class NvmlUnavailable(RuntimeError):
    """NVML cannot be used at all (no bindings, no library, no driver); ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class NvmlQueryError(RuntimeError):
    """One query failed; ``reason`` is NVML's error string (``"Not Supported"``, ...)."""

    def __init__(self, query: str, reason: str) -> None:
        super().__init__(f"{query}: {reason}")
        self.query = query
        self.reason = reason


def normalize_pci_bus_id(bus_id: str | bytes | None) -> str | None:
    """``"0000:1b:00.0"`` or ``"00000000:1B:00.0"`` -> ``"00000000:1B:00.0"``; all-zero ids -> ``None``.

    NVML prints an 8-digit domain in upper case; sysfs and ``CUDA_VISIBLE_DEVICES`` tools often use 4.
    """
    if bus_id is None:
        return None
    if isinstance(bus_id, bytes):
        bus_id = bus_id.decode(errors="replace")
    text = bus_id.strip().rstrip("\x00")
    parts = text.split(":")
    if len(parts) == 2:
        parts.insert(0, "0")
    if len(parts) != 3 or "." not in parts[2]:
        return text.upper() or None
    domain, bus, devfn = parts
    dev, _, fn = devfn.partition(".")
    try:
        out = f"{int(domain, 16):08X}:{int(bus, 16):02X}:{int(dev, 16):02X}.{int(fn, 16):X}"
    except ValueError:
        return text.upper()
    return None if out == "00000000:00:00.0" else out


def bits_from_words(words: Any) -> tuple[int, ...]:
    """Set bit positions of an NVML bitmask given as 64-bit words, low word first.

    Words may be ints or hex strings (the recorded format). ``["0x5", "0x1"]`` -> ``(0, 2, 64)``.
    """
    out = []
    for w, word in enumerate(words):
        value = int(word, 16) if isinstance(word, str) else int(word)
        bit = 0
        while value:
            if value & 1:
                out.append(w * _WORD_BITS + bit)
            value >>= 1
            bit += 1
    return tuple(out)


class NvmlSource(abc.ABC):
    """The NVML queries discovery uses. Each query returns a raw answer or raises NvmlQueryError."""

    def init(self) -> None:
        """Start NVML; raise :class:`NvmlUnavailable` when it cannot be used."""

    def shutdown(self) -> None:
        """Release NVML (safe to call after a failed :meth:`init`)."""

    @abc.abstractmethod
    def driver_version(self) -> str: ...

    @abc.abstractmethod
    def nvml_version(self) -> str: ...

    @abc.abstractmethod
    def cuda_driver_version(self) -> int: ...

    @abc.abstractmethod
    def device_count(self) -> int: ...

    @abc.abstractmethod
    def name(self, index: int) -> str: ...

    @abc.abstractmethod
    def uuid(self, index: int) -> str: ...

    @abc.abstractmethod
    def pci_bus_id(self, index: int) -> str: ...

    @abc.abstractmethod
    def memory_total(self, index: int) -> int:
        """Total framebuffer memory in bytes."""

    @abc.abstractmethod
    def cpu_affinity(self, index: int) -> tuple[int, ...]:
        """Logical CPU ids NVML considers close to the GPU."""

    @abc.abstractmethod
    def memory_affinity(self, index: int) -> tuple[int, ...]:
        """NUMA node ids close to the GPU (scope NODE)."""

    @abc.abstractmethod
    def nvlink_state(self, index: int, link: int) -> bool: ...

    @abc.abstractmethod
    def nvlink_remote_pci_bus_id(self, index: int, link: int) -> str | None:
        """PCI bus id at the far end of an active link, normalised; ``None`` when NVML reports zeros."""

    @abc.abstractmethod
    def nvlink_remote_type(self, index: int, link: int) -> int:
        """``NVML_NVLINK_DEVICE_TYPE_*`` of the far end (0 GPU, 2 switch, ...)."""

    @abc.abstractmethod
    def fabric_info(self, index: int) -> dict[str, Any]:
        """``{"cluster_uuid": str, "clique_id": int, "state": int, "status": int}``."""

    @abc.abstractmethod
    def mig_devices(self, index: int) -> tuple[str, ...]:
        """UUIDs of the MIG instances on the GPU (empty when MIG is off)."""

    @abc.abstractmethod
    def common_ancestor(self, index_a: int, index_b: int) -> int:
        """``nvmlDeviceGetTopologyCommonAncestor`` level between two GPUs."""

    def max_nvlinks(self) -> int:
        return _NVLINK_MAX_LINKS

    def clock_state(self, index: int) -> dict[str, int]:
        """``{"sm_mhz", "sm_max_mhz", "temperature_c", "reasons"}`` (clocks-event reason bits) right now."""
        raise NvmlQueryError("clock_state", "Function Not Found")


class PynvmlSource(NvmlSource):
    """Queries the real NVML through ``pynvml``.

    Every call is wrapped: ``NVMLError`` becomes :class:`NvmlQueryError` with NVML's message, and an
    ``AttributeError`` (a function the installed bindings lack) becomes ``"Function Not Found"``.
    """

    def __init__(self) -> None:
        self._nvml: Any = None
        self._handles: dict[int, Any] = {}

    def init(self) -> None:
        try:
            import pynvml
        except ImportError as exc:
            raise NvmlUnavailable(f"nvidia-ml-py is not installed ({exc}); pip install nvidia-ml-py") from exc
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise NvmlUnavailable(str(exc) or type(exc).__name__) from exc
        except OSError as exc:  # a library that exists but does not load
            raise NvmlUnavailable(f"NVML library failed to load: {exc}") from exc
        self._nvml = pynvml
        self._handles = {}

    def shutdown(self) -> None:
        if self._nvml is None:
            return
        try:
            self._nvml.nvmlShutdown()
        except self._nvml.NVMLError as exc:
            logger.debug("nvmlShutdown failed: %s", exc)
        self._nvml = None
        self._handles = {}

    def _call(self, query: str, fn: Callable[[Any], T]) -> T:
        if self._nvml is None:
            raise NvmlQueryError(query, "NVML is not initialised")
        try:
            return fn(self._nvml)
        except self._nvml.NVMLError as exc:
            raise NvmlQueryError(query, str(exc) or type(exc).__name__) from exc
        except AttributeError as exc:
            raise NvmlQueryError(query, f"Function Not Found ({exc})") from exc

    def _handle(self, index: int) -> Any:
        if index not in self._handles:
            self._handles[index] = self._call("handle", lambda n: n.nvmlDeviceGetHandleByIndex(index))
        return self._handles[index]

    def _dev(self, query: str, index: int, fn: Callable[[Any, Any], T]) -> T:
        handle = self._handle(index)
        return self._call(query, lambda n: fn(n, handle))

    def driver_version(self) -> str:
        return _text(self._call("driver_version", lambda n: n.nvmlSystemGetDriverVersion()))

    def nvml_version(self) -> str:
        return _text(self._call("nvml_version", lambda n: n.nvmlSystemGetNVMLVersion()))

    def cuda_driver_version(self) -> int:
        return int(self._call("cuda_driver_version", lambda n: n.nvmlSystemGetCudaDriverVersion()))

    def device_count(self) -> int:
        return int(self._call("device_count", lambda n: n.nvmlDeviceGetCount()))

    def name(self, index: int) -> str:
        return _text(self._dev("name", index, lambda n, h: n.nvmlDeviceGetName(h)))

    def uuid(self, index: int) -> str:
        return _text(self._dev("uuid", index, lambda n, h: n.nvmlDeviceGetUUID(h)))

    def pci_bus_id(self, index: int) -> str:
        info = self._dev("pci_bus_id", index, lambda n, h: n.nvmlDeviceGetPciInfo(h))
        bus_id = normalize_pci_bus_id(info.busId)
        if bus_id is None:
            raise NvmlQueryError("pci_bus_id", "NVML returned an empty PCI bus id")
        return bus_id

    def memory_total(self, index: int) -> int:
        return int(self._dev("memory_total", index, lambda n, h: n.nvmlDeviceGetMemoryInfo(h)).total)

    def cpu_affinity(self, index: int) -> tuple[int, ...]:
        num_words = words_for(_possible("cpu", os.cpu_count() or 1))
        words = self._dev("cpu_affinity", index, lambda n, h: n.nvmlDeviceGetCpuAffinity(h, num_words))
        return bits_from_words(list(words))

    def memory_affinity(self, index: int) -> tuple[int, ...]:
        num_words = words_for(_possible("node", _WORD_BITS))
        words = self._dev(
            "memory_affinity",
            index,
            lambda n, h: n.nvmlDeviceGetMemoryAffinity(h, num_words, n.NVML_AFFINITY_SCOPE_NODE),
        )
        return bits_from_words(list(words))

    def nvlink_state(self, index: int, link: int) -> bool:
        return bool(self._dev("nvlink_state", index, lambda n, h: n.nvmlDeviceGetNvLinkState(h, link)))

    def nvlink_remote_pci_bus_id(self, index: int, link: int) -> str | None:
        info = self._dev("nvlink_remote_pci", index, lambda n, h: n.nvmlDeviceGetNvLinkRemotePciInfo(h, link))
        return normalize_pci_bus_id(info.busId)

    def nvlink_remote_type(self, index: int, link: int) -> int:
        return int(self._dev("nvlink_remote_type", index, lambda n, h: n.nvmlDeviceGetNvLinkRemoteDeviceType(h, link)))

    def fabric_info(self, index: int) -> dict[str, Any]:
        def query(n: Any, h: Any) -> Any:
            # The versioned call is the current one; drivers older than it only have the plain call.
            if hasattr(n, "nvmlDeviceGetGpuFabricInfoV"):
                try:
                    info = n.c_nvmlGpuFabricInfoV_t()
                    n.nvmlDeviceGetGpuFabricInfoV(h, n.byref(info))
                    return info
                except n.NVMLError as exc:
                    if getattr(exc, "value", None) != n.NVML_ERROR_FUNCTION_NOT_FOUND:
                        raise
            info = n.c_nvmlGpuFabricInfo_t()
            n.nvmlDeviceGetGpuFabricInfo(h, n.byref(info))
            return info

        info = self._dev("fabric_info", index, query)
        return {
            "cluster_uuid": _format_uuid(bytes(info.clusterUuid)),
            "clique_id": int(info.cliqueId),
            "state": int(info.state),
            "status": int(info.status),
        }

    def mig_devices(self, index: int) -> tuple[str, ...]:
        def query(n: Any, h: Any) -> tuple[str, ...]:
            try:
                current, _pending = n.nvmlDeviceGetMigMode(h)
            except n.NVMLError as exc:
                if getattr(exc, "value", None) == n.NVML_ERROR_NOT_SUPPORTED:
                    return ()
                raise
            if not current:
                return ()
            out = []
            for i in range(n.nvmlDeviceGetMaxMigDeviceCount(h)):
                try:
                    out.append(_text(n.nvmlDeviceGetUUID(n.nvmlDeviceGetMigDeviceHandleByIndex(h, i))))
                except n.NVMLError:
                    continue  # an unused MIG slot
            return tuple(out)

        return self._dev("mig_devices", index, query)

    def common_ancestor(self, index_a: int, index_b: int) -> int:
        handle_b = self._handle(index_b)
        return int(
            self._dev("common_ancestor", index_a, lambda n, h: n.nvmlDeviceGetTopologyCommonAncestor(h, handle_b))
        )

    def clock_state(self, index: int) -> dict[str, int]:
        def query(n: Any, h: Any) -> dict[str, Any]:  # the event reasons are the throttle reasons renamed (NVML 12.2)
            reasons = getattr(n, "nvmlDeviceGetCurrentClocksEventReasons", None) or n.nvmlDeviceGetCurrentClocksThrottleReasons
            return {"sm_mhz": n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM), "sm_max_mhz": n.nvmlDeviceGetMaxClockInfo(h, n.NVML_CLOCK_SM),
                    "temperature_c": n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU), "reasons": reasons(h)}
        return {k: int(v) for k, v in self._dev("clock_state", index, query).items()}


def words_for(num_bits: int) -> int:
    return max(1, -(-num_bits // _WORD_BITS))


def _possible(kind: str, fallback: int) -> int:
    """How many CPU or NUMA node ids the kernel may use (``/sys/devices/system/<kind>/possible``)."""
    try:
        with open(f"/sys/devices/system/{kind}/possible", encoding="ascii") as f:
            text = f.read().strip()
        return max(int(part.split("-")[-1]) for part in text.split(",")) + 1
    except (OSError, ValueError):
        return fallback


def _text(value: str | bytes) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _format_uuid(raw: bytes) -> str:
    h = raw.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def __getattr__(name: str) -> Any:
    # The recorded-answer side (FakeNvml, record) lives in hybridshard.topology.nvml_recorded, which imports this
    # module; it is importable from here too, resolved on first use to avoid a circular import.
    if name in ("FakeNvml", "record"):
        from hybridshard.topology import nvml_recorded

        return getattr(nvml_recorded, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hybridshard.topology.nvml", description="Record this machine's NVML answers.")
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="write every answer discovery uses, in the fixture format")
    rec.add_argument("-o", "--output", type=Path, help="file to write (default: stdout)")
    rec.add_argument("--description", default="", help="free text stored with the answers")
    args = parser.parse_args(argv)
    # Under ``python -m`` this file runs as ``__main__``, a second copy of the module; use the
    # importable one so its exception classes are the ones ``record`` catches.
    from hybridshard.topology import nvml
    from hybridshard.topology.nvml_recorded import record

    text = json.dumps(record(nvml.PynvmlSource(), description=args.description), indent=1) + "\n"
    if args.output is None:
        sys.stdout.write(text)
    else:
        args.output.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
