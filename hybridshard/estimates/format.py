"""Reading human quantities ("7e9", "70B", "80GB") and rendering a sizing plan as text or JSON.

The math lives in :mod:`hybridshard.estimates.sizing`; this module only converts at its edges.
"""

from __future__ import annotations

import math
import re
from typing import Any, Sequence

from hybridshard.estimates.levels import RackEstimate, RackLayout, rack_dict, render_racks
from hybridshard.estimates.sizing import ClusterSpec, Estimate, LinkClass, ModelSpec, Recommendation

__all__ = ["parse_bytes", "parse_count", "render_text", "to_dict"]

_COUNT_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
_BYTE_UNITS = {
    "": 10**9,  # a bare number is gigabytes, as GPU memory is usually quoted
    "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_NUMBER = r"([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)"


def parse_count(text: str, *, what: str = "--model-params", minimum: int = 1) -> int:
    """``"7e9"``, ``"7B"``, ``"350M"``, ``"1.3b"`` -> an element count of at least ``minimum``."""
    m = re.fullmatch(_NUMBER + r"\s*([kmbgt]?)", str(text).strip().lower())
    value = float(m.group(1)) * _COUNT_SUFFIX[m.group(2)] if m else math.nan
    if not (math.isfinite(value) and round(value) >= minimum):
        kind = "positive" if minimum == 1 else f"at least {minimum}"
        raise ValueError(f"{what}: expected a {kind} parameter count such as 7e9, 7B or 350M; got {text!r}")
    return int(round(value))


def parse_bytes(text: str, *, what: str = "--gpu-memory") -> int:
    """``"80GB"``, ``"80 GiB"``, ``"141G"``, ``"80"`` (gigabytes) -> bytes."""
    m = re.fullmatch(_NUMBER + r"\s*([a-z]*)", str(text).strip().lower())
    if m is None or m.group(2) not in _BYTE_UNITS or not 0 < float(m.group(1)) < math.inf:
        units = "B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"
        raise ValueError(f"{what}: expected a positive size such as 80GB or 80GiB (units {units}); got {text!r}")
    return int(float(m.group(1)) * _BYTE_UNITS[m.group(2)])


def _count(n: int) -> str:
    for scale, suffix in ((10**12, "T"), (10**9, "B"), (10**6, "M"), (10**3, "K")):
        if n >= scale:
            return f"{n / scale:.3g}{suffix}"
    return str(n)


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.1f}"


_COLUMNS = (
    "strategy", "shard x rep", "params", "grads", "optim", "gathered", "total", "fits",
    "intra GB", "inter GB", "intra s", "inter s", "comm s",
)


def _row(e: Estimate) -> list[str]:
    m = e.memory
    intra, inter = LinkClass.INTRA_NODE, LinkClass.INTER_NODE
    return [
        e.label, f"{e.shard_size} x {e.replicate_size}",
        _gb(m.params), _gb(m.grads), _gb(m.optimizer), _gb(m.gathered), _gb(m.total), "yes" if e.fits else "NO",
        _gb(e.bytes_by_link[intra]), _gb(e.bytes_by_link[inter]),
        f"{e.seconds_by_link[intra]:.3f}", f"{e.seconds_by_link[inter]:.3f}", f"{e.comm_seconds:.3f}",
    ]


def _model_line(model: ModelSpec, unit_source: str) -> str:
    return (
        f"model: {_count(model.num_params)} parameters; largest unit {_count(model.unit_params)} ({unit_source}); "
        f"root unit {_count(model.root_params)}; compute {model.param_dtype}, reduce {model.reduce_dtype}, "
        f"master {model.master_dtype}; {model.optimizer.value} ({model.optimizer.states_per_param} states per parameter)"
    )


def _cluster_line(cluster: ClusterSpec) -> str:
    sizes = cluster.node_sizes
    shape = f"{len(sizes)} nodes x {sizes[0]} GPUs" if len(set(sizes)) == 1 else f"nodes of {list(sizes)} GPUs"
    return (
        f"cluster: {shape} = {cluster.world_size} ranks; {_gb(cluster.gpu_memory_bytes)} GB per GPU; per GPU "
        f"and direction: intra-node {cluster.intra_node_gbps:g} Gb/s, inter-node {cluster.inter_node_gbps:g} Gb/s"
    )


def render_text(
    model: ModelSpec, cluster: ClusterSpec, estimates: Sequence[Estimate], rec: Recommendation, *, unit_source: str,
    layout: RackLayout | None = None, racks: Sequence[RackEstimate | None] = (),
) -> str:
    """The table and the recommendation; with ``layout``, the recommended option's ``racks`` entry
    (``racks`` is aligned with ``estimates``)."""
    lines = [_model_line(model, unit_source), _cluster_line(cluster), ""]
    rows = [list(_COLUMNS)] + [_row(e) for e in estimates]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    for row in rows:
        lines.append("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    lines += [
        "",
        "memory: GB per GPU (1 GB = 1e9 bytes) without activations; traffic: GB and seconds per rank per step",
        "(ring model; collectives not overlapped). See docs/planning.md.",
    ]
    if any(e.shard_optimizer for e in estimates):
        lines.append("+optim: shard(..., shard_optimizer_across_replicas=True): optimizer state and gradients over "
                     "shard x replicate")
    if rec.choice is None:
        lines.append(f"recommended: none: {rec.reason}")
    else:
        c = rec.choice
        lines.append(f"recommended: {c.label}, shard size {c.shard_size} x {c.replicate_size} replicas:")
        lines.append(f"  {rec.reason}")
    by_note: dict[str, list[str]] = {}
    for e in estimates:
        for note in e.notes:
            by_note.setdefault(note, []).append(f"{e.label} {e.shard_size} x {e.replicate_size}")
    lines += [f"note: {', '.join(labels)}: {note}" for note, labels in by_note.items()]
    if layout is not None and rec.choice is not None:
        mine = racks[list(estimates).index(rec.choice)] if racks else None
        c = rec.choice
        lines += render_racks(layout, mine, label=f"{c.label} {c.shard_size} x {c.replicate_size}", cluster=cluster)
    return "\n".join(lines)


def _estimate_dict(e: Estimate) -> dict[str, Any]:
    m = e.memory
    return {
        "strategy": e.strategy.name,
        "shard_size": e.shard_size,
        "replicate_size": e.replicate_size,
        "shard_optimizer_across_replicas": e.shard_optimizer,
        "memory_bytes": {
            "params": m.params, "grads": m.grads, "optimizer": m.optimizer, "gathered": m.gathered, "total": m.total,
        },
        "fits": e.fits,
        "collective_bytes": [{"kind": k, "group": g, "bytes": b} for (k, g), b in e.collectives.items()],
        "link_bytes": {link.value: b for link, b in e.bytes_by_link.items()},
        "link_seconds": {link.value: s for link, s in e.seconds_by_link.items()},
        "comm_seconds": e.comm_seconds,
        "notes": list(e.notes),
    }


def to_dict(model: ModelSpec, cluster: ClusterSpec, estimates: Sequence[Estimate], rec: Recommendation, *,
            layout: RackLayout | None = None, racks: Sequence[RackEstimate | None] = ()) -> dict[str, Any]:
    out = {
        "model": {
            "num_params": model.num_params, "unit_params": model.unit_params, "root_params": model.root_params,
            "param_dtype": model.param_dtype, "reduce_dtype": model.reduce_dtype, "master_dtype": model.master_dtype,
            "optimizer": model.optimizer.value,
        },
        "cluster": {
            "node_sizes": list(cluster.node_sizes), "world_size": cluster.world_size,
            "gpu_memory_bytes": cluster.gpu_memory_bytes,
            "intra_node_gbps": cluster.intra_node_gbps, "inter_node_gbps": cluster.inter_node_gbps,
        },
        "options": [_estimate_dict(e) for e in estimates],
        "recommended": None if rec.choice is None else {
            "strategy": rec.choice.strategy.name, "shard_size": rec.choice.shard_size,
            "replicate_size": rec.choice.replicate_size,
            "shard_optimizer_across_replicas": rec.choice.shard_optimizer,
        },
        "reason": rec.reason,
    }
    if layout is not None:
        out["racks"] = {"source": layout.source, "rack_names": list(layout.rack_names),
                        "node_racks": list(layout.node_racks), "spine_oversubscription": layout.oversubscription,
                        "spine_gbps": layout.spine_gbps}
        for option, r in zip(out["options"], racks):
            option["racks"] = rack_dict(r)
    return out
