"""Fault-tolerant HYBRID_SHARD on torchft (``pip install hybridshard[ft]``); see docs/fault-tolerance.md.

``hs.FaultTolerance(model, optimizer)`` after ``hs.shard``; see [Note: fault-tolerant mode] in
:mod:`hybridshard.ft.mode`. Importing this package does not need torchft; creating the mode does.
"""

from hybridshard.ft.mode import FaultTolerance, import_torchft

__all__ = ["FaultTolerance", "import_torchft"]
