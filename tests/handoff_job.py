"""Leaves right after a burst of asynchronous collectives whose buffers are temporaries.

Run once per rank by ``tests/test_shutdown.py``. ``runtime`` issues them through the runtime's
collectives (a reduce-scatter that runs as an all-to-all into a temporary receive buffer, an
all-reduce of a temporary); ``raw`` issues the same calls straight to ``torch.distributed``,
which is the pattern [Note: tensors handed to a backend thread] describes. Prints ``RESULT`` then exits.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hybridshard.runtime.comm import collectives as C  # noqa: E402
from hybridshard.runtime.comm import handoff  # noqa: E402
from tests.mp import print_result  # noqa: E402


def main() -> None:
    mode = sys.argv[1]
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    torch.set_num_threads(1)
    world = dist.get_world_size()
    total = 0.0
    for step in range(int(os.environ.get("HANDOFF_STEPS", "20"))):
        full = torch.full((world * 4096,), float(step + dist.get_rank()))
        out = torch.empty(4096)
        if mode == "raw":
            received = torch.empty_like(full)
            dist.all_to_all_single(received, full, async_op=True).wait()
            out.copy_(received.view(world, -1).sum(0))
            del received
        else:
            C.reduce_scatter(out, full, dist.group.WORLD, async_op=True).wait()
        total += float(out[0])
        extra = torch.ones(1024)
        if mode == "raw":
            dist.all_reduce(extra, async_op=True).wait()
        else:
            C.all_reduce(extra, dist.group.WORLD, async_op=True).wait()
        del full, out, extra  # every buffer dropped while a backend thread may still hold it
    print_result({"rank": dist.get_rank(), "total": total, "settled": handoff.settle(), "held": handoff.sweep()})


if __name__ == "__main__":
    main()
