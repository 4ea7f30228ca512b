"""Connector stats (vLLM's periodic log) and the vllm:umbp_* Prometheus counters."""

from __future__ import annotations

import functools
import logging
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from umbp_redis import connector
from umbp_redis.connector import UMBPRedisConnector
from umbp_redis.engine.stats import UMBPConnectorStats
from umbp_redis.engine.worker import WorkerStats


def prometheus_metrics() -> tuple[CollectorRegistry, Any]:
    """A private registry and the connector's metrics registered in it (one engine "0")."""
    reg = CollectorRegistry()
    types: dict[type, Any] = {
        Counter: functools.partial(Counter, registry=reg),
        Gauge: functools.partial(Gauge, registry=reg),
        Histogram: functools.partial(Histogram, registry=reg),
    }
    cfg = SimpleNamespace(kv_transfer_config=None)
    return reg, UMBPRedisConnector.build_prom_metrics(cfg, types, ["engine"], {0: ["0"]})


def test_stats_aggregate_and_reduce() -> None:
    ws = WorkerStats()
    ws.add(blocks_loaded=3, bytes_loaded=3_000_000, loads=2, load_ms_total=10.0)
    a = UMBPConnectorStats(data=ws.take())
    assert ws.take()["blocks_loaded"] == 0  # reset on report
    b = UMBPRedisConnector.build_kv_connector_stats({"blocks_loaded": 2, "stores_dropped": 1})
    a.aggregate(b)
    red = a.reduce()
    assert red["blocks_loaded"] == 5 and red["stores_dropped"] == 1
    assert red["MB_loaded"] == 3.0 and red["avg_load_ms"] == 5.0
    assert not a.is_empty() and UMBPConnectorStats(data={}).is_empty()


def test_prometheus_counters() -> None:
    reg, prom = prometheus_metrics()
    prom.observe({"blocks_stored": 4, "bytes_stored": 4096, "stores_dropped": 1}, 0)
    prom.observe({"blocks_stored": 1}, 0)
    assert reg.get_sample_value("vllm:umbp_blocks_stored_total", {"engine": "0"}) == 5
    assert reg.get_sample_value("vllm:umbp_bytes_stored_total", {"engine": "0"}) == 4096
    assert reg.get_sample_value("vllm:umbp_stores_dropped_total", {"engine": "0"}) == 1


def test_cluster_counters_reach_the_log_line_and_prometheus_per_node() -> None:
    reg, prom = prometheus_metrics()
    data = {
        "cluster_moved": 2,
        "cluster_map_refreshes": 1,
        "cluster_node_failures": 3,
        "node_failures@10.0.0.1:7000": 3,
    }
    a = UMBPConnectorStats(data=dict(data))
    a.aggregate(UMBPConnectorStats(data={"cluster_moved": 1}))
    red = a.reduce()
    assert red["cluster_moved"] == 3 and red["cluster_node_failures"] == 3
    assert "cluster_ask" not in red  # zero counters stay out of the log line
    prom.observe(data, 0)
    prom.observe({"node_failures@10.0.0.1:7000": 1}, 0)
    assert reg.get_sample_value("vllm:umbp_cluster_moved_total", {"engine": "0"}) == 2
    got = reg.get_sample_value(
        "vllm:umbp_cluster_node_failures_by_node_total", {"engine": "0", "node": "10.0.0.1:7000"}
    )
    assert got == 4


def test_layer_waits_reach_the_log_line_and_prometheus() -> None:
    reg, prom = prometheus_metrics()
    a = UMBPConnectorStats(data={"sync_loads": 2, "layer_wait_ms": 3.456})
    a.aggregate(UMBPConnectorStats(data={"layer_wait_ms": 1.0}))
    red = a.reduce()
    assert red["layer_wait_ms"] == 4.46 and red["sync_loads"] == 2
    assert "layer_wait_ms" not in UMBPConnectorStats(data={"loads": 1}).reduce()
    prom.observe({"layer_wait_ms": 4.5}, 0)
    assert reg.get_sample_value("vllm:umbp_layer_wait_ms_total", {"engine": "0"}) == 4.5


