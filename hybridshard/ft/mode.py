"""Fault-tolerant hybrid sharding: replica groups that outlive a lost node, on torchft's Manager.

[Note: fault-tolerant mode]
Each replica group (one node, or one shard domain) is its own torch.distributed job: its world is
the shard group and the runtime runs it as today (gathers, reduce-scatters, prefetch, overlap,
``no_sync``, ``clip_grad_norm_``). Only the reduction across replica groups changes: it goes
through torchft's ``Manager`` (see [Note: managed replicate all-reduce]), whose lighthouse keeps
the quorum of live groups. One step is::

    ft.start_step()        # the quorum of this step, computed while the forward runs
    loss = model(batch)    # this group's part of the global batch: ft.batch_indices(...)
    loss.backward()        # shards averaged over the live groups
    ft.step(optimizer)     # optimizer.step() only if every live group finished the step

A group that dies leaves the quorum at the next step; the others go on with one replica fewer. A
group that comes back joins a quorum, fetches its shard ranks' state from a live group (see
[Note: healing a shard rank]) and steps with the others from then on. When no live group holds a
shard (every group was lost), there is nothing to heal from: the job resumes from the last
checkpoint (:meth:`FaultTolerance.save_checkpoint` / :meth:`FaultTolerance.load_checkpoint`).
"""

from __future__ import annotations

import logging
import os
import socket
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from hybridshard.ft.healing import load_shard_state, replicas_agree, shard_digest, shard_state, sync_initial_shards
from hybridshard.ft.membership import Membership
from hybridshard.ft.replicate import ManagedReplicate, waited
from hybridshard.runtime.comm import collectives as C
from hybridshard.runtime.engine import get_engine
from hybridshard.runtime.faults import stragglers
from hybridshard.runtime.trace import host_syncs
from hybridshard.state import checkpoint
from hybridshard.state.replicas import ReplicaDivergence
from hybridshard.topology.groups import collective_device

logger = logging.getLogger(__name__)

__all__ = ["FaultTolerance", "import_torchft"]

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
REPLICA_ID_ENV = "HYBRIDSHARD_REPLICA_ID"


def import_torchft() -> Any:
    """torchft's module, or an ``ImportError`` that names the extra to install."""
    try:
        import torchft  # noqa: F401
        import torchft.manager
        import torchft.process_group
    except ImportError as err:
        raise ImportError(
            "hybridshard's fault-tolerant mode needs torchft, which is not installed "
            f"({err}); install it with: pip install hybridshard[ft]"
        ) from err
    return torchft


def _required(value: str | None, env: str, what: str) -> str:
    value = value if value is not None else os.environ.get(env)
    if not value:
        raise ValueError(
            f"fault-tolerant mode needs {what}; found neither the argument nor ${env}. "
            f"Pass it, or start the job with `hybridshard launch --fault-tolerant`, which sets ${env}"
        )
    return value


