"""The live-tensor-bytes counter the tests use; it lives in :mod:`hybridshard.bench.live_bytes`, which the bench shares."""

from hybridshard.bench.live_bytes import LiveTensorBytes, _key

__all__ = ["LiveTensorBytes", "_key"]
