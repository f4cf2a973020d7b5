"""The example's model: a small GPT-style decoder (pre-norm blocks, tied output head).

The same model as ``hybridshard bench``'s (defined in :mod:`hybridshard.bench.model`), so the
benchmark's figures speak for this example. Each :class:`Block` is one unit under
``hs.shard(..., wrap={Block})``.
"""

from __future__ import annotations

from hybridshard.bench.model import GPT, Block

__all__ = ["Block", "GPT"]
