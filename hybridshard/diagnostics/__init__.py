"""Cluster diagnostics that need a running job (bandwidth of the planned groups)."""

from hybridshard.diagnostics.bandwidth import BandwidthReport, BandwidthRow, bus_bandwidth, measure_bandwidth

__all__ = ["BandwidthReport", "BandwidthRow", "bus_bandwidth", "measure_bandwidth"]
