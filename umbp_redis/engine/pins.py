"""KV blocks the connector holds in vLLM's block pool while transfers are in flight."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

# A store event whose reports did not all come within this long is released.
STORE_REPORT_TIMEOUT_S = 120.0


@dataclass
class _PinnedStore:
    blocks: list[Any]
    pinned_at: float
    reports: int = 0


class BlockPins:
    """Pins on vLLM's KV blocks: the sources of each store event until every worker
    reported it, and the destinations of each request's async loads until they are done.

    A pinned block stays allocated (and out of vLLM's free queue) even when its request
    finishes or is aborted, so a transfer never reads or writes a block that was given
    to another request. A store event with no full set of reports within
    ``report_timeout_s`` is released (``release_stale``). Without a block pool (unit
    tests, a scheduler not bound yet) nothing is pinned.
    """

    def __init__(
        self,
        num_workers: int,
        report_timeout_s: float = STORE_REPORT_TIMEOUT_S,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.num_workers = num_workers
        self.report_timeout_s = report_timeout_s
        self.clock = clock
        self.block_pool: Any = None
        self.stores: dict[int, _PinnedStore] = {}
        self.loads: dict[str, list[Any]] = {}
        self.stale_released = 0  # store events released without their reports

    def bind(self, block_pool: Any) -> None:
        """Pin in ``block_pool`` (vLLM's ``BlockPool``) from now on."""
        self.block_pool = block_pool

    def pin_store(
        self, event_id: int, block_ids: Sequence[int], pinned: list[Any] | None = None
    ) -> None:
        """Hold a store event's source blocks until its reports are in (``pinned``: the
        blocks, already pinned by the caller)."""
        if pinned is None:
            if self.block_pool is None:
                return
            pinned = [self.block_pool.blocks[b] for b in block_ids]
            self.block_pool.touch(pinned)
        self.stores[event_id] = _PinnedStore(pinned, self.clock())

    def store_reported(self, event_id: int, finished_workers: int) -> None:
        """Count a store event's worker reports; release its blocks once all are in."""
        pin = self.stores.get(event_id)
        if pin is None:
            return
        pin.reports += finished_workers
        if pin.reports >= self.num_workers:
            self.release_store(event_id)

    def release_store(self, event_id: int) -> None:
        """Release a store event's blocks now (no-op when not pinned)."""
        pin = self.stores.pop(event_id, None)
        if pin is not None and self.block_pool is not None:
            self.block_pool.free_blocks(pin.blocks)

    def release_stale(self) -> None:
        """Release store events whose reports did not all come within the bound
        (logged the first time)."""
        if not self.stores:
            return
        limit = self.clock() - self.report_timeout_s
        stale = [eid for eid, pin in self.stores.items() if pin.pinned_at < limit]
        if not stale:
            return
        if self.stale_released == 0:
            log.warning(
                "umbp-redis: %d store events had no worker report within %.0fs; their "
                "blocks are released (vllm:umbp_stale_pins_released_total)",
                len(stale),
                self.report_timeout_s,
            )
        self.stale_released += len(stale)
        for eid in stale:
            self.release_store(eid)

    def pin_load(self, request_id: str, block_ids: Sequence[int]) -> None:
        """Hold an async load's destination blocks until ``load_done``."""
        if self.block_pool is None or not block_ids:
            return
        pins = [self.block_pool.blocks[b] for b in block_ids]
        self.block_pool.touch(pins)
        self.loads.setdefault(request_id, []).extend(pins)

    def load_done(self, request_id: str) -> None:
        """Release a request's load destinations (no-op when none are pinned)."""
        pins = self.loads.pop(request_id, None)
        if pins and self.block_pool is not None:
            self.block_pool.free_blocks(pins)

    def blocks(self) -> Iterator[Any]:
        """Every block pinned here."""
        return itertools.chain(
            (b for pin in self.stores.values() for b in pin.blocks),
            (b for pins in self.loads.values() for b in pins),
        )

    def __len__(self) -> int:
        """Blocks pinned here."""
        return sum(len(p.blocks) for p in self.stores.values()) + sum(
            len(p) for p in self.loads.values()
        )

    def release_all(self) -> None:
        """Release every pin (shutdown)."""
        for eid in list(self.stores):
            self.release_store(eid)
        for rid in list(self.loads):
            self.load_done(rid)
