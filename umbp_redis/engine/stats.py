"""Connector statistics in vLLM's periodic log (``KVConnectorStats``) and Prometheus.

Counters are numbers summed over workers and intervals; the per-step account
(``STEP_OBSERVATIONS``) travels as lists of observations, concatenated, and feeds the
``vllm:umbp_*`` histograms.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

# Observations one recorder keeps per interval at most (the newest are dropped).
MAX_OBSERVATIONS = 4096

# The per-step account: name in the stats data -> (Prometheus histogram, help, buckets).
_SECONDS_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.5)
STEP_OBSERVATIONS: dict[str, tuple[str, str, tuple[float, ...]]] = {
    "lookup_s": (
        "vllm:umbp_lookup_seconds",
        "Seconds of each prefix lookup's round trip to Redis (scheduler).",
        _SECONDS_BUCKETS,
    ),
    "load_s": (
        "vllm:umbp_load_seconds",
        "Seconds of each load (one request's blocks on one worker), async or sync.",
        _SECONDS_BUCKETS,
    ),
    "scheduler_step_s": (
        "vllm:umbp_scheduler_step_seconds",
        "Seconds the connector's scheduler hooks took per engine step, lookups included.",
        _SECONDS_BUCKETS,
    ),
    "sync_load_wait_s": (
        "vllm:umbp_sync_load_wait_seconds",
        "Seconds a step's forward pass waited for its sync loads (per step with one).",
        _SECONDS_BUCKETS,
    ),
    "stalled_requests": (
        "vllm:umbp_stalled_requests",
        "Other requests of a step that waited behind its sync loads (per step with one).",
        (0, 1, 2, 4, 8, 16, 32, 64, 128, 256),
    ),
    "store_cpu_s": (
        "vllm:umbp_store_cpu_seconds",
        "CPU seconds of each store batch: its gather on the engine thread and its writes.",
        _SECONDS_BUCKETS,
    ),
}


class StatsRecorder:
    """Thread-safe counters and per-step observations of one side of the connector,
    handed out and reset by ``take``."""

    FIELDS: tuple[str, ...] = ()

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.values: dict[str, Any] = dict.fromkeys(self.FIELDS, 0)
        self._seen_totals: dict[str, int] = {}  # for add_totals

    def add_totals(self, totals: dict[str, int]) -> None:
        """Add counters kept elsewhere as running totals: each one's growth since the
        last call (a total that shrank, as from a new source, restarts from there)."""
        for name, now in totals.items():
            delta = now - self._seen_totals.get(name, 0)
            self._seen_totals[name] = now
            if delta > 0:
                self.add(**{name: delta})

    def add(self, **kw: float) -> None:
        """Add to counters."""
        with self._lock:
            for k, v in kw.items():
                self.values[k] = self.values.get(k, 0) + v

    def observe(self, name: str, value: float) -> None:
        """Record one observation of ``name`` (one of ``STEP_OBSERVATIONS``)."""
        with self._lock:
            seen = self.values.setdefault(name, [])
            if len(seen) < MAX_OBSERVATIONS:
                seen.append(value)

    def take(self) -> dict[str, Any]:
        """Counters and observations since the last call (and reset them)."""
        with self._lock:
            out, self.values = self.values, dict.fromkeys(self.FIELDS, 0)
            return out


def _merge(a: Any, b: Any) -> Any:
    if isinstance(a, list) or isinstance(b, list):
        return [*(a or []), *(b or [])]
    return a + b


def _mean(values: Iterable[float]) -> float:
    values = list(values)
    return sum(values) / len(values) if values else math.nan


@dataclass
class UMBPConnectorStats(KVConnectorStats):
    """Counters of one interval: blocks and bytes moved, failures, dropped stores, time."""

    def reset(self) -> None:
        """Clear the interval's counters."""
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> UMBPConnectorStats:
        """Sum another worker's (or interval's) counters into this one."""
        for k, v in (other.data or {}).items():
            self.data[k] = _merge(self.data.get(k, 0), v)
        return self

    def reduce(self) -> dict[str, int | float]:
        """The interval's summary for the log line."""
        d: dict[str, Any] = dict(self.data)
        out: dict[str, int | float] = {}
        for c in COUNTERS:
            value = d.get(c.name, 0)
            if c.log == "always" or (c.log == "nonzero" and value):
                out[c.name] = round(value, 2) if isinstance(value, float) else value
        out["MB_loaded"] = round(d.get("bytes_loaded", 0) / 1e6, 2)
        out["MB_stored"] = round(d.get("bytes_stored", 0) / 1e6, 2)
        if d.get("loads"):
            out["avg_load_ms"] = round(d.get("load_ms_total", 0) / d["loads"], 2)
        if d.get("stores"):
            out["avg_store_ms"] = round(d.get("store_ms_total", 0) / d["stores"], 2)
        for name, label in (
            ("lookup_s", "avg_lookup_ms"),
            ("sync_load_wait_s", "avg_sync_load_wait_ms"),
            ("store_cpu_s", "avg_store_cpu_ms"),
        ):
            if d.get(name):
                out[label] = round(_mean(d[name]) * 1e3, 2)
        if d.get("stalled_requests"):
            out["stalled_requests"] = sum(d["stalled_requests"])
        return out

    def is_empty(self) -> bool:
        """No transfer in the interval."""
        return not any(self.data.values()) if self.data else True


