"""Draw docs/img/architecture.png: one training step through the runtime's modules.

    .venv/bin/python docs/img/draw_architecture.py [--out docs/img/architecture.png]

Needs only matplotlib. Boxes are what happens during the step; each arrow is labelled with the
module that owns the transition (the one whose code makes it happen). Colours: engine hooks,
per-unit state (unit, prefetch, flat_param), collectives on the shard group, collectives on the
replicate group, torch itself, and state/ (outside the step). See docs/architecture.md for the walk-through.
"""

from __future__ import annotations

import argparse
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))

# Colours (fill, edge) per kind of box.
ENGINE = ("#dbe9f6", "#3a6ea5")
UNIT = ("#e2f0d9", "#4d8a3a")
SHARD = ("#fde4c8", "#c46a12")
REPLICATE = ("#f1d9ec", "#9a3f86")
TORCH = ("#ececec", "#777777")
STATE = ("#ffffff", "#555555")

W, H = 121.0, 94.0  # drawing units: 1 unit = 0.1 inch
BOX_W, BOX_H = 16.5, 15.0
TITLE_PT, BODY_PT, LABEL_PT = 10.5, 9.0, 8.0


def box(ax, x, y, title, body, colours, *, w=BOX_W, h=BOX_H, dashed=False):
    """A rounded box with its lower-left corner at (x, y); returns its centre and edges."""
    fill, edge = colours
    patch = FancyBboxPatch(
        (x, y), w, h, boxstyle="round,pad=0.2,rounding_size=1.2", linewidth=1.4,
        facecolor=fill, edgecolor=edge, linestyle="--" if dashed else "-", zorder=2,
    )
    ax.add_patch(patch)
    ax.text(x + w / 2, y + h - 1.3, title, ha="center", va="top", fontsize=TITLE_PT, fontweight="bold",
            color="#1a1a1a", zorder=3)
    ax.text(x + w / 2, y + h - 4.4, body, ha="center", va="top", fontsize=BODY_PT, color="#222222",
            linespacing=1.25, zorder=3)
    return {"l": x, "r": x + w, "b": y, "t": y + h, "cx": x + w / 2, "cy": y + h / 2}


def arrow(ax, start, end, label, *, label_at=None, dashed=False, rad=0.0, ha="center"):
    """An arrow from ``start`` to ``end`` labelled with the module that owns it."""
    ax.add_patch(FancyArrowPatch(
        start, end, arrowstyle="-|>", mutation_scale=14, linewidth=1.5, color="#333333",
        linestyle="--" if dashed else "-", connectionstyle=f"arc3,rad={rad}", zorder=1,
        shrinkA=2, shrinkB=2,
    ))
    if label:
        if label_at is None:
            label_at = ((start[0] + end[0]) / 2, (start[1] + end[1]) / 2 + 1.6)
        ax.text(*label_at, label, ha=ha, va="center", fontsize=LABEL_PT, family="monospace", color="#0b3d91",
                bbox=dict(boxstyle="round,pad=0.15", facecolor="white", edgecolor="none"), zorder=4)


def lane(ax, y0, y1, text):
    ax.add_patch(FancyBboxPatch((0.6, y0), 3.4, y1 - y0, boxstyle="round,pad=0,rounding_size=0.8",
                                facecolor="#f4f4f4", edgecolor="#bbbbbb", linewidth=0.8, zorder=0))
    ax.text(2.3, (y0 + y1) / 2, text, rotation=90, ha="center", va="center", fontsize=9.5, color="#333333")


