"""A fault report by network path: which racks lost each other, not only which ranks were lost.

[Note: a partition, not lost ranks]
When the spine goes down, no rank dies: the ranks in the store's rack see the other racks' heartbeats
stand still, and the ranks in the other racks lose the store itself. With ``HYBRIDSHARD_NETWORK_PATH``
set (``pod0/rack1``, top level first; the last level is the rank's rack), a rank appends
``<rank>=<path>`` to one key of the job's store once (:func:`learn`, from the watchdog thread) and reads
that key until it holds rank 0's path: the store's rack (it lives with rank 0, or in its node's agent).

- A rank whose lost ranks are exactly every rank of one or more racks, its own rack intact, reports
  ``network partition: racks [pod0/rack1] unreachable from pod0/rack0 (ranks [2, 3]): ...``
  (:func:`lost_racks_text`) instead of the ranks lost.
- A rank outside the store's rack (every rank but 0 until it learned that rack) runs a thread
  (:func:`start_store_probe`) that, while one of its collectives has been in flight for a second,
  connects to the store's address every :data:`PROBE_EVERY` seconds. Refused: the store's process is gone (other reports name that). No
  answer twice in a row: its rack lost the store's rack, and it stops with the partition, since every
  store operation would wait the store's whole timeout on a link that answers nothing.

Without ``HYBRIDSHARD_NETWORK_PATH`` nothing here runs. A rack whose hosts all died at once reads as
the same partition: the text says both.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import threading
from collections.abc import Iterable
from typing import Any, Callable

from hybridshard.runtime.faults import peers
from hybridshard.runtime.faults.rank_state import bound, current

logger = logging.getLogger(__name__)

__all__ = ["ENV", "PROBE_EVERY", "learn", "lost_racks_text", "my_path", "parse_paths", "paths",
           "start_store_probe", "store_lost_text"]

ENV = "HYBRIDSHARD_NETWORK_PATH"
PROBE_EVERY = 2.0
"""Seconds between two connections to the store's address (each waits at most that long)."""
_PATHS = "hybridshard/paths"
_WAITED = 1.0
"""Seconds a collective must have been in flight before the store's address is probed."""


def my_path() -> str | None:
    """This rank's network path (``pod0/rack1``), ``None`` when unknown."""
    value = os.environ.get(ENV, "").strip().strip("/")
    return value or None


def parse_paths(value: bytes) -> dict[int, str]:
    """``{rank: path}`` from the key's ``<rank>=<path>`` lines."""
    out: dict[int, str] = {}
    for line in value.decode(errors="replace").splitlines():
        rank, sep, path = line.partition("=")
        if sep and rank.strip().isdigit():
            out[int(rank)] = path.strip()
    return out


def paths(refresh: bool = False) -> dict[int, str]:
    """Every rank's network path that this rank has read from the store (``refresh``: read again)."""
    plane = current()
    known = plane.found.get("paths", {})
    if not refresh:
        return known
    s = peers.store()
    if s is None:
        return known
    try:
        if s.check([_PATHS]):
            known = parse_paths(s.get(_PATHS))
            plane.found["paths"] = known
    except Exception:  # noqa: BLE001 - the store may be gone: what was read stays
        logger.debug("could not read the ranks' network paths", exc_info=True)
    return known


def learn(waited: Callable[[], float], on_lost: Callable[[str], None]) -> None:
    """The watchdog thread's part, each iteration: publish this rank's path once, read the key until it
    holds rank 0's (one ``check`` and one ``get`` an iteration until then); start the store probe on every
    rank but 0 (it acts only outside the store's rack). ``waited``: seconds the oldest collective in flight has
    been so; ``on_lost(message)``: what the probe calls once the store's rack is unreachable (it stops
    the rank). Nothing without ``HYBRIDSHARD_NETWORK_PATH``."""
    mine, plane = my_path(), current()
    if mine is None or plane.found.get("paths_learned"):
        return
    s = peers.store()
    if s is None:
        return
    me = peers.identity()[0]
    if me != 0:  # at once: a cut before the store's rack is learned would leave this thread blocked in the read
        start_store_probe(waited, on_lost)
    if plane.found.get("path_published") is not s:
        try:
            s.append(_PATHS, f"{me}={mine}\n".encode())
        except Exception:  # noqa: BLE001 - no partition report then, the lost ranks' one stays
            logger.debug("could not publish the network path", exc_info=True)
            return
        plane.found["path_published"] = s
    store_rack = paths(refresh=True).get(0)
    if store_rack is None:
        return
    plane.found["paths_learned"] = True


