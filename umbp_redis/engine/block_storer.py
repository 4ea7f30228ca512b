"""A step's store batches: gathered into staging after the forward pass, written to
Redis on a transfer thread, each store event reported once its gather is done."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from umbp_redis.data import BlockIdentityCodec, BlockStoreBatch, BlockTransferPlan
from umbp_redis.engine.block_loader import by_fingerprint, copy_plan
from umbp_redis.engine.copy.interface import BlockCopier, CopyHandle
from umbp_redis.engine.staging import StagingPool
from umbp_redis.engine.stats import StatsRecorder
from umbp_redis.engine.worker_ledger import WorkerLedger
from umbp_redis.store.deployment import DataPlane
from umbp_redis.store.plane import StoreStatus

log = logging.getLogger(__name__)


class BlockStorer:
    """Stores batches of blocks for one worker.

    Each batch is gathered into staging slots (torch copies on CPU; a kernel launch on a
    copy stream on GPU) and its Redis writes queued with ``submit_write`` (the worker's
    store thread). A store event is reported in the first step that finds its gather
    done, so the scheduler keeps the source blocks pinned exactly as long as the copy
    reads them. A store that cannot run (staging full, a bug, a failed gather) is
    dropped and counted, never raised into the engine's step.
    """

    def __init__(
        self,
        plane: DataPlane,
        codec: BlockIdentityCodec,
        stats: StatsRecorder,
        ledger: WorkerLedger,
        plan_block: Callable[[BlockTransferPlan, str], BlockTransferPlan],
        submit_write: Callable[..., object],
        *,
        can_store: bool,
    ) -> None:
        self.plane = plane
        self.codec = codec
        self.stats = stats
        self.ledger = ledger
        self.plan_block = plan_block
        self.submit_write = submit_write
        self.can_store = can_store
        self.staging: StagingPool | None = None
        self.copier: BlockCopier | None = None
        self.part_lengths: dict[bytes, tuple[int, ...]] = {}  # by layout fingerprint
        self._dropped_logged = False
        # (event id, keys, gather) of launched gathers not yet reported (engine thread).
        self._unreported: list[tuple[int, frozenset[str], CopyHandle]] = []

    def drop(self, batches: list[BlockStoreBatch]) -> None:
        """Report ``batches`` dropped without writing them.

        A sync load that failed left blocks the forward pass read as prefix; every block
        the step computed may depend on them (the failed request's, and any other
        request's that shared its cached blocks), so none of them is stored. vLLM rolls
        the failed request back and computes them again; they are stored then.
        """
        n = sum(len(b) for b in batches)
        if not n:
            for b in batches:
                self.ledger.store_reported(b.event_id, frozenset())
            return
        self.stats.add(stores_dropped=n)
        if not self._dropped_logged:
            self._dropped_logged = True
            log.warning(
                "umbp-redis: a sync load failed, so the %d blocks this step computed are "
                "not stored (they may depend on the blocks that did not load); vLLM "
                "computes them again (logged once)",
                n,
            )
        for b in batches:
            pairs = zip(b.block_hashes, b.group_ids, strict=True)
            keys = frozenset(self.codec.key(h, g) for h, g in pairs)
            self.ledger.store_reported(b.event_id, keys)

    def submit(self, batches: list[BlockStoreBatch]) -> None:
        """Gather every batch and queue its writes (or report it dropped)."""
        if not batches or self.copier is None or self.staging is None:
            for b in batches:
                self.ledger.store_reported(b.event_id, frozenset())
            return
        for batch in batches:
            try:
                self._submit_one(batch)
            except Exception as e:  # a bug drops this store, never the engine's step
                log.error("umbp-redis: store of %s failed: %r", batch.request_id, e)
                self.stats.add(store_failures=len(batch))
                self.ledger.store_reported(batch.event_id, frozenset())
        self.report_finished_gathers()

    def _submit_one(self, batch: BlockStoreBatch) -> None:
        assert self.copier is not None and self.staging is not None
        plans = [
            self.plan_block(p, batch.request_id) for p in batch if self.codec.stores(p.group_id)
        ]
        if not plans or not self.can_store:
            self.ledger.store_reported(batch.event_id, frozenset())
            return
        keys = frozenset(p.key for p in plans)
        slots = self.staging.acquire(len(plans))
        if slots is None:
            self.stats.add(stores_dropped=len(plans))
            log.debug("staging full: dropped %d block stores", len(plans))
            self.ledger.store_reported(batch.event_id, keys)
            return
        t0 = time.thread_time()
        try:
            gathered = self.copier.gather(copy_plan(plans, slots))
        except Exception as e:  # a copy bug drops the store, never the engine
            log.error("umbp-redis: gather of %d blocks failed: %r", len(plans), e)
            self.staging.release(slots)
            self.stats.add(store_failures=len(plans))
            self.ledger.store_reported(batch.event_id, keys)
            return
        # The scheduler unpins the source blocks once the event is reported: only
        # after the gather has read them.
        self._unreported.append((batch.event_id, keys, gathered))
        self.submit_write(self.write, plans, slots, gathered, time.thread_time() - t0)

    def report_finished_gathers(self) -> None:
        """Report the store events whose gathers are done, without blocking.

        A gather that failed is reported with its keys failed (the store thread logs
        and counts it). Runs on the engine's thread only.
        """
        pending = []
        for event_id, keys, handle in self._unreported:
            try:
                if not handle.done():
                    pending.append((event_id, keys, handle))
                    continue
                failed: frozenset[str] = frozenset()
            except Exception:
                failed = keys
            self.ledger.store_reported(event_id, failed)
        self._unreported = pending

    def write(
        self,
        plans: list[BlockTransferPlan],
        slots: list[int],
        gathered: CopyHandle,
        gather_cpu_s: float = 0.0,
    ) -> None:
        """The store thread's part: wait for the gather, write each layout's values,
        release the slots (always), record the store's time and CPU."""
        assert self.staging is not None
        t0 = time.perf_counter()
        cpu0 = time.thread_time()
        try:
            try:
                gathered.wait()  # the staging bytes are complete only after the copy
            except Exception as e:
                log.error("umbp-redis: gather of %d blocks failed: %r", len(plans), e)
                self.stats.add(store_failures=len(plans))
                return
            for fp, idx in by_fingerprint(plans).items():
                items: list[tuple[str, Any]] = [
                    (plans[i].key, self.staging.array(slots[i])[: plans[i].object_size])
                    for i in idx
                ]
                res = self.plane.store(items, fp, parts=self.part_lengths.get(fp))
                stored = [i for i, s in zip(idx, res, strict=True) if s is StoreStatus.STORED]
                if self.ledger.has_recent_failures:
                    self.ledger.values_stored([plans[i].block_hash for i in stored])
                self.stats.add(
                    blocks_stored=len(stored),
                    bytes_stored=sum(plans[i].object_size for i in stored),
                    store_failures=sum(s in (StoreStatus.ERROR, StoreStatus.OOM) for s in res),
                )
        finally:
            self.staging.release(slots)
            self.stats.add(stores=1, store_ms_total=(time.perf_counter() - t0) * 1e3)
            self.stats.observe("store_cpu_s", gather_cpu_s + time.thread_time() - cpu0)
