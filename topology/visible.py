"""Map ``CUDA_VISIBLE_DEVICES`` to physical GPUs.

NVML numbers every GPU of the machine and ignores ``CUDA_VISIBLE_DEVICES``; CUDA applies it. To know
which physical GPU a rank will use we resolve the variable the way the CUDA driver does and name each
visible device by its UUID.

[Note: CUDA_VISIBLE_DEVICES]
* Unset: every GPU, in NVML index order. Set but empty: none.
* A comma-separated list; each entry is an integer ordinal, a GPU UUID (``GPU-8932f937-...``; a
  unique prefix such as ``GPU-8932f937`` is enough) or a MIG instance (``MIG-<uuid>``, or the older
  ``MIG-GPU-<gpu uuid>/<gi>/<ci>``). A MIG instance maps to the GPU it lives on.
* CUDA stops at the first entry it cannot use (unknown, out of range, or a repeat) and ignores the
  rest, so ``"0,1,-1,2"`` shows two devices and ``"-1"`` shows none. We do the same and report why.
* Integer ordinals are taken in NVML order (PCI bus order). CUDA uses the same order when
  ``CUDA_DEVICE_ORDER=PCI_BUS_ID``; its default, ``FASTEST_FIRST``, only differs on nodes that mix
  GPU models. UUIDs are never ambiguous, which is why launchers that pin GPUs should prefer them.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from topology.records import GpuInfo

__all__ = ["resolve_visible_devices"]


def resolve_visible_devices(
    value: str | None,
    gpus: Sequence[GpuInfo],
    mig_parents: Mapping[str, str] | None = None,
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(visible GPU UUIDs in CUDA ordinal order, problems)``; see [Note: CUDA_VISIBLE_DEVICES].

    ``problems`` explains entries CUDA would stop at; it is empty for a clean value.
    """
    ordered = [g.uuid for g in sorted(gpus, key=lambda g: g.index) if g.uuid]
    if value is None:
        return tuple(ordered), ()
    mig_parents = dict(mig_parents or {})
    visible: list[str] = []
    entries = [e.strip() for e in value.split(",")] if value.strip() else []
    for pos, entry in enumerate(entries):
        uuid, problem = _resolve_entry(entry, ordered, mig_parents)
        if problem is None and uuid in visible:
            problem = f"{entry!r} repeats a device already listed"
        if problem is not None:
            ignored = entries[pos + 1 :]
            tail = f"; CUDA also ignores the entries after it: {','.join(ignored)}" if ignored else ""
            return tuple(visible), (f"entry {pos} {problem}{tail}",)
        visible.append(uuid)  # type: ignore[arg-type]
    return tuple(visible), ()


def _resolve_entry(entry: str, ordered: list[str], mig_parents: dict[str, str]) -> tuple[str | None, str | None]:
    if entry.lstrip("+-").isdigit():
        ordinal = int(entry)
        if 0 <= ordinal < len(ordered):
            return ordered[ordinal], None
        return None, f"{entry!r} is not a GPU ordinal of this node (it has {len(ordered)} GPUs)"
    upper = entry.upper()
    if upper.startswith("MIG-GPU-"):  # MIG-GPU-<gpu uuid>/<gi>/<ci>
        return _by_prefix(entry, entry[4:].split("/", 1)[0], ordered, "GPU")
    if upper.startswith("MIG-"):
        parents = {m.upper(): p for m, p in mig_parents.items()}
        matches = {p for m, p in parents.items() if m.startswith(upper)}
        if len(matches) == 1:
            return matches.pop(), None
        return None, f"{entry!r} names no MIG instance of this node" if not matches else f"{entry!r} is ambiguous"
    if upper.startswith("GPU-"):
        return _by_prefix(entry, entry, ordered, "GPU")
    return None, f"{entry!r} is neither an ordinal, a GPU UUID nor a MIG UUID"


def _by_prefix(entry: str, prefix: str, ordered: list[str], kind: str) -> tuple[str | None, str | None]:
    matches = [u for u in ordered if u.upper().startswith(prefix.upper())]
    if len(matches) == 1:
        return matches[0], None
    if not matches:
        return None, f"{entry!r} names no {kind} of this node"
    return None, f"{entry!r} is ambiguous: it matches {len(matches)} GPUs; give more of the UUID"
