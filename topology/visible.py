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
* A GPU whose UUID NVML did not report keeps its ordinal (``None`` in the list), so later ordinals
  still name the right GPUs; a rank on it cannot be identified and is reported.
* Integer ordinals are taken in NVML order (PCI bus order), which is also the order of the rows of
  ``nvidia-smi topo -m``. CUDA uses the same order when ``CUDA_DEVICE_ORDER=PCI_BUS_ID``; its
  default, ``FASTEST_FIRST``, only differs on nodes that mix GPU models, and then the ordinal of a
  rank may name another row: :func:`ordinal_order_problem` says so. UUIDs are never ambiguous, which
  is why launchers that pin GPUs should prefer them.
* MIG: a rank's device is one MIG instance, named by its UUID; it maps to the GPU it lives on. Two
  ranks on slices of one GPU therefore share that GPU in the cluster view (the ``shared_gpu``
  finding), and slices have no NVLink between them, so plan with ``domain="node"``.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from hybridshard.topology.records import GpuInfo

__all__ = ["ordinal_order_problem", "resolve_visible_devices"]


def resolve_visible_devices(
    value: str | None,
    gpus: Sequence[GpuInfo],
    mig_parents: Mapping[str, str] | None = None,
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(visible GPU UUIDs in CUDA ordinal order, problems)``; see [Note: CUDA_VISIBLE_DEVICES].

    ``problems`` explains entries CUDA would stop at, and visible GPUs whose UUID NVML did not report
    (``None`` in the list, in their place); it is empty for a clean value.
    """
    # Ordinal k is the k-th GPU by NVML index, whether or not NVML told us its UUID: skipping a GPU
    # without one would shift every later ordinal (and the rank's cuda:N) onto the wrong GPU. Such a
    # GPU keeps its place as ``None``; CUDA still shows it, so the list goes on.
    ordered: list[str | None] = [g.uuid or None for g in sorted(gpus, key=lambda g: g.index)]
    mig_parents = dict(mig_parents or {})
    visible: list[str | None] = []
    notes: list[str] = []
    if value is None:
        entries = [str(k) for k in range(len(ordered))]
    else:
        entries = [e.strip() for e in value.split(",")] if value.strip() else []
    for pos, entry in enumerate(entries):
        uuid, problem = _resolve_entry(entry, ordered, mig_parents)
        if problem is None and uuid is not None and uuid in visible:
            problem = f"{entry!r} repeats a device already listed"
        if problem is not None:
            ignored = entries[pos + 1 :]
            tail = f"; CUDA also ignores the entries after it: {','.join(ignored)}" if ignored else ""
            return tuple(visible), (*notes, f"entry {pos} {problem}{tail}")  # type: ignore[return-value]
        if uuid is None:
            notes.append(f"CUDA device {pos} is GPU {entry}, whose UUID NVML did not report; a rank on it "
                         "cannot be identified (see the node's unavailable facts, or hide that GPU)")
        visible.append(uuid)
    return tuple(visible), tuple(notes)  # type: ignore[return-value]


def ordinal_order_problem(value: str | None, gpus: Sequence[GpuInfo], device_order: str | None) -> str | None:
    """Why CUDA ordinals may not be NVML indices here, or ``None``: ordinals in use (``value`` unset
    or listing integers) on a node of several GPU models without ``CUDA_DEVICE_ORDER=PCI_BUS_ID``."""
    models = sorted({g.name for g in gpus if g.name})
    ordinals = value is None or any(e.strip().lstrip("+-").isdigit() for e in value.split(","))
    if (device_order or "FASTEST_FIRST").strip().upper() == "PCI_BUS_ID" or len(models) < 2 or not ordinals:
        return None
    return (
        f"this node mixes GPU models ({', '.join(models)}) and CUDA numbers them fastest first, so CUDA "
        "ordinal k need not be nvidia-smi's GPU k; set CUDA_DEVICE_ORDER=PCI_BUS_ID or name GPUs by UUID"
    )


def _resolve_entry(
    entry: str, ordered: list[str | None], mig_parents: dict[str, str]
) -> tuple[str | None, str | None]:
    if entry.lstrip("+-").isdigit():
        ordinal = int(entry)
        if not 0 <= ordinal < len(ordered):
            return None, f"{entry!r} is not a GPU ordinal of this node (it has {len(ordered)} GPUs)"
        return ordered[ordinal], None  # None: a GPU without a reported UUID, kept in its place
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


def _by_prefix(entry: str, prefix: str, ordered: list[str | None], kind: str) -> tuple[str | None, str | None]:
    matches = [u for u in ordered if u and u.upper().startswith(prefix.upper())]
    if len(matches) == 1:
        return matches[0], None
    if not matches:
        return None, f"{entry!r} names no {kind} of this node"
    return None, f"{entry!r} is ambiguous: it matches {len(matches)} GPUs; give more of the UUID"
