"""A rank's GPU in the straggler report: its SM clock against its max, temperature and clocks-event reasons.

[Note: clocks in the evidence]
Each CUDA rank reads its GPU through :class:`hybridshard.topology.nvml.NvmlSource` once per report, as it
publishes its summary (never in a hook or per step): a few NVML calls, tens of microseconds. The GPU
is found once, by the CUDA device's UUID (else its PCI id) among NVML's devices, so its index is the
one ``nvidia-smi`` prints whatever ``CUDA_VISIBLE_DEVICES`` says. The reading is one sample at the
start of a forward, not an average: a GPU throttling on and off may read at full clocks once. A
compute verdict (rank, node, replica group) puts its ranks' readings in its action: a slowing reason
(thermal, power cap, HW slowdown...) names what to check; full clocks and none say the GPU's clocks
are not the cause. Where NVML does not answer (no driver, CPU ranks) the summary has no reading and
the verdict's text is unchanged.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import torch

from hybridshard.topology.nvml import NvmlQueryError, NvmlSource, NvmlUnavailable, PynvmlSource, normalize_pci_bus_id

if TYPE_CHECKING:
    from hybridshard.runtime.faults.verdicts import RankSummary, Verdict

logger = logging.getLogger(__name__)

__all__ = ["REASONS", "GpuReader", "GpuState", "cuda_identity", "decode_reasons", "find_index", "with_gpu_evidence"]

REASONS: tuple[tuple[int, str], ...] = (
    (0x1, "idle"), (0x2, "application clocks setting"), (0x4, "power cap"), (0x8, "HW slowdown"),
    (0x10, "sync boost"), (0x20, "thermal slowdown"), (0x40, "HW thermal slowdown"), (0x80, "HW power brake"),
    (0x100, "display clock setting"), (0x200, "board limit"), (0x400, "reliability limit"),
)
"""NVML's clocks-event (formerly throttle) reason bits, in words."""
_NOT_SLOWING = {"idle", "display clock setting"}
_ADVICE = (  # the first reason present picks the advice
    ({"thermal slowdown", "HW thermal slowdown"}, "check its cooling (fans, airflow, inlet temperature: "
                                                  "nvidia-smi -q -d TEMPERATURE)"),
    ({"HW power brake", "HW slowdown"}, "the board slows itself (power brake, power supply or overheating): "
                                        "check the node's power supplies and its BMC log"),
    ({"power cap"}, "it runs at its power limit: nvidia-smi -q -d POWER (a lowered limit, or a board drawing more)"),
    ({"board limit", "reliability limit"}, "the board holds its clocks down: nvidia-smi -q -d PERFORMANCE"),
    ({"sync boost"}, "a GPU of its sync boost group holds it back"),
    ({"application clocks setting"}, "its application clocks are set below the max: nvidia-smi -rac resets them"),
)


def decode_reasons(bits: int) -> tuple[str, ...]:
    """``0x24`` -> ``("power cap", "thermal slowdown")``; an unknown bit reads ``"reason 0x800"``."""
    words = [word for bit, word in REASONS if bits & bit]
    rest = bits & ~sum(bit for bit, _ in REASONS)
    return tuple(words) + ((f"reason {rest:#x}",) if rest else ())


@dataclass(frozen=True)
class GpuState:
    """One GPU, read once at a report's end."""

    index: int
    """NVML's index: ``nvidia-smi``'s "GPU n"."""
    sm_mhz: int
    sm_max_mhz: int
    temperature_c: int
    reasons: tuple[str, ...] = ()
    """Clocks-event reasons in words (:data:`REASONS`)."""

    @property
    def slowing(self) -> tuple[str, ...]:
        """The reasons that hold the clocks down (not "idle" or "display clock setting")."""
        return tuple(r for r in self.reasons if r not in _NOT_SLOWING)

    def text(self) -> str:
        """``"GPU 3 at 1,095 of 1,980 MHz, 87 C, thermal slowdown"`` (``"no clocks event"`` when none)."""
        return (f"GPU {self.index} at {self.sm_mhz:,} of {self.sm_max_mhz:,} MHz, {self.temperature_c} C, "
                f"{', '.join(self.slowing) or 'no clocks event'}")

    def advice(self) -> str:
        """What to check for its first slowing reason; empty when none."""
        return next((text for words, text in _ADVICE if words & set(self.slowing)), "")

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "reasons": list(self.reasons)}

    @classmethod
    def from_json(cls, d: Mapping[str, Any] | None) -> "GpuState | None":
        if not d:
            return None
        return cls(int(d["index"]), int(d["sm_mhz"]), int(d["sm_max_mhz"]), int(d["temperature_c"]),
                   tuple(str(r) for r in d.get("reasons", ())))