def test_step_observations_concatenate_across_workers_and_feed_histograms() -> None:
    ws = WorkerStats()
    ws.observe("sync_load_wait_s", 0.004)
    ws.observe("stalled_requests", 3)
    ws.add(sync_loads=1)
    a = UMBPConnectorStats(data=ws.take())
    assert "sync_load_wait_s" not in ws.take()  # observations reset on report too
    other = UMBPConnectorStats(
        data={"sync_load_wait_s": [0.006], "lookup_s": [0.001], "load_s": [0.02, 0.3]}
    )
    a.aggregate(other)
    assert a.data["sync_load_wait_s"] == [0.004, 0.006] and a.data["sync_loads"] == 1
    red = a.reduce()
    assert red["avg_sync_load_wait_ms"] == 5.0 and red["avg_lookup_ms"] == 1.0
    assert red["stalled_requests"] == 3
    reg, prom = prometheus_metrics()
    prom.observe(a.data, 0)
    labels = {"engine": "0"}
    assert reg.get_sample_value("vllm:umbp_sync_load_wait_seconds_count", labels) == 2
    total = reg.get_sample_value("vllm:umbp_sync_load_wait_seconds_sum", labels)
    assert total is not None and abs(total - 0.01) < 1e-9
    assert reg.get_sample_value("vllm:umbp_stalled_requests_sum", labels) == 3
    le = {"engine": "0", "le": "0.005"}
    assert reg.get_sample_value("vllm:umbp_sync_load_wait_seconds_bucket", le) == 1
    assert reg.get_sample_value("vllm:umbp_lookup_seconds_count", labels) == 1
    assert reg.get_sample_value("vllm:umbp_load_seconds_count", labels) == 2
    le = {"engine": "0", "le": "0.05"}
    assert reg.get_sample_value("vllm:umbp_load_seconds_bucket", le) == 1


def test_observations_are_bounded_per_interval() -> None:
    from umbp_redis.engine.stats import MAX_OBSERVATIONS

    ws = WorkerStats()
    for i in range(MAX_OBSERVATIONS + 10):
        ws.observe("store_cpu_s", float(i))
    assert len(ws.take()["store_cpu_s"]) == MAX_OBSERVATIONS


def test_every_counter_of_the_table_is_exported_or_feeds_an_average() -> None:
    from umbp_redis.engine.stats import COUNTERS

    reg, prom = prometheus_metrics()
    exported = [c for c in COUNTERS if c.doc]
    prom.observe({c.name: 1 for c in COUNTERS}, 0)
    for c in exported:
        assert reg.get_sample_value(f"vllm:umbp_{c.name}_total", {"engine": "0"}) == 1, c.name
    # The counters without a metric are the sums behind the log line's averages.
    assert {c.name for c in COUNTERS if not c.doc} == {
        "loads",
        "load_ms_total",
        "stores",
        "store_ms_total",
    }
    # The scheduler's counters are in the log line once they are not zero.
    red = UMBPConnectorStats(data={"quarantine_skips": 2, "idle_waits": 0}).reduce()
    assert red["quarantine_skips"] == 2 and "idle_waits" not in red
    assert red["unexpected_errors"] == 0  # always shown


def test_the_package_logs_go_through_vllms_handlers(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a process's first connector does to logging (``_route_logs_to_vllm``)."""
    ours, theirs = logging.getLogger("umbp_redis"), logging.getLogger("vllm")
    level = ours.level
    handler = logging.NullHandler()
    monkeypatch.setattr(theirs, "handlers", [handler])
    monkeypatch.setattr(ours, "handlers", [])
    monkeypatch.setattr(ours, "propagate", True)
    try:
        # Unwrapped: this process's connectors may have run it already (once a process).
        connector._route_logs_to_vllm.__wrapped__()
        assert ours.handlers == [handler] and not ours.propagate
        assert ours.level == (theirs.level or logging.INFO)
    finally:
        ours.setLevel(level)
