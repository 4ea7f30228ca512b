"""Connector statistics in vLLM's periodic log (``KVConnectorStats``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats


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
            )
        }
        out["MB_loaded"] = round(d.get("bytes_loaded", 0) / 1e6, 2)
        out["MB_stored"] = round(d.get("bytes_stored", 0) / 1e6, 2)
        if d.get("loads"):
            out["avg_load_ms"] = round(d["load_ms_total"] / d["loads"], 2)
        if d.get("stores"):
            out["avg_store_ms"] = round(d["store_ms_total"] / d["stores"], 2)
        return out

    def is_empty(self) -> bool:
        """No transfer in the interval."""
        return not any(self.data.values()) if self.data else True
