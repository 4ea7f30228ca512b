"""Connector statistics in vLLM's periodic log (``KVConnectorStats``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)


@dataclass
class UMBPConnectorStats(KVConnectorStats):
    """Counters of one interval: blocks and bytes moved, failures, dropped stores, time."""

    def reset(self) -> None:
        """Clear the interval's counters."""
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> UMBPConnectorStats:
        """Sum another worker's (or interval's) counters into this one."""
        for k, v in (other.data or {}).items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        """The interval's summary for the log line."""
        d: dict[str, Any] = dict(self.data)
        out: dict[str, int | float] = {
            k: d.get(k, 0)
            for k in (
                "blocks_loaded",
                "blocks_stored",
                "load_failures",
                "store_failures",
                "stores_dropped",
                "auth_failures",
                "unexpected_errors",
            )
        }
        if d.get("sync_loads"):
            out["sync_loads"] = d["sync_loads"]
        if d.get("layer_wait_ms"):
            out["layer_wait_ms"] = round(d["layer_wait_ms"], 2)
        for k in CLUSTER_COUNTERS:
            if d.get(k):
                out[k] = d[k]
        out["MB_loaded"] = round(d.get("bytes_loaded", 0) / 1e6, 2)
        out["MB_stored"] = round(d.get("bytes_stored", 0) / 1e6, 2)
        if d.get("loads"):
            out["avg_load_ms"] = round(d.get("load_ms_total", 0) / d["loads"], 2)
        if d.get("stores"):
            out["avg_store_ms"] = round(d.get("store_ms_total", 0) / d["stores"], 2)
        return out

    def is_empty(self) -> bool:
        """No transfer in the interval."""
        return not any(self.data.values()) if self.data else True


# Redis Cluster event counters (in the log line only when not zero).
CLUSTER_COUNTERS = (
    "cluster_moved",
    "cluster_ask",
    "cluster_map_refreshes",
    "cluster_node_failures",
)

# Per-node counters travel in the stats data as "<prefix><host:port>".
NODE_FAILURES_PREFIX = "node_failures@"

_PROM_COUNTERS = (
    ("blocks_loaded", "KV blocks loaded from Redis."),
    ("bytes_loaded", "Bytes of KV loaded from Redis."),
    ("blocks_stored", "KV blocks stored in Redis."),
    ("bytes_stored", "Bytes of KV stored in Redis."),
    (
        "load_failures",
        "Blocks that failed to load (missing, invalid or error) and were recomputed.",
    ),
    (
        "sync_loads",
        "Loads run in the step that computes their request (load_async false, or auto "
        "and at most sync_load_max_bytes, or layer_load_max_bytes by layer).",
    ),
    (
        "layer_wait_ms",
        "Milliseconds the forward pass waited in wait_for_layer_load for loads by layer.",
    ),
    ("store_failures", "Block stores Redis refused or that failed."),
    ("stores_dropped", "Block stores dropped because staging memory was full."),
    (
        "auth_failures",
        "Logins and commands Redis refused (wrong password, NOAUTH, NOPERM): check the ACL.",
    ),
    (
        "unexpected_errors",
        "Connector bugs and malformed replies turned into misses or dropped stores.",
    ),
    ("cluster_moved", "Redis Cluster MOVED redirects followed (the slot map was stale)."),
    ("cluster_ask", "Redis Cluster ASK redirects followed (a slot was migrating)."),
    ("cluster_map_refreshes", "Redis Cluster slot maps read."),
    (
        "cluster_node_failures",
        "Redis Cluster masters that failed a lookup, store or load (their keys missed).",
    ),
)


class UMBPPromMetrics(KVConnectorPromMetrics):
    """``vllm:umbp_*`` Prometheus counters fed from ``UMBPConnectorStats`` data."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            name: self._counter_cls(
                name=f"vllm:umbp_{name}_total", documentation=doc, labelnames=labelnames
            )
            for name, doc in _PROM_COUNTERS
        }
        self._labelnames = labelnames
        self._per_engine_labelvalues = per_engine_labelvalues
        self._node_failures = self._counter_cls(
            name="vllm:umbp_cluster_node_failures_by_node_total",
            documentation="Failed lookups, stores or loads per Redis Cluster master.",
            labelnames=[*labelnames, "node"],
        )
        self._per_engine = {
            idx: {n: c.labels(*values) for n, c in self._counters.items()}
            for idx, values in per_engine_labelvalues.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Add one interval's counters."""
        metrics = self._per_engine.get(engine_idx)
        if metrics is None:
            return
        data = transfer_stats_data or {}
        for name, metric in metrics.items():
            value = data.get(name, 0)
            if value:
                metric.inc(value)  # type: ignore[union-attr]
        values = self._per_engine_labelvalues.get(engine_idx, [])
        for key, value in data.items():
            if key.startswith(NODE_FAILURES_PREFIX) and value:
                node = key[len(NODE_FAILURES_PREFIX) :]
                self._node_failures.labels(*values, node).inc(value)  # type: ignore[union-attr]
