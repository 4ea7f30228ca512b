"""Redis (or Redis Cluster) as a secondary tier of vLLM's own KV offloading.

vLLM's ``OffloadingConnector`` with tiering keeps a CPU primary tier and hands chunks to
secondary tiers: this one stores them in Redis through the project's data plane (each
value bound to its key and checksummed, with the ``ttl_seconds`` TTL) and loads them
back into the primary tier's rows. Configured in the OffloadingConnector's extra config::

    "secondary_tiers": [{"type": "umbp_redis", "redis_url": "redis://host:6379/0"}]

(the ``umbp_redis`` plugin registers the type; without it add
``"module_path": "umbp_redis.engine.redis_tier"``). The tier takes the store's options of
``kv_connector_extra_config`` (``redis_url``, ``password_file``, timeouts, ``ttl_seconds``,
...) and ``enable_kv_events``; a password in the config is refused as for the connector.

Everything the scheduler calls returns at once: lookups run on vLLM's async lookup
thread (one pipelined ``EXISTS`` round trip per step's batch), stores and loads on this
tier's threads; every Redis wait is bounded by the store's timeouts. Redis down means
misses and failed jobs, never an exception in the step. A chunk that fails to load
(missing, invalid, another namespace's) fails its job: vLLM recomputes it, and its row
of the primary tier is zeroed, so no foreign byte stays there.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Collection, Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any, ClassVar

from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from umbp_redis.data.chunks import chunk_fingerprint, chunk_key, chunk_namespace
from umbp_redis.store.commands import expire_command, touch_command
from umbp_redis.store.deployment import DataPlane, open_plane
from umbp_redis.store.errors import ConfigError
from umbp_redis.store.plane import StoreStatus
from umbp_redis.store.resp import encode_command
from umbp_redis.store.settings import (
    REDIS_OPTIONS,
    RedisSettings,
    refuse_secrets,
)
from umbp_redis.store.value_reads import LoadStatus

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

log = logging.getLogger(__name__)

# Tier options besides the store's.
TIER_OPTIONS = frozenset({"enable_kv_events", "locality", "transfer_threads"})
# Transfer threads (stores and loads run beside each other).
DEFAULT_TRANSFER_THREADS = 2


def _take_all(q: queue.SimpleQueue[Any]) -> list[Any]:
    """Everything queued in ``q`` now, in order (other threads may keep adding)."""
    out = []
    while True:
        try:
            out.append(q.get_nowait())
        except queue.Empty:
            return out


class _RedisChunkLookups(AsyncLookupManager):
    """vLLM's async lookup thread, asking Redis whether chunks exist (one round trip)."""

    def __init__(self, tier: UMBPRedisTier, tier_type: str) -> None:
        super().__init__(tier_type=tier_type)
        self._tier = tier

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        """Whether each chunk is in Redis; all False when Redis did not answer in time."""
        return self._tier.exists(keys)