def find_index(source: NvmlSource, uuid: str | None, pci_bus_id: str | None) -> int | None:
    """NVML's index of the GPU with this UUID (``"GPU-"`` prefix optional), else this PCI id; ``None`` if none."""
    count = source.device_count()
    want = (uuid or "").lower().removeprefix("gpu-")
    for i in range(count):
        if want and source.uuid(i).lower().removeprefix("gpu-") == want:
            return i
    want_pci = normalize_pci_bus_id(pci_bus_id)
    for i in range(count):
        if want_pci and source.pci_bus_id(i) == want_pci:
            return i
    return None


def cuda_identity(device: torch.device) -> tuple[str | None, str | None]:
    """The CUDA device's ``(uuid, pci bus id)`` as torch knows them (``None`` where it does not)."""
    props = torch.cuda.get_device_properties(device)
    uuid = str(props.uuid) if getattr(props, "uuid", None) is not None else None
    pci = None
    if hasattr(props, "pci_bus_id"):
        pci = f"{getattr(props, 'pci_domain_id', 0):08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0"
    return uuid, pci


class GpuReader:
    """One rank's GPU in NVML: found on the first :meth:`read`, read at each; see [Note: clocks in the evidence]."""

    def __init__(self, device: torch.device, source: NvmlSource | None = None) -> None:
        self.device, self.source = device, source
        self.index: int | None = None
        self.unavailable: str | None = None
        """Why there is no reading (logged once); ``None`` while readings come."""

    def read(self) -> GpuState | None:
        if self.unavailable is not None:
            return None
        try:
            if self.index is None:
                self._find()
            state = self.source.clock_state(self.index)
        except (NvmlUnavailable, NvmlQueryError, RuntimeError, AssertionError) as err:
            self.unavailable = str(err) or type(err).__name__
            logger.info("straggler report: no GPU clocks for %s (%s); its evidence leaves them out",
                        self.device, self.unavailable)
            return None
        return GpuState(self.index, state["sm_mhz"], state["sm_max_mhz"], state["temperature_c"],
                        decode_reasons(state["reasons"]))

    def _find(self) -> None:
        if self.source is None:
            self.source = PynvmlSource()
        self.source.init()
        index = find_index(self.source, *cuda_identity(self.device))
        if index is None:
            raise RuntimeError(f"NVML lists no GPU with {self.device}'s UUID or PCI id")
        self.index = index


def with_gpu_evidence(verdicts: Sequence["Verdict"], summaries: Sequence["RankSummary"]) -> list["Verdict"]:
    """The compute verdicts with their ranks' GPU readings in the action; see [Note: clocks in the evidence]."""
    gpu_of = {s.rank: s.gpu for s in summaries if s.gpu is not None}
    out = []
    for v in verdicts:
        states = [gpu_of[r] for r in v.ranks if r in gpu_of]
        if v.group != "compute" or not states:
            out.append(v)
            continue
        slowed = [g for g in states if g.slowing]
        if slowed:
            action = "; ".join(g.text() for g in slowed) + ": " + (slowed[0].advice() or v.action)
        else:
            temps = sorted(g.temperature_c for g in states)
            which = f"GPU {states[0].index}" if len(states) == 1 else "GPUs " + ", ".join(str(g.index) for g in states)
            where = f"{temps[0]} C" if temps[0] == temps[-1] else f"{temps[0]}-{temps[-1]} C"
            low = [g for g in states if g.sm_mhz < 0.9 * g.sm_max_mhz]
            clocks = ("; ".join(g.text() for g in low) + ": clocks below 90 % of the max with no reason given" if low
                      else f"{which} at full clocks ({where}), no clocks event: not the GPU's clocks")
            action = f"{clocks}; {v.action}"
        out.append(dataclasses.replace(v, action=action))
    return out