def draw(out: str) -> None:
    fig = plt.figure(figsize=(W / 10, H / 10))
    ax = fig.add_axes([0, 0, 1, 1])
    ax.set_xlim(0, W)
    ax.set_ylim(0, H)
    ax.axis("off")

    ax.text(W / 2, H - 2.0, "One training step through the runtime (modules in hybridshard/runtime/ unless named)",
            ha="center", va="top", fontsize=12.5, fontweight="bold")
    ax.text(W / 2, H - 5.4, "a HYBRID_SHARD unit with the defaults (prefetch=1, overlap_grads=True);  "
            "arrow labels: the module that owns the step",
            ha="center", va="top", fontsize=9.5, color="#444444")

    # Set-up, once: where the groups and units come from.
    ax.add_patch(FancyBboxPatch((6, 75.0), W - 7.5, 8.0, boxstyle="round,pad=0.2,rounding_size=1.0",
                                facecolor="#fafafa", edgecolor="#999999", linewidth=1.0, zorder=0))
    ax.text(7.5, 82.0, "once, before training", ha="left", va="top", fontsize=9.5, fontweight="bold")
    ax.text(7.5, 78.6, "topology/groups.py   init_groups() -> ShardGroups: the shard group and the replicate group",
            ha="left", va="center", fontsize=8.8, family="monospace", color="#222222")
    ax.text(7.5, 76.2, "api.shard()          model_check, wrap, build -> one Unit per wrapped module;  "
            "engine.Engine.attach(): module hooks",
            ha="left", va="center", fontsize=8.8, family="monospace", color="#222222")

    gap = (W - 6.0 - 1.5 - 5 * BOX_W) / 4
    xs = [6.0 + i * (BOX_W + gap) for i in range(5)]  # five columns
    ya, yb, yc = 54.0, 29.5, 6.0  # bottom edges of the three rows

    lane(ax, ya - 0.5, ya + BOX_H + 0.5, "forward, per unit")
    lane(ax, yb - 0.5, yb + BOX_H + 0.5, "backward, per unit")
    lane(ax, yc - 0.5, yc + BOX_H + 0.5, "end of step")

    def across(left, right, label):
        """A horizontal arrow between neighbours, its label above it in the gap."""
        if left["r"] < right["l"]:
            start, end = (left["r"], left["cy"] - 1.5), (right["l"], right["cy"] - 1.5)
        else:
            start, end = (left["l"], left["cy"] - 1.5), (right["r"], right["cy"] - 1.5)
        arrow(ax, start, end, label, label_at=((start[0] + end[0]) / 2, left["cy"] + 1.6))

    # -- forward: left to right -------------------------------------------------------------------
    a1 = box(ax, xs[0], ya, "forward pre-hook", "engine.Engine;\nthe root casts inputs\nto param_dtype", ENGINE)
    a2 = box(ax, xs[1], ya, "prefetch", "Prefetcher.before_unit:\nissue the all-gathers\nof the next units", UNIT)
    a3 = box(ax, xs[2], ya, "unit gathers", "Unit.unshard:\ncollectives.all_gather\nover the shard group", SHARD)
    a4 = box(ax, xs[3], ya, "compute", "the module's forward\non views of the\nunsharded buffer\n(flat_param)", TORCH)
    a5 = box(ax, xs[4], ya, "post-forward hook",
             "Unit.post_forward:\nreshard (ZeRO-3, not\nthe root); hook the\noutputs' gradients", UNIT)
    for left, right, label in ((a1, a2, "engine"), (a2, a3, "prefetch"), (a3, a4, "unit"), (a4, a5, "engine")):
        across(left, right, label)

    # -- backward: right to left (units run in reverse) -------------------------------------------
    b1 = box(ax, xs[4], yb, "pre-backward",
             "output gradient hook:\ngather again (ZeRO-3),\nprefetch in backward\norder", SHARD)
    b2 = box(ax, xs[3], yb, "backward compute", "autograd sums every\nview's gradient into\nthe flat leaf", TORCH)
    b3 = box(ax, xs[2], yb, "gradient ready",
             "post-accumulate-grad\nhook on the flat leaf:\nGradReduction.reduce,\nthen reshard", UNIT)
    b4 = box(ax, xs[1], yb, "reduce-scatter",
             "GradReduction.reduce:\ncollectives\n.reduce_scatter in\nthe shard group\n(async, main thread)", SHARD)
    b5 = box(ax, xs[0], yb, "comm thread",
             "a ThreadExecutor job:\nscale by 1/world, then\ncollectives.all_reduce\nacross the replicate\ngroup", REPLICATE)
    arrow(ax, (a5["cx"], a5["b"]), (b1["cx"], b1["t"]), "unit",
          label_at=(a5["cx"] + 0.8, (a5["b"] + b1["t"]) / 2), ha="left")
    for right, left, label in ((b1, b2, "unit"), (b2, b3, "unit"), (b3, b4, "reduce")):
        across(right, left, label)
    arrow(ax, (b4["l"], b4["cy"] - 1.5), (b5["r"] + 1.2, b5["cy"] - 1.5), "overlap",
          label_at=((b4["l"] + b5["r"] + 1.2) / 2, b4["cy"] + 1.6))
    # The communication thread runs beside the main thread: frame it.
    ax.add_patch(FancyBboxPatch((b5["l"] - 1.2, b5["b"] - 4.6), BOX_W + 2.4, BOX_H + 5.8,
                                boxstyle="round,pad=0,rounding_size=1.5", facecolor="none", edgecolor=REPLICATE[1],
                                linestyle=(0, (4, 3)), linewidth=1.1, zorder=1))
    ax.text(b5["cx"], b5["b"] - 0.9, "hybridshard-comm thread;\nor compression.py's all-reduce", ha="center",
            va="top", fontsize=8, color=REPLICATE[1], zorder=3)
    ax.text(b1["cx"], b1["b"] - 0.9, "its first backward hook\nqueues the end-of-\nbackward callback (engine)",
            ha="center", va="top", fontsize=8, color=ENGINE[1])

    # -- end of backward, then the optimizer ----------------------------------------------------
    c1 = box(ax, xs[0], yc, "end of backward", "engine callback:\nGradReducer.drain()\nwaits for every job,\nin order",
             ENGINE)
    c2 = box(ax, xs[1], yc, ".grad", "add each reduced\nshard into the flat\ngradient shard; .grad\nare views of it",
             UNIT)
    c3 = box(ax, xs[2], yc, "optimizer.step()",
             "steps the original\nparameters: views\ninto the master shard\n(flat_param)", TORCH)
    c4 = box(ax, xs[3], yc, "state/  (off the step)",
             "between steps only: full state dicts,\noptimizer state, DCP checkpoints,\nreplica checks; "
             "the units are\nread through state/access.py",
             STATE, w=xs[4] + BOX_W - xs[3], dashed=True)
    arrow(ax, (b5["cx"], b5["b"] - 4.6), (c1["cx"], c1["t"]), "engine",
          label_at=(c1["cx"] + 0.8, (b5["b"] - 4.6 + c1["t"]) / 2), ha="left")
    across(c1, c2, "flat_param")
    across(c2, c3, "torch.optim")
    arrow(ax, (c3["r"], c3["cy"] - 1.5), (c4["l"], c4["cy"] - 1.5), "state", dashed=True,
          label_at=((c3["r"] + c4["l"]) / 2, c3["cy"] + 1.6))

    # -- legend --------------------------------------------------------------------------------------
    items = ((ENGINE, "engine hooks", False), (UNIT, "unit, prefetch, flat_param", False),
             (SHARD, "collective: shard group", False), (REPLICATE, "collective: replicate group", False),
             (TORCH, "torch itself", False), (STATE, "outside the step", True))
    renderer = fig.canvas.get_renderer()
    x = 6.0
    for (fill, edge), text, dashed in items:
        ax.add_patch(FancyBboxPatch((x, 0.9), 2.4, 1.8, boxstyle="round,pad=0.1,rounding_size=0.4",
                                    facecolor=fill, edgecolor=edge, linewidth=1.0, linestyle="--" if dashed else "-"))
        t = ax.text(x + 3.2, 1.8, text, ha="left", va="center", fontsize=8.5)
        x += 3.2 + t.get_window_extent(renderer).width / fig.dpi * 10 + 3.0

    fig.savefig(out, dpi=130, facecolor="white", metadata={"Software": None})
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join(HERE, "architecture.png"))
    args = parser.parse_args()
    draw(args.out)
    print(args.out)


if __name__ == "__main__":
    main()
