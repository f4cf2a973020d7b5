"""``hybridshard ckpt inspect PATH``: what a checkpoint holds, without a process group.

Reads the manifest (strategy, topology, bytes per rank) and DCP's metadata (every key with its
shape, dtype and number of stored chunks) and the saved ``extra``; reads no tensor data. The metadata is read as data
(see [Note: checkpoints are data] in hybridshard/state/trust.py): a checkpoint holding pickled
code is refused with one error line, and nothing from it runs.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("ckpt", help="inspect checkpoints written by hybridshard.save_checkpoint", description=__doc__)
    actions = p.add_subparsers(dest="action", metavar="ACTION")
    inspect = actions.add_parser("inspect", help="print strategy, topology, keys and sizes of a checkpoint")
    inspect.add_argument("path", help="a checkpoint directory (or a directory of them: the latest is shown)")
    inspect.add_argument("--json", action="store_true", help="print the facts as JSON")
    inspect.add_argument("--trusted", action="store_true",
                         help="read the metadata with full pickle, as DCP does (only for a checkpoint you trust)")
    p.set_defaults(func=run)


def collect(path: str, *, trusted: bool = False) -> dict[str, Any]:
    """The facts about the checkpoint at ``path`` (or the latest one under it) as one record."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from hybridshard.state.checkpoint import latest_checkpoint, read_entries, read_manifest
    from hybridshard.state.reader import CheckedReader

    try:
        manifest = read_manifest(path)
    except ValueError:
        latest = latest_checkpoint(path)
        if latest is None:
            raise
        path, manifest = latest, read_manifest(latest)
    reader = CheckedReader(path, trusted=trusted)
    metadata = reader.read_metadata()
    reader.check_files(metadata)
    entries = sorted(k for k, md in metadata.state_dict_metadata.items() if not isinstance(md, TensorStorageMetadata))
    values = read_entries(reader, entries, what=f"reading {path}")  # small, and checked: a refused one stops here
    keys = []
    for key, md in sorted(metadata.state_dict_metadata.items()):
        if isinstance(md, TensorStorageMetadata):
            keys.append({"key": key, "shape": list(md.size), "dtype": str(md.properties.dtype),
                         "chunks": len(md.chunks), "bytes": math.prod(md.size) * md.properties.dtype.itemsize})
        else:
            keys.append({"key": key, "shape": None, "dtype": "object", "chunks": 1, "bytes": None})
    return {"path": path, "manifest": manifest, "keys": keys, "extra": values.get("extra")}


def render(facts: dict[str, Any]) -> str:
    m = facts["manifest"]
    units = m.get("units") or []
    lines = [
        f"checkpoint {facts['path']}",
        f"  strategy   {m.get('strategy') or 'unsharded (one process)'}; world size {m.get('world_size')}",
        f"  nodes      {', '.join(dict.fromkeys(m.get('nodes') or [])) or 'unavailable: not recorded'}",
    ]
    for u in units:
        lines.append(f"  unit       {u['name']}: {u['strategy']} (shard {u['shard_size']} x replicate "
                     f"{u['replicate_size']}), {u['numel']:,} elements")
    per_rank = m.get("bytes_per_rank") or []
    lines.append(f"  written    {sum(per_rank):,} bytes: " + ", ".join(f"rank {r} {b:,}" for r, b in enumerate(per_rank)))
    optim = m.get("optimizer")
    lines.append(f"  optimizer  {optim['class'] + ', ' + str(optim['num_groups']) + ' param group(s)' if optim else 'none'}")
    extra = repr(facts.get("extra"))
    extra = extra if len(extra) <= 160 else extra[:157] + "..."
    lines.append(f"  extra      {extra if m.get('extra') else 'none'}; tied names {m.get('aliases') or 'none'}")
    lines.append("")
    width = max((len(k["key"]) for k in facts["keys"]), default=3)
    lines.append(f"  {'key':<{width}}  {'shape':<14} {'dtype':<15} {'chunks':>6} {'bytes':>12}")
    for k in facts["keys"]:
        shape = "x".join(map(str, k["shape"])) if k["shape"] else ("scalar" if k["shape"] == [] else "-")
        size = f"{k['bytes']:,}" if k["bytes"] is not None else "-"
        lines.append(f"  {k['key']:<{width}}  {shape:<14} {k['dtype']:<15} {k['chunks']:>6} {size:>12}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if getattr(args, "action", None) != "inspect":
        print("hybridshard ckpt: expected an action: inspect PATH", file=sys.stderr)
        return 2
    try:
        facts = collect(args.path, trusted=args.trusted)
    except (ValueError, OSError) as exc:
        print(f"hybridshard ckpt inspect: error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(facts, indent=1, default=str) if args.json else render(facts))
    return 0