def _link(a: str, b: str) -> str:
    """The link between two paths: the spine when they share everything above the rack."""
    return "spine" if a.split("/")[:-1] == b.split("/")[:-1] else "the network between them"


def lost_racks_text(me: int, lost: Iterable[int]) -> str | None:
    """``network partition: racks [...] unreachable from <mine> (ranks ...): ...`` when ``lost`` is exactly
    every rank of one or more racks and this rank's rack is intact; ``None`` otherwise (see the note)."""
    mine, lost = my_path(), sorted(set(lost))
    if mine is None or not lost:
        return None
    known = paths(refresh=True)
    if any(r not in known for r in lost) or me not in known:
        return None
    racks: dict[str, set[int]] = {}
    for rank, path in known.items():
        racks.setdefault(path, set()).add(rank)
    gone = sorted(p for p, ranks in racks.items() if ranks <= set(lost))
    if mine in gone or set().union(*(racks[p] for p in gone)) != set(lost):
        return None
    return (f"network partition: racks [{', '.join(gone)}] unreachable from {mine} (ranks {peers.ranks_text(lost)}): "
            f"the link between them ({_link(mine, gone[0])}) is down, or every host of "
            f"{'that rack' if len(gone) == 1 else 'those racks'} went down at once")


def store_lost_text(me: int, address: tuple[str, int] | None = None) -> str | None:
    """What a rank outside the store's rack says when it cannot reach the store; ``None`` when this rank
    is in the store's rack or has no path. ``address``: the store's, said when its rack is not known yet."""
    mine, store_rack = my_path(), paths().get(0)
    if mine is None or store_rack == mine or (store_rack is None and address is None):
        return None
    if store_rack is None:
        return (f"network partition: the job's store ({address[0]}:{address[1]}, with rank 0; its rack not "
                f"learned yet) unreachable from {mine} (rank {me}): the link between them is down")
    return (f"network partition: racks [{store_rack}] unreachable from {mine} (rank {me} lost the job's store, "
            f"on {store_rack} with rank 0): the link between them ({_link(mine, store_rack)}) is down")


def _store_address() -> tuple[str, int] | None:
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT", "")
    return (host, int(port)) if host and port.isdigit() else None


def _reachable(address: tuple[str, int]) -> bool | None:
    """``True`` when the store's address accepts a connection, ``None`` when it refuses (the host
    answers, its process is gone), ``False`` when nothing answers in :data:`PROBE_EVERY` seconds."""
    try:
        with socket.create_connection(address, timeout=PROBE_EVERY):
            return True
    except ConnectionRefusedError:
        return None
    except (socket.timeout, TimeoutError):
        return False
    except OSError as exc:
        return False if exc.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH) else None


def start_store_probe(waited: Callable[[], float], on_lost: Callable[[str], None]) -> None:
    """Start the thread of [Note: a partition, not lost ranks] for this rank (once)."""
    address, plane = _store_address(), current()
    if address is None or plane.found.get("store_probe") is not None:
        return
    thread = threading.Thread(target=_probe_loop, args=(plane, address, waited, on_lost), name="hybridshard-store-probe",
                              daemon=True)
    plane.found["store_probe"] = thread
    thread.start()


def _probe_loop(plane: Any, address: tuple[str, int], waited: Callable[[], float],
                on_lost: Callable[[str], None]) -> None:
    with bound(plane):
        silent = 0
        while not plane.stop.wait(PROBE_EVERY / 2):
            if paths().get(0) == my_path():
                return  # the store's rack: a spine cut never takes the store from it
            if waited() < _WAITED:
                silent = 0
                continue
            silent = silent + 1 if _reachable(address) is False else 0
            if silent < 2:
                continue
            me = peers.identity()[0]
            text = store_lost_text(me, address)
            if text is not None:
                on_lost(f"{text}; rank {me} has waited {waited():.0f}s in a collective and the job's store at "
                        f"{address[0]}:{address[1]} answered nothing for {2 * PROBE_EVERY:.0f}s.")
            return