class UMBPRedisTier(SecondaryTierManager):
    """Chunks of the CPU primary tier in Redis; see the module docstring."""

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: BackpressureDetector | None = None,
        **options: Any,
    ) -> None:
        super().__init__(
            offloading_spec=offloading_spec,
            primary_kv_view=primary_kv_view,
            tier_type=tier_type,
            backpressure_detector=backpressure_detector,
        )
        refuse_secrets(options)
        store_names = {o.name for o in REDIS_OPTIONS}
        unknown = set(options) - store_names - TIER_OPTIONS
        if unknown:
            raise ConfigError(
                f"secondary tier {tier_type!r}: unknown options {sorted(unknown)}; valid: "
                f"{sorted(store_names | TIER_OPTIONS)}"
            )
        self.settings = RedisSettings.from_options(  # validates the values
            {k: v for k, v in options.items() if k in store_names}
        )
        # Events by default where vLLM's --kv-events-config asks the offloading for them.
        default_events = offloading_spec.kv_events_config.enable_kv_cache_events
        self.enable_events = bool(options.get("enable_kv_events", default_events))
        self.locality = Locality.REMOTE
        threads = int(options.get("transfer_threads", DEFAULT_TRANSFER_THREADS))
        if threads < 1:
            raise ConfigError(f"secondary tier {tier_type!r}: transfer_threads must be >= 1")
        self.namespace = chunk_namespace(offloading_spec.config, self.block_size_bytes)
        self.fingerprint = chunk_fingerprint(self.namespace)
        self._ttl = str(int(self.settings.ttl_seconds)).encode()
        self.plane: DataPlane = open_plane(self.settings)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="umbp-tier")
        self._pending: set[Future[None]] = set()
        self._pending_lock = threading.Lock()
        self._finished: queue.SimpleQueue[JobResult] = queue.SimpleQueue()
        self._events: queue.SimpleQueue[OffloadingEvent] = queue.SimpleQueue()
        self._lookups = _RedisChunkLookups(self, tier_type)
        # The primary tier's rows as bytes: chunk c is [c * size, (c + 1) * size).
        self._flat = (
            primary_kv_view.cast("B")
            if primary_kv_view.ndim != 1 or primary_kv_view.format != "B"
            else primary_kv_view
        )
        # Counters since startup.
        self.stored_chunks = self.loaded_chunks = 0
        self.failed_stores = self.failed_loads = 0
        log.info(
            "umbp-redis tier: chunks of %d bytes in %s, namespace %s",
            self.block_size_bytes,
            self.settings.redacted_url,
            self.namespace,
        )

    # -- lookups ----------------------------------------------------------------------

    def key_of(self, key: OffloadKey) -> bytes:
        """The Redis key of a chunk."""
        return chunk_key(self.namespace, key)

    def exists(self, keys: Collection[OffloadKey]) -> list[bool]:
        """Whether each chunk is in Redis (one round trip, per master on a cluster);
        all False when Redis did not answer within ``lookup_timeout_s``."""
        cmds = [(k, encode_command(b"EXISTS", k)) for k in map(self.key_of, keys)]
        replies = self.plane.run_keyed(cmds, timeout=self.settings.lookup_timeout_s)
        if replies is None:
            return [False] * len(cmds)
        return [r == 1 for r in replies]

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """HIT or MISS once the async lookup answered; RETRY until then."""
        found = self._lookups.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        """Send this step's lookups to the lookup thread."""
        self._lookups.flush()

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        """Every request offloads chunk by chunk (vLLM's default policy)."""
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        """Forget the request's lookups."""
        self._lookups.cleanup(req_context.req_id)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Refresh the chunks' TTL (or LRU clock) in Redis, on a transfer thread."""
        redis_keys = [self.key_of(k) for k in keys]
        if not redis_keys:
            return
        if self.settings.refresh_ttl_on_lookup:
            cmds = [(k, expire_command(k, self._ttl)) for k in redis_keys]
        else:
            cmds = [(k, touch_command([k])) for k in redis_keys]
        self._submit(lambda: self._run_quietly(cmds))

    def _run_quietly(self, cmds: list[tuple[bytes, bytes]]) -> None:
        self.plane.run_keyed(cmds, timeout=self.settings.op_timeout_s)

    # -- transfers --------------------------------------------------------------------

    def _submit(self, fn: Any) -> None:
        fut = self._pool.submit(fn)
        with self._pending_lock:
            self._pending.add(fut)
        fut.add_done_callback(self._done)

    def _done(self, fut: Future[None]) -> None:
        with self._pending_lock:
            self._pending.discard(fut)

    def submit_store(self, job_metadata: TransferJob) -> None:
        """Store the job's primary rows in Redis, on a transfer thread."""
        self._submit(lambda: self._store(job_metadata))

    def submit_load(self, job_metadata: TransferJob) -> None:
        """Load the job's chunks into its primary rows, on a transfer thread."""
        self._submit(lambda: self._load(job_metadata))

    def _row(self, chunk_id: Any) -> memoryview:
        """Chunk ``chunk_id``'s row of the primary tier, as bytes."""
        size = self.block_size_bytes
        start = int(chunk_id) * size
        return self._flat[start : start + size]

    def _store(self, job: TransferJob) -> None:
        t0 = time.perf_counter()
        keys = list(job.keys)
        try:
            items = [
                (self.key_of(k), self._row(c)) for k, c in zip(keys, job.chunk_ids, strict=True)
            ]
            statuses = self.plane.store(items, self.fingerprint)
        except Exception as e:  # a bug must fail the job, never the engine
            log.error("umbp-redis tier: store job %d failed: %r", job.job_id, e)
            statuses = [StoreStatus.ERROR] * len(keys)
        stored = [k for k, s in zip(keys, statuses, strict=True) if s is StoreStatus.STORED]
        self.stored_chunks += len(stored)
        self.failed_stores += len(keys) - len(stored)
        if stored and self.enable_events:
            self._events.put(self._event(stored, removed=False))
        self._finished.put(
            JobResult(
                job_id=job.job_id,
                success=len(stored) == len(keys),
                transfer_time=time.perf_counter() - t0,
                transfer_bytes=len(stored) * self.block_size_bytes,
            )
        )

    def _load(self, job: TransferJob) -> None:
        t0 = time.perf_counter()
        keys = list(job.keys)
        rows = [self._row(c) for c in job.chunk_ids]
        try:
            items = [(self.key_of(k), row) for k, row in zip(keys, rows, strict=True)]
            statuses = self.plane.load(
                items, self.fingerprint, deadline=time.monotonic() + self.settings.op_timeout_s
            )
        except Exception as e:
            log.error("umbp-redis tier: load job %d failed: %r", job.job_id, e)
            statuses = [LoadStatus.ERROR] * len(keys)
        loaded = []
        missing = []
        for k, row, s in zip(keys, rows, statuses, strict=True):
            if s is LoadStatus.LOADED:
                loaded.append(k)
                continue
            row[:] = bytes(len(row))  # no partial or foreign bytes stay
            missing.append(k)
        self.loaded_chunks += len(loaded)
        self.failed_loads += len(missing)
        if missing:
            self._lookups.mark_miss(missing)
        self._finished.put(
            JobResult(
                job_id=job.job_id,
                success=not missing,
                successful_keys=loaded if missing else None,
                transfer_time=time.perf_counter() - t0,
                transfer_bytes=len(loaded) * self.block_size_bytes,
            )
        )

    def _event(self, keys: list[OffloadKey], *, removed: bool) -> OffloadingEvent:
        return OffloadingEvent(
            keys=keys,
            medium=Medium.STORAGE,
            removed=removed,
            locality=Locality.REMOTE,
            ownership=self.tier_type,
        )

    def get_finished_jobs(self) -> Iterable[JobResult]:
        """Jobs finished since the last call."""
        return _take_all(self._finished)

    def has_pending_work(self) -> bool:
        """Whether stores, loads or refreshes are still running."""
        with self._pending_lock:
            return bool(self._pending)

    def take_events(self) -> Iterable[OffloadingEvent]:
        """Stored-chunk events since the last call (with ``enable_kv_events``)."""
        return _take_all(self._events)

    def drain_jobs(self) -> None:
        """Wait for every submitted job (each ends within the store's timeouts)."""
        with self._pending_lock:
            pending = list(self._pending)
        wait(pending)

    def shutdown(self) -> None:
        """Finish the jobs, stop the threads and close the connections."""
        self.drain_jobs()
        self._pool.shutdown(wait=True)
        self._lookups.shutdown()
        self.plane.close()


# The name a tier config's "type" gives with a "module_path" (vLLM looks the type up in
# the module): {"type": "umbp_redis", "module_path": "umbp_redis.engine.redis_tier"}.
umbp_redis = UMBPRedisTier
