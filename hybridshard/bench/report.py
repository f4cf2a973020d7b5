"""The benchmark's results as a text table (from the JSON document, so any saved run renders again)."""

from __future__ import annotations

import json
import os
import sys

from typing import Any

__all__ = ["render_text", "group_bytes"]

_MB = 1e6


def group_bytes(entry: dict[str, Any], group: str) -> float | None:
    """Ring-model bytes one rank sends over ``group`` per step; ``None`` when nothing was counted there."""
    kinds = entry["bytes_per_step"].get(group)
    return None if kinds is None else float(kinds["total"]["ring_bytes"])


def _cell(value: float | None, fmt: str) -> str:
    width = int(fmt.split(".")[0])
    return "-".rjust(width) if value is None else format(value, fmt)


def _hooks_ms(entry: dict[str, Any], key: str = "hooks_ms_per_step_by_rank") -> float | None:
    values = sorted(v for v in entry.get(key) or [] if v is not None)
    return values[len(values) // 2] if values else None


def _eager_twin(results: dict[str, Any], entry: dict[str, Any]) -> str | None:
    """The hybridshard contestant with ``entry``'s options but ``compile``: what a compiled variant is compared with."""
    options = {k: v for k, v in entry["options"].items() if k != "compile"}
    return next((n for n, e in results["systems"].items() if e["system"] == "hybridshard" and e["options"] == options
                 and entry["options"].get("compile")), None)


def _compile_table(results: dict[str, Any]) -> list[str]:
    """``--compile``: the compile apart from the steps; see [Note: bench compile counts]."""
    header = (f"{'system':<28} {'first step s':>12} {'frames':>6} {'breaks':>6} {'recompiles':>10} {'median ms':>9} "
              f"{'/eager':>7} {'/fsdp2':>7}")
    lines = ["", "compile: first step (compile included) apart from the median step; frames, graph breaks and "
             "recompiles (frames compiled after the first step) from torch._dynamo's counters", header,
             "-" * len(header)]
    medians = {n: e["median_ms"] for n, e in results["systems"].items()}
    for name, e in results["systems"].items():
        c, twin = e["compile"], _eager_twin(results, e)
        first = c["first_step_ms"] and c["first_step_ms"] / 1e3
        lines.append(
            f"{name:<28} {_cell(first, '12.1f')} {c['frames_first_step']:6d} {c['graph_breaks']:6d} "
            f"{c['recompiles']:10d} {e['median_ms']:9.1f} {_cell(twin and medians[name] / medians[twin], '7.2f')} "
            f"{_cell(e['ratio'].get('fsdp2'), '7.2f')}"
        )
    lines.append("/eager: median step over the same hybridshard variant's eager median; /fsdp2: over FSDP2 + "
                 "compile's (FSDP2 compiles each block after fully_shard).")
    compiled = [(n, e["compile"]) for n, e in results["systems"].items() if e["compile"]["frames_first_step"]
                or e["compile"]["recompiles"]]
    counted = ", ".join(f"{name} {c.get('graphs', 0)}, {c.get('fx_hits', 0)}/{c.get('fx_misses', 0)} and "
                        f"{c.get('aot_hits', 0)}/{c.get('aot_misses', 0)}" for name, c in compiled)
    clocked = ", ".join(f"{name} {c.get('frame_compile_s', 0):.1f} + {c.get('backward_compile_s', 0):.1f}"
                        for name, c in compiled)
    lines.append("caches: each contestant compiled cold: its blocks' forward code its own (dynamo's frame cache), an "
                 "empty inductor cache directory of its own per rank (FX graph and AOTAutograd caches), in-memory caches "
                 "cleared, the process's one-time costs paid before by an unrelated compile; rank 0's graphs captured, "
                 f"cache hits/misses FX graph and AOTAutograd: {counted or 'none'}.")
    lines.append("compile s inside torch (rank 0, torch's phase clocks), frame (dynamo + forward) + backward: "
                 f"{clocked or 'none'}; the rest of the first step is the step itself and waiting for the other ranks.")
    return lines


def render_text(results: dict[str, Any]) -> str:
    m, sch = results["model"], results["schedule"]
    timed = sch["rounds"] * sch["steps_per_round"]
    lines = [
        f"hybridshard bench: {results['strategy']}, {results['world_size']} ranks = {results['replicate_size']} "
        f"replicas x shard groups of {results['shard_size']}, {results['link']}, {results['device']}/"
        f"{results['backend']}, torch {results['torch']}, {results['threads_per_rank']} thread(s) per rank",
        f"model: GPT d_model {m['d_model']}, {m['layers']} blocks, {m['heads']} heads, seq {m['seq']}, global batch "
        f"{m['global_batch']}, {m['params']:,} parameters, {m['dtype']}, {m['optimizer']}",
        f"schedule: {sch['warmup']} warm-up steps, then {sch['rounds']} rounds x {sch['steps_per_round']} steps per "
        f"system ({timed} timed steps each), order {sch['order']}",
        "",
    ]
    header = (f"{'system':<28} {'median ms':>9} {'p10':>7} {'p90':>7} {'/fsdp1':>7} {'/fsdp2':>7} {'/floor':>7} "
              f"{'loss diff':>9} {'shard MB':>9} {'repl MB':>8} {'peak MB':>8} {'hooks ms':>8} {'hook cpu':>8}")
    lines += [header, "-" * len(header)]
    for name, e in results["systems"].items():
        r = e["ratio"]
        shard, repl = group_bytes(e, "shard"), group_bytes(e, "replicate")
        lines.append(
            f"{name:<28} {e['median_ms']:9.1f} {e['p10_ms']:7.1f} {e['p90_ms']:7.1f} "
            f"{_cell(r.get('fsdp1'), '7.2f')} {_cell(r.get('fsdp2'), '7.2f')} {_cell(r.get('floor'), '7.2f')} "
            f"{_cell(e['loss_max_abs_diff'], '9.1e')} {_cell(shard and shard / _MB, '9.2f')} "
            f"{_cell(repl and repl / _MB, '8.2f')} {e['peak_bytes'] / _MB:8.1f} {_cell(_hooks_ms(e), '8.1f')} "
            f"{_cell(_hooks_ms(e, 'hooks_cpu_ms_per_step_by_rank'), '8.1f')}"
        )
    if results.get("compile"):
        lines += _compile_table(results)
    rss = max(results["max_rss_bytes_by_rank"]) / _MB
    lines += [
        "",
        "/fsdp1 /fsdp2 /floor: median step time over that system's (< 1: faster).",
        f"loss diff: max |loss - {results['reference']}'s| over the first {sch['warmup'] + sch['steps_per_round']} "
        "steps (the floor: first step only; it does not average gradients).",
        "shard MB, repl MB: ring-model MB one rank sends per step in each group (hybridshard: its own counters; "
        "FSDP: its torch.distributed calls, wrapped).",
        f"peak MB: model state + the step's peak allocations, max over ranks; process max RSS {rss:.0f} MB "
        "(all systems together).",
        "hooks ms: wall time per timed step in the system's hooks (waits for collectives included), median over "
        "ranks, one clock for every system.",
        "hook cpu: CPU time per timed step of the threads inside those hooks (their own work, waits excluded; "
        "hybridshard's communication thread included), median over ranks.",
    ]
    return "\n".join(lines)


def print_results(rc: int, path: str, render, *, as_json: bool, also: str | None = None) -> int:
    """After a bench job: its results as a table (or JSON) and where they are, or why there are none."""
    if rc != 0 or not os.path.exists(path):
        print(f"hybridshard bench: the job failed (exit status {rc}); its output is above", file=sys.stderr)
        return rc or 1
    with open(path) as f:
        results = json.load(f)
    print(json.dumps(results, indent=1) if as_json else render(results))
    print(f"wrote {path}" + (f" and {also}" if also else ""), file=sys.stderr)
    return 0
