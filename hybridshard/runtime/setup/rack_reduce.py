"""Whether hybrid units reduce across replicas in two hops: ``CommConfig(rack_reduce=...)``.

[Note: choosing two hops]
``True`` asks for two hops and raises when the groups have none to offer; ``False`` keeps the flat
reduction over the replicate group; ``None`` (the default) lets the cost model of
:mod:`hybridshard.link_cost` decide from the racks' shape, the units' gradient shard sizes and the
links' rates. The rates come from ``HYBRIDSHARD_LINK_RATES`` (``node=100gbit,spine=50gbit``, per
direction: a host's link and a rack's uplink) when it is set, else from a short measurement at
``shard()`` time: an all-reduce inside the rack and one across racks, each timed on every rank,
the slowest rank's time taken (one all-reduce of two numbers over the job), so every rank reaches
the same decision from the same figures. The decision and its reason are logged on rank 0. The model
sums the two hops' phases (``overlap=False``): the executors run them one after another.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any, Sequence

import torch
import torch.distributed as dist

from hybridshard import link_cost
from hybridshard.runtime.comm import collectives as C
from hybridshard.topology.groups import plan_rack_groups

logger = logging.getLogger(__name__)

__all__ = ["LINK_RATES_ENV", "resolve_rack_reduce"]

LINK_RATES_ENV = "HYBRIDSHARD_LINK_RATES"
_PROBE_BYTES = 1 << 20
_PROBE_ROUNDS = 3


def _no_racks(groups: Any) -> str:
    if groups is None or groups.replicate_size == 1:
        return "the hybrid units have no replicate group"
    plan = groups.plan
    if plan is None:
        return "the groups came from a mesh, which carries no network paths (use hybridshard.init_groups())"
    return plan_rack_groups(plan)[1] or "the groups were built without their rack groups"


def _measure(racks: Any, device: torch.device) -> link_cost.LinkRates:
    """Bus bandwidths inside the rack and across racks, the slowest rank's, the same on every rank."""
    buf = torch.zeros(_PROBE_BYTES // 4, device=device)
    seconds = []
    for group in (racks.rack, racks.across):
        C.all_reduce(buf, group)  # warm up the connections
        start = time.perf_counter()
        for _ in range(_PROBE_ROUNDS):
            C.all_reduce(buf, group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds.append((time.perf_counter() - start) / _PROBE_ROUNDS)
    slowest = torch.tensor(seconds, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    rack_s, across_s = slowest.tolist()

    def busbw(n: int, s: float) -> float:  # bytes per second on each link of the ring
        return 2 * (n - 1) / n * _PROBE_BYTES / s

    return link_cost.LinkRates.from_busbw(busbw(racks.per_rack, rack_s), busbw(racks.racks, across_s),
                                          per_rack=racks.per_rack)


def resolve_rack_reduce(choice: bool | None, groups: Any, shard_bytes: Sequence[int], device: torch.device,
                        *, fault_tolerant: bool = False) -> bool:
    """Two hops or flat for the hybrid units over ``groups``; see [Note: choosing two hops].

    ``shard_bytes``: each hybrid unit's gradient shard in the reduce dtype, what one replicate
    reduction moves per unit. Collective over the job when ``choice`` is ``None`` and rates must be measured.
    """
    racks = getattr(groups, "racks", None) if groups is not None else None
    if choice is False:
        return False
    if racks is None or fault_tolerant:
        if choice:
            why = "fault-tolerant replicas reduce through torchft" if fault_tolerant else _no_racks(groups)
            raise ValueError(
                f"CommConfig(rack_reduce=True) expects replicate groups that span racks of equal size, found: {why}; "
                "give every node its network path (HYBRIDSHARD_NETWORK_PATH, Slurm's topology, "
                "docs/topology.md 'Racks and pods') and use hybridshard.init_groups(), or pass rack_reduce=None"
            )
        return False
    if racks.replicate_rank != groups.replicate_rank:
        raise RuntimeError(
            f"rank {dist.get_rank()}: expected replicate rank {racks.replicate_rank} (network order), found "
            f"{groups.replicate_rank}; the replicate group was not created in the plan's order"
        )
    if choice:
        return True
    given = os.environ.get(LINK_RATES_ENV)
    if given:  # a link's rate, shared by the shard size's replicate groups that run at once
        rates = link_cost.LinkRates.parse(given, per_rack=racks.per_rack)
        share = groups.shard_size
        rates = dataclasses.replace(rates, node_bytes_per_s=rates.node_bytes_per_s / share,
                                    spine_bytes_per_s=rates.spine_bytes_per_s / share)
    else:  # measured with every replicate group's flows at once: already one group's share
        rates = _measure(racks, device)
    # overlap=False: a unit's three phases run one after another on one thread (CPU) or one stream
    # (CUDA), and so do the units' reductions: nothing pipelines the hops of one unit with the next's.
    two_hops, why = link_cost.choose_rack_reduce(racks=racks.racks, per_rack=racks.per_rack,
                                                 unit_bytes=list(shard_bytes), rates=rates, overlap=False)
    if dist.get_rank() == 0:
        logger.info("replicate reduction %s (%s; rates %s)", "in two hops" if two_hops else "flat", why,
                    "from " + LINK_RATES_ENV if given else "measured")
    return two_hops


def resolve_shard_hops(comm: Any, sharded: Sequence[Any]) -> tuple[bool, bool]:
    """``(two hops, keep the secondary shard)`` for the units over ``sharded`` (the distinct groups of
    every unit whose shard group has more than one rank, hybrid or the whole job's), from
    ``comm.two_hop`` and ``comm.reshard_after_forward``; see [Note: a shard group in two hops] in
    :mod:`hybridshard.runtime.comm.two_hop`. Units whose groups have no hops stay flat either way."""
    with_hops = [g for g in sharded if getattr(g, "shard_hops", None) is not None]
    if not with_hops and (comm.two_hop or comm.reshard_after_forward == "node"):
        asked = "two_hop=True" if comm.two_hop else "reshard_after_forward='node'"
        found = ", ".join(f"{g.shard_size} ranks" for g in sharded) or "none"
        raise ValueError(
            f"CommConfig({asked}) expects a shard group that spans several nodes with more than one rank on each, "
            f"found shard groups without two hops ({found}); ask init_groups(shard_size=...) for a multiple of "
            "the ranks per node for hybrid units, run FULL_SHARD or SHARD_GRAD_OP on nodes of the same size, "
            "or drop the option"
        )
    two = bool(with_hops) and comm.two_hop is not False
    keep = comm.reshard_after_forward == "node"
    if keep and not two:
        raise ValueError(
            "CommConfig(reshard_after_forward='node') expects the two hops (two_hop=None or True), found two_hop=False; "
            "the secondary shard is what the hop across nodes gathers: drop two_hop=False"
        )
    return two, keep
