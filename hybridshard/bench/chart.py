"""``bench.png``: median step time per system (p10-p90 whiskers) and bytes per group per step."""

from __future__ import annotations

from typing import Any

from hybridshard.bench.report import group_bytes

__all__ = ["write_chart"]


def write_chart(results: dict[str, Any], path: str) -> None:
    """Draw the chart with matplotlib's Agg backend (no display needed). Raises ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["systems"])
    entries = [results["systems"][n] for n in names]
    medians = [e["median_ms"] for e in entries]
    low = [e["median_ms"] - e["p10_ms"] for e in entries]
    high = [e["p90_ms"] - e["median_ms"] for e in entries]
    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(11, 4.2))
    xs = range(len(names))
    ax_t.bar(xs, medians, yerr=[low, high], capsize=4, color="#4878a8")
    for x, value in zip(xs, medians):  # inside the bar, clear of the whiskers
        ax_t.text(x, value / 2, f"{value:.0f}", ha="center", va="center", fontsize=9, color="white")
    ax_t.set_xticks(list(xs), names, rotation=20, ha="right", fontsize=8)
    ax_t.set_ylabel("median step time (ms), p10-p90")
    ax_t.set_title("step time")
    width = 0.4
    for offset, group, color in ((-width / 2, "shard", "#6aa56a"), (width / 2, "replicate", "#d08c3c")):
        values = [(group_bytes(e, group) or 0.0) / 1e6 for e in entries]
        ax_b.bar([x + offset for x in xs], values, width, label=f"{group} group", color=color)
    ax_b.set_xticks(list(xs), names, rotation=20, ha="right", fontsize=8)
    ax_b.set_ylabel("MB sent per rank per step (ring model)")
    ax_b.set_title("bytes per group")
    ax_b.legend(fontsize=8)
    m = results["model"]
    fig.suptitle(f"{results['strategy']}, {results['world_size']} ranks ({results['replicate_size']}x"
                 f"{results['shard_size']}), {results['link']}; GPT d{m['d_model']} x{m['layers']}, "
                 f"{m['params'] / 1e6:.1f}M params", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
