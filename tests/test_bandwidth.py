"""Bandwidth diagnostics: nccl-tests formulas, a real 2x2 measurement, and the slow-group warning."""

import json

import pytest

from hybridshard.diagnostics.bandwidth import BandwidthReport, BandwidthRow, bus_bandwidth
from tests.mp import RankPool

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def pool():
    with RankPool(4, num_nodes=2, layout="block") as p:
        yield p


def test_busbw_formulas():
    assert bus_bandwidth("all_gather", 8.0, 8) == pytest.approx(7.0)
    assert bus_bandwidth("reduce_scatter", 10.0, 2) == pytest.approx(5.0)
    assert bus_bandwidth("all_reduce", 10.0, 4) == pytest.approx(15.0)
    assert bus_bandwidth("all_reduce", 10.0, 1) == 0.0
    with pytest.raises(ValueError, match="collective must be one of"):
        bus_bandwidth("broadcast", 1.0, 2)
    with pytest.raises(ValueError, match=">= 1"):
        bus_bandwidth("all_reduce", 1.0, 0)


def test_row_bandwidths():
    row = BandwidthRow("all_reduce", 0, (0, 2), ("a", "b"), size_bytes=2_000_000, time_s=0.001)
    assert row.algbw_gbps == pytest.approx(2.0) and row.busbw_gbps == pytest.approx(2.0)
    lone = BandwidthRow("all_gather", 1, (3,), ("a",), size_bytes=4096, time_s=None)
    assert lone.algbw_gbps is None and lone.busbw_gbps is None


def _measure(sizes):
    import hybridshard as hs
    from hybridshard.diagnostics.bandwidth import measure_bandwidth

    groups = hs.init_groups()
    report = measure_bandwidth(groups, sizes_bytes=sizes, iters=2, progress=True)
    return report.to_dict(), report.table()


def test_measure_on_two_simulated_nodes(pool):
    sizes = (4096, 65536)
    results = pool.run(_measure, sizes)
    d, table = results[0]
    assert all(r[0] == d for r in results)  # every rank has the whole report
    rows = {(r["kind"], tuple(r["ranks"]), r["size_bytes"]): r for r in d["rows"]}
    expected = {(k, g, s) for k in ("all_gather", "reduce_scatter") for g in ((0, 1), (2, 3)) for s in sizes}
    expected |= {("all_reduce", g, s) for g in ((0, 2), (1, 3)) for s in sizes}
    assert set(rows) == expected
    for (kind, ranks, _), r in rows.items():
        assert r["time_s"] > 0 and r["busbw_gbps"] > 0
        factor = 2 * (len(ranks) - 1) / len(ranks) if kind == "all_reduce" else (len(ranks) - 1) / len(ranks)
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * factor)
    assert rows[("all_gather", (2, 3), 4096)]["hosts"] == ["node1", "node1"]
    assert rows[("all_reduce", (0, 2), 4096)]["hosts"] == ["node0", "node1"]
    assert "shard group 1" in table and "replicate group 0" in table and "busbw (GB/s)" in table
    assert BandwidthReport.from_dict(json.loads(json.dumps(d))).to_dict() == d


def _bad_sizes():
    import hybridshard as hs
    from hybridshard.diagnostics.bandwidth import measure_bandwidth

    groups = hs.init_groups()
    messages = []
    for kwargs in ({"sizes_bytes": (), "iters": 1}, {"sizes_bytes": (4096,), "iters": 0}):
        try:
            measure_bandwidth(groups, **kwargs)
            messages.append("no error")
        except ValueError as exc:
            messages.append(str(exc))
    return messages


def test_measure_rejects_bad_sizes(pool):
    for sizes_msg, iters_msg in pool.run(_bad_sizes):
        assert "sizes_bytes must be a non-empty list" in sizes_msg and "iters must be >= 1, found 0" in iters_msg


def test_measure_needs_a_process_group():
    from hybridshard.diagnostics.bandwidth import measure_bandwidth

    with pytest.raises(RuntimeError, match="needs an initialised default process group"):
        measure_bandwidth(object())


def _report(shard_times, replicate_times):
    rows = []
    for i, t in enumerate(shard_times):
        rows.append(BandwidthRow("all_gather", i, (2 * i, 2 * i + 1), (f"h{i}", f"h{i}"), 1 << 20, t))
    hosts = [f"h{i}" for i in range(len(shard_times))]
    for i, t in enumerate(replicate_times):
        rows.append(BandwidthRow("all_reduce", i, tuple(range(i, 2 * len(shard_times), 2)), tuple(hosts), 1 << 20, t))
    return BandwidthReport(rows=tuple(rows), iters=1, backend="gloo", device="cpu")


def test_warning_names_a_group_more_than_twice_slower():
    report = _report([0.001, 0.001, 0.0011, 0.0035], [0.01, 0.01])
    warnings = report.warnings
    assert len(warnings) == 1
    assert "shard group 3" in warnings[0] and "h3" in warnings[0] and "all_gather" in warnings[0]
    assert report.to_dict()["warnings"] == warnings
    assert _report([0.001, 0.0019, 0.001], [0.01, 0.01]).warnings == []  # under 2x: no warning


def test_warning_names_a_slow_host_of_multi_host_groups():
    hosts3 = ("a", "b", "c")
    rows = (
        BandwidthRow("all_reduce", 0, (0, 1), ("a", "b"), 1 << 20, 0.001),
        BandwidthRow("all_reduce", 1, (2, 3), ("a", "b"), 1 << 20, 0.001),
        BandwidthRow("all_reduce", 2, (4, 5), ("b", "c"), 1 << 20, 0.001),
        BandwidthRow("all_reduce", 3, (6, 7), ("c", "a"), 1 << 20, 0.001),
        BandwidthRow("all_reduce", 4, (8, 9), ("d", "a"), 1 << 20, 0.01),
    )
    warnings = BandwidthReport(rows=rows, iters=1, backend="gloo", device="cpu").warnings
    assert any(w.startswith("host d:") for w in warnings)
    assert any("replicate group 4" in w for w in warnings)
    assert not any(w.startswith(f"host {h}:") for w in warnings for h in hosts3)