class FaultTolerance:
    """The fault-tolerant mode of one sharded model and its optimizer; see [Note: fault-tolerant mode].

    Collective over the replica group's job: every rank creates it after ``shard`` and the optimizer.
    ``lighthouse`` is the lighthouse's address (``$TORCHFT_LIGHTHOUSE``), ``replica_id`` names this
    group (``$HYBRIDSHARD_REPLICA_ID``; a group that comes back reuses its id). A step commits only
    with at least ``min_replicas`` live groups. ``timeout`` bounds every cross-group collective and
    the healing transfer, so a lost peer costs at most that long; ``quorum_timeout`` bounds the wait
    for a quorum. ``hostname`` is where the other groups reach this one (default: ``$MASTER_ADDR``
    when it is not a loopback name, else this host's name). After ``max_failed_steps`` steps in a
    row that did not commit (too few live groups, or a group failing every step) :meth:`step`
    raises a ``RuntimeError``: the job stops, to resume from its last checkpoint. With ``init_sync``
    the groups of a quorum at step 0 take the first group's weights before their first forward
    ([Note: the initial sync]); pass False when every group seeds the same weights.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        lighthouse: str | None = None,
        replica_id: str | None = None,
        min_replicas: int = 1,
        timeout: float = 30.0,
        quorum_timeout: float = 60.0,
        hostname: str | None = None,
        init_sync: bool = True,
        max_failed_steps: int = 20,
    ) -> None:
        torchft = import_torchft()
        engine = get_engine(model)
        if min_replicas < 1 or max_failed_steps < 1:
            raise ValueError(f"min_replicas and max_failed_steps must be at least 1; got {min_replicas}, {max_failed_steps}")
        if not dist.is_initialized():
            raise RuntimeError(
                "fault-tolerant mode expected the replica group's process group, found none; call "
                "torch.distributed.init_process_group (or run under hybridshard launch) before FaultTolerance"
            )
        for unit in engine.units:
            if unit.strategy.is_hybrid and unit.groups.replicate_size != 1:
                raise ValueError(
                    f"fault-tolerant mode runs each replica group as its own job, but unit {unit.name!r} has a "
                    f"replicate group of {unit.groups.replicate_size} ranks; start one job per node "
                    "(hybridshard launch --fault-tolerant) so that init_groups() plans replicate size 1"
                )
        if engine.compressor is not None:
            raise ValueError(
                "fault-tolerant mode reduces across replica groups with torchft's all-reduce, which "
                f"replicate_compression={engine.compressor.mode!r} cannot run on; shard without "
                "replicate_compression"
            )
        if engine.replicate_hook is not None:
            raise ValueError("this model already runs in fault-tolerant mode: create one FaultTolerance per model")
        self.model, self.optimizer = model, optimizer
        lighthouse = _required(lighthouse, LIGHTHOUSE_ENV, "the lighthouse's address")
        self.replica_id = _required(replica_id, REPLICA_ID_ENV, "this replica group's id")
        stragglers.set_replica_group(self.replica_id)  # the straggler report names a slow group by it
        store_addr = os.environ.get("MASTER_ADDR", "localhost")
        if hostname is None:
            hostname = store_addr if store_addr not in ("localhost", "127.0.0.1", "::1") else socket.gethostname()
        self.pg = torchft.process_group.ProcessGroupGloo(timeout=timedelta(seconds=timeout))
        self.manager = torchft.manager.Manager(
            pg=self.pg,
            load_state_dict=lambda state: load_shard_state(model, optimizer, state),
            state_dict=lambda: shard_state(model, optimizer),
            min_replica_size=min_replicas,
            replica_id=self.replica_id,
            rank=dist.get_rank(),
            world_size=dist.get_world_size(),
            store_addr=store_addr,
            store_port=int(os.environ["MASTER_PORT"]) if "MASTER_PORT" in os.environ else None,
            lighthouse_addr=lighthouse,
            hostname=hostname,
            timeout=timedelta(seconds=timeout),
            quorum_timeout=timedelta(seconds=quorum_timeout),
            connect_timeout=timedelta(seconds=timeout),
            init_sync=False,  # fault-tolerant mode syncs the initial weights itself: [Note: the initial sync]
        )
        self.init_sync = init_sync
        engine.replicate_hook = ManagedReplicate(self.manager)
        # The quorum is awaited when the forward ends, not inside backward: see [Note: managed replicate all-reduce].
        self._quorum_hook = model.register_forward_hook(engine.replicate_hook.quorum_ready)
        self._started = False
        self._had_quorum = False
        self.min_replicas, self.max_failed_steps = min_replicas, max_failed_steps
        self._failed_steps = 0
        self._membership = Membership(speaks=dist.get_rank() == 0)

    # ---- one step ----

    def start_step(self) -> None:
        """Start this step's quorum (it completes while the forward runs). Once per optimizer step,
        before its first forward (``no_sync`` micro-batches included)."""
        self.manager.start_quorum()
        hook = get_engine(self.model).replicate_hook
        hook.quorum_started = True
        self._started = self._had_quorum = True
        if self.init_sync and self.manager.current_step() == 0:
            # Before the forward, and only while no step has committed: [Note: the initial sync].
            hook.quorum_started = False
            self.manager.wait_quorum()  # a group healing to a later step takes that step here
            if self.manager.current_step() == 0 and self.manager.num_participants() > 1:
                sync_initial_shards(self.model, self.manager)

    def step(self, optimizer: torch.optim.Optimizer | None = None) -> bool:
        """``optimizer.step()`` if every live group finished this step (``should_commit``); True when it stepped.

        A returning group's healed state is applied here, before the step. Zero the gradients after
        it either way: an uncommitted step's gradients may be partial.
        """
        if not self._started:
            raise ValueError("FaultTolerance.step() before start_step(): call ft.start_step() before the forward")
        self._started = False
        # On a GPU torchft synchronizes the device first: the exempt sync (see [Note: counting host syncs]).
        host_syncs.count_here("torch.accelerator.synchronize", exempt="torchft should_commit")
        if not self.manager.should_commit():
            self._failed_steps += 1
            live = self.manager.num_participants()
            self._membership.observe(committed=False, live=live, step=self.current_step, first=False)
            if self._failed_steps >= self.max_failed_steps:
                raise RuntimeError(
                    f"fault-tolerant training expected at least {self.min_replicas} live replica group(s) finishing "
                    f"each step, but {self._failed_steps} steps in a row did not commit (last quorum: {live} "
                    "group(s)); every replica of some shard may be lost. Restart the job: it resumes from the last "
                    "checkpoint (FaultTolerance.load_checkpoint)"
                )
            logger.warning("step %d did not commit (%d live replica groups): retrying it", self.current_step, live)
            return False
        self._failed_steps = 0
        (optimizer or self.optimizer).step()
        self._membership.observe(committed=True, live=self.manager.num_participants(), step=self.current_step,
                                 first=self.manager.participating_rank() == 0)
        return True

    @property
    def current_step(self) -> int:
        """Committed steps; a healed group takes the live groups' count."""
        return waited(self.manager.current_step)

    @property
    def batches_committed(self) -> int:
        """Per-group batches in the committed steps (each step adds its live groups); healed along."""
        return waited(self.manager.batches_committed)

    @property
    def num_replicas(self) -> int:
        """Replica groups in this step's quorum that are not healing: the gradient is their mean."""
        return waited(self.manager.num_participants)

    @property
    def replica_rank(self) -> int | None:
        """This group's rank among them (``None`` while it heals: its gradient is not counted)."""
        return waited(self.manager.participating_rank)

    def batch_indices(self, batch_size: int, dataset_size: int) -> list[int]:
        """The sample indices of this group's part of the step's global batch.

        Each live group takes ``batch_size`` samples, so the effective batch is ``batch_size *
        num_replicas``. The samples follow the batches committed so far, so a step that did not
        commit is retried on the same samples and no sample is skipped or repeated when groups come
        and go. A healing group gets the first live group's part (its gradient is not counted).
        """
        if batch_size < 1 or dataset_size < 1:
            raise ValueError(f"batch_size and dataset_size must be positive; got {batch_size}, {dataset_size}")
        rank = self.replica_rank or 0
        start = (self.batches_committed + rank) * batch_size
        return [(start + i) % dataset_size for i in range(batch_size)]

    # ---- between steps ----

    def check_replicas(self) -> int:
        """Raise :class:`hybridshard.ReplicaDivergence` unless every live group's shards are bitwise
        equal; returns the number of groups compared. Collective over every live group, between a
        ``step`` and the next ``start_step`` (a group healing in this step is not compared)."""
        if not self._had_quorum:
            raise ValueError("check_replicas needs a quorum: call it after the first start_step()")
        digest = shard_digest(self.model)
        self.manager.allreduce(digest, reduce_op=dist.ReduceOp.SUM).wait()
        num, agree = replicas_agree(digest)
        # On the default group's device: a host tensor fails on NCCL. Between steps, so its sync is fine.
        flag = torch.tensor([0.0 if agree else 1.0], device=collective_device())
        C.all_reduce(flag, dist.group.WORLD)
        if flag.item():
            raise ReplicaDivergence(
                f"replica groups diverged: shard rank(s) of replica group {self.replica_id!r} see {num} replica "
                "groups whose shards are not bitwise equal. The run is no longer data parallel: restart from "
                "the last checkpoint"
            )
        return num

    def state_dict(self) -> dict[str, int]:
        """The manager's step and committed batches: saved with a checkpoint."""
        return self.manager.state_dict()

    def save_checkpoint(self, path: str, *, extra: Any = None) -> bool:
        """Save a checkpoint from the first live group only (each group holds the whole model); True
        on the group that saved. Call it after a committed :meth:`step`."""
        if self.replica_rank != 0:
            return False
        checkpoint.save_checkpoint(path, self.model, optimizer=self.optimizer,
                        extra={"torchft": self.state_dict(), "user": extra})
        return True

    def load_checkpoint(self, path: str) -> Any:
        """Load a checkpoint saved by :meth:`save_checkpoint` (the fallback when every group was lost);
        restores the step count and returns the saved ``extra``."""
        saved = checkpoint.load_checkpoint(path, self.model, optimizer=self.optimizer)
        if not isinstance(saved, dict) or "torchft" not in saved:
            raise ValueError(f"{path} was not saved by FaultTolerance.save_checkpoint (no torchft step in it)")
        self.manager.load_state_dict(saved["torchft"])
        return saved["user"]

    def shutdown(self) -> None:
        """Stop the manager's servers; the model reduces across nothing after it."""
        get_engine(self.model).replicate_hook = None
        self._quorum_hook.remove()
        self.manager.shutdown(wait=False)