@dataclass(frozen=True)
class Counter:
    """One counter of the connector's stats data.

    ``doc``: the help of its Prometheus counter ``vllm:umbp_<name>_total`` (empty: not
    exported, a sum kept for an average in the log line); ``log``: "always" or
    "nonzero" for when vLLM's log line shows it, empty for never; ``side``: which half
    counts it ("worker", "scheduler", or "store": the data plane's totals, which the
    worker reports as deltas)."""

    name: str
    doc: str
    log: str
    side: str


COUNTERS: tuple[Counter, ...] = (
    Counter("blocks_loaded", "KV blocks loaded from Redis.", "always", "worker"),
    Counter("bytes_loaded", "Bytes of KV loaded from Redis.", "", "worker"),
    Counter("blocks_stored", "KV blocks stored in Redis.", "always", "worker"),
    Counter("bytes_stored", "Bytes of KV stored in Redis.", "", "worker"),
    Counter(
        "load_failures",
        "Blocks that failed to load (missing, invalid or error) and were recomputed.",
        "always",
        "worker",
    ),
    Counter(
        "sync_loads",
        "Loads run in the step that computes their request (load_async false, or auto "
        "and at most sync_load_max_bytes, or 128 MiB where workers load by layer).",
        "nonzero",
        "worker",
    ),
    Counter(
        "layer_wait_ms",
        "Milliseconds the forward pass waited in wait_for_layer_load for loads by layer.",
        "nonzero",
        "worker",
    ),
    Counter("store_failures", "Block stores Redis refused or that failed.", "always", "worker"),
    Counter(
        "stores_dropped",
        "Block stores dropped because staging memory was full or a sync load of their step failed.",
        "always",
        "worker",
    ),
    Counter("loads", "", "", "worker"),
    Counter("load_ms_total", "", "", "worker"),
    Counter("stores", "", "", "worker"),
    Counter("store_ms_total", "", "", "worker"),
    Counter(
        "auth_failures",
        "Logins and commands Redis refused (wrong password, NOAUTH, NOPERM): check the ACL.",
        "always",
        "store",
    ),
    Counter(
        "unexpected_errors",
        "Connector bugs (in the data plane, or a scheduler hook) and malformed replies, "
        "turned into misses or dropped stores.",
        "always",
        "store",
    ),
    Counter(
        "cluster_moved",
        "Redis Cluster MOVED redirects followed (the slot map was stale).",
        "nonzero",
        "store",
    ),
    Counter(
        "cluster_ask",
        "Redis Cluster ASK redirects followed (a slot was migrating).",
        "nonzero",
        "store",
    ),
    Counter("cluster_map_refreshes", "Redis Cluster slot maps read.", "nonzero", "store"),
    Counter(
        "cluster_node_failures",
        "Redis Cluster masters that failed a lookup, store or load (their keys missed).",
        "nonzero",
        "store",
    ),
    Counter(
        "quarantine_skips",
        "Lookups whose hit ended at a block whose load had failed lately "
        "(load_failure_quarantine_s).",
        "nonzero",
        "scheduler",
    ),
    Counter(
        "idle_waits",
        "Engine steps with nothing to compute but loads or stores in flight, in which the "
        "scheduler waited 1 ms.",
        "nonzero",
        "scheduler",
    ),
    Counter(
        "stale_pins_released",
        "Store events whose worker reports did not come within 120 s; their blocks were released.",
        "nonzero",
        "scheduler",
    ),
    Counter(
        "sync_load_uncached",
        "Blocks taken out of vLLM's prefix cache after a failed sync load.",
        "nonzero",
        "scheduler",
    ),
    Counter(
        "markers_written",
        "Stored markers written: blocks every rank's worker reported stored.",
        "nonzero",
        "scheduler",
    ),
    Counter(
        "marker_failures",
        "Stored markers, value refreshes and marker deletions that did not land "
        "(a marker not written is a miss).",
        "nonzero",
        "scheduler",
    ),
    Counter(
        "values_refreshed",
        "Value keys of found blocks whose TTL or LRU clock was refreshed.",
        "",
        "scheduler",
    ),
    Counter(
        "stale_markers_removed",
        "Stored markers deleted because a rank value was gone or found invalid.",
        "nonzero",
        "scheduler",
    ),
    Counter(
        "marker_commands_dropped",
        "Marker writes and value refreshes dropped: the writer's queue was full.",
        "nonzero",
        "scheduler",
    ),
    Counter(
        "fleet_blocks_announced",
        "Blocks this engine announced (stored or gone) on the namespace's announcement "
        "stream (fleet_events).",
        "",
        "scheduler",
    ),
    Counter(
        "fleet_blocks_relayed",
        "Blocks other engines stored that this engine's KV events announced (fleet_events).",
        "",
        "scheduler",
    ),
    Counter(
        "fleet_blocks_removed",
        "Blocks this engine's KV events announced removed from the fleet's tier: their "
        "marker was gone, another engine found them gone, or too many were credited.",
        "",
        "scheduler",
    ),
    Counter(
        "fleet_feed_failures",
        "Round trips of the fleet block feed that failed or ended unanswered (nothing "
        "announced or relayed by them).",
        "nonzero",
        "scheduler",
    ),
    Counter(
        "fleet_feed_dropped",
        "Fleet announcements or events dropped: their queue was full.",
        "nonzero",
        "scheduler",
    ),
    Counter(
        "loads_declined",
        "Hits not loaded because loading them was expected to take longer than computing "
        "them (decline_slow_loads).",
        "nonzero",
        "scheduler",
    ),
    Counter(
        "tokens_declined",
        "Prompt tokens of declined hits (computed instead of loaded).",
        "nonzero",
        "scheduler",
    ),
    Counter(
        "load_probes",
        "Hits of which one block was loaded, while hits were declined, to measure the link "
        "again (at most one every 30 s).",
        "nonzero",
        "scheduler",
    ),
    Counter(
        "lazy_blocks_stored",
        "Blocks pinned for a lazy store (store_mode lazy).",
        "nonzero",
        "scheduler",
    ),
)

# The data plane's counters the worker carries into the stats, as deltas per interval.
STORE_COUNTERS = tuple(c.name for c in COUNTERS if c.side == "store")

# Per-node counters travel in the stats data as "<prefix><host:port>".
NODE_FAILURES_PREFIX = "node_failures@"


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
            for name, doc in ((c.name, c.doc) for c in COUNTERS if c.doc)
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
        histograms = {
            name: self._histogram_cls(
                name=metric,
                documentation=doc,
                labelnames=labelnames,
                buckets=list(buckets),  # type: ignore[call-arg]
            )
            for name, (metric, doc, buckets) in STEP_OBSERVATIONS.items()
        }
        self._histograms = {
            idx: {n: h.labels(*values) for n, h in histograms.items()}
            for idx, values in per_engine_labelvalues.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Add one interval's counters and its per-step observations."""
        metrics = self._per_engine.get(engine_idx)
        if metrics is None:
            return
        data = transfer_stats_data or {}
        for name, metric in metrics.items():
            value = data.get(name, 0)
            if value:
                metric.inc(value)  # type: ignore[union-attr]
        for name, histogram in self._histograms.get(engine_idx, {}).items():
            for value in data.get(name) or ():
                histogram.observe(value)  # type: ignore[union-attr]
        values = self._per_engine_labelvalues.get(engine_idx, [])
        for key, value in data.items():
            if key.startswith(NODE_FAILURES_PREFIX) and value:
                node = key[len(NODE_FAILURES_PREFIX) :]
                self._node_failures.labels(*values, node).inc(value)  # type: ignore[union-attr]
