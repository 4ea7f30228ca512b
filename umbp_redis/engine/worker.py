"""Worker half of the connector: planned gathers/scatters and Redis I/O off the forward pass.

Stores: the step's store batches are gathered into staging slots right after the
forward pass (torch copies on CPU; one kernel launch per batch on a copy stream on GPU,
which the engine's later work does not wait for); each batch's store event is reported
in the first step whose ``build_worker_meta`` finds its gather done (at once on CPU), so
the scheduler keeps the source blocks pinned exactly as long as the copy reads them;
the Redis writes run on a transfer thread once the gather has completed.
Loads: each batch is read into staging slots and scattered into its destination blocks
on a transfer thread (after the engine's work submitted when the load started); the
request is reported finished when every block is terminal and its scatter has
completed, and blocks that did not load are reported so vLLM recomputes them.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any

import torch

from umbp_redis.data import (
    BlockIdentityCodec,
    BlockLoadBatch,
    BlockStoreBatch,
    BlockTransferPlan,
    KVLayoutPlanner,
    RankTopology,
    StagingCopyPlan,
    StoreEventResult,
    UMBPConnectorMetadata,
    UMBPConnectorWorkerMetadata,
    UMBPHandshakeMetadata,
    UMBPNamespace,
    block_failures_reportable,
    tp_replicated_group_ids,
)
from umbp_redis.engine.copy.factory import make_block_copier
from umbp_redis.engine.copy.interface import BlockCopier, CopyHandle
from umbp_redis.engine.layer_gate import LayerGate
from umbp_redis.engine.load_scatter import ScatterAsLoaded
from umbp_redis.engine.options import EngineOptions
from umbp_redis.engine.staging import StagingPool, staging_budget
from umbp_redis.engine.stats import CLUSTER_COUNTERS, NODE_FAILURES_PREFIX, StatsRecorder
from umbp_redis.engine.weights import weights_fingerprint
from umbp_redis.store.deployment import DataPlane, shared_plane
from umbp_redis.store.errors import ConfigError
from umbp_redis.store.plane import LoadStatus, StoreStatus
from umbp_redis.store.settings import RedisSettings
from umbp_redis.store.thread_affinity import thread_pinner

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger(__name__)

# Failed-load block hashes one report carries at most (the oldest are dropped).
MAX_FAILED_LOADS_REPORTED = 4096

# Seconds past a load-by-layer's deadline the end of the step waits for its thread.
LAYER_LOAD_JOIN_GRACE_S = 1.0

# Data-plane counters carried into vLLM's stats (as deltas per interval).
CARRIED_COUNTERS = ("auth_failures", "unexpected_errors", *CLUSTER_COUNTERS)


def _remember(seen: dict[bytes, None], hashes: list[bytes]) -> None:
    """Add ``hashes`` to the insertion-ordered ``seen``, dropping the oldest beyond
    ``MAX_FAILED_LOADS_REPORTED``."""
    for h in hashes:
        seen[h] = None
    while len(seen) > MAX_FAILED_LOADS_REPORTED:
        del seen[next(iter(seen))]


def _live_ranks() -> tuple[int, int, int]:
    """(tp, pp, pcp) rank of this worker, 0 where a group is not initialised."""
    from vllm.distributed import parallel_state as ps

    out = []
    for getter in ("get_tp_group", "get_pp_group", "get_pcp_group"):
        try:
            out.append(int(getattr(ps, getter)().rank_in_group))
        except Exception:
            out.append(0)
    return out[0], out[1], out[2]


def _by_fingerprint(plans: list[BlockTransferPlan]) -> dict[bytes, list[int]]:
    """Plan indices grouped by object layout (one data-plane call per layout)."""
    groups: dict[bytes, list[int]] = defaultdict(list)
    for i, p in enumerate(plans):
        groups[p.layout_fingerprint].append(i)
    return groups


def _positions(
    scatters: ScatterAsLoaded | None, idx: list[int]
) -> Callable[[list[int]], None] | None:
    """The plane's ``on_loaded`` for one of a load's fingerprint groups: positions in the
    group (``idx``) are mapped back to positions in the load."""
    if scatters is None:
        return None
    return lambda done: scatters.launch([idx[j] for j in done])


def _arrivals(gate: LayerGate | None, group: int) -> Callable[[int, list[int]], None] | None:
    """The plane's ``on_part`` for one cache group of a load by layer."""
    if gate is None:
        return None
    return lambda part, done: gate.arrived(group, part, done)


def _copy_plan(plans: list[BlockTransferPlan], slots: list[int]) -> StagingCopyPlan:
    """The copier's view of blocks and their staging slots."""
    return StagingCopyPlan(
        group_ids=tuple(p.group_id for p in plans),
        block_ids=tuple(p.block_id for p in plans),
        slots=tuple(slots),
    )


class LoadSwitchInterval:
    """Python's thread switch interval, shortened while loads are in flight, process-wide.

    A transfer thread gives up the GIL on every socket read; while vLLM's engine loop or
    forward pass runs Python, taking it back waits up to the interval (5 ms by default)
    each time, hundreds of times per load. A short interval makes every thread of the
    process switch that often, though, the forward pass's too: so it holds only while
    some worker of the process has a load in flight (stores wait for nobody)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders = 0
        self._saved: float | None = None
        self._logged = False

    def hold(self, ms: float) -> bool:
        """Shorten the interval to ``ms`` milliseconds if it is longer (0: no change)
        until the matching ``release``; returns whether the caller must release."""
        if ms <= 0:
            return False
        with self._lock:
            self._holders += 1
            current = sys.getswitchinterval()
            if self._saved is None and current > ms / 1e3:
                self._saved = current
                sys.setswitchinterval(ms / 1e3)
                if not self._logged:
                    self._logged = True
                    log.info(
                        "umbp-redis: Python's thread switch interval is %.2f ms while loads "
                        "are in flight (%.2f ms otherwise; gil_switch_interval_ms)",
                        ms,
                        current * 1e3,
                    )
        return True

    def release(self) -> None:
        """End one ``hold``; the last one restores the interval it found."""
        with self._lock:
            self._holders -= 1
            if self._holders == 0 and self._saved is not None:
                sys.setswitchinterval(self._saved)
                self._saved = None


# The process's one switch-interval holder (the interval is a process-wide setting).
LOAD_SWITCH_INTERVAL = LoadSwitchInterval()


class WorkerStats(StatsRecorder):
    """Counters the worker reports through ``KVConnectorStats`` (reset on each report)."""

    FIELDS = (
        "blocks_loaded",
        "bytes_loaded",
        "blocks_stored",
        "bytes_stored",
        "load_failures",
        "store_failures",
        "stores_dropped",
        "load_ms_total",
        "store_ms_total",
        "loads",
        "sync_loads",
        "layer_wait_ms",
        "stores",
    ) + CARRIED_COUNTERS


class UMBPWorker:
    """Transfers for one worker process."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        kv_cache_config: KVCacheConfig,
        settings: RedisSettings,
        options: EngineOptions,
        *,
        plane: DataPlane | None = None,
        ranks: tuple[int, int, int] | None = None,
    ) -> None:
        self.options = options
        role = (
            vllm_config.kv_transfer_config.kv_role if vllm_config.kv_transfer_config else "kv_both"
        )
        self.can_store = role in ("kv_producer", "kv_both")
        tp, pp, pcp = ranks if ranks is not None else _live_ranks()
        self.topology = RankTopology.from_vllm_config(
            vllm_config, tp_rank=tp, pp_rank=pp, pcp_rank=pcp
        )
        weights = None
        if UMBPNamespace.configured(vllm_config) is None:
            weights = weights_fingerprint(vllm_config.model_config, options.weights_fingerprint)
        self.namespace = UMBPNamespace.resolve(vllm_config, kv_cache_config, weights)
        self.codec = BlockIdentityCodec(
            self.namespace.value,
            self.topology,
            tp_replicated_group_ids(kv_cache_config, self.topology),
        )
        self.planner = KVLayoutPlanner(kv_cache_config)
        self.plane: DataPlane = plane or shared_plane(settings)
        self.stats = WorkerStats()
        self._seen_counters: dict[str, int] = {}
        # Free to leave the forward pass's cores where vLLM binds them (transfer_cpus).
        pin = thread_pinner(settings.transfer_cpus)
        self._loads = ThreadPoolExecutor(1, thread_name_prefix="umbp-load", initializer=pin)
        self._stores = ThreadPoolExecutor(1, thread_name_prefix="umbp-store", initializer=pin)
        # Sync loads run alongside the forward pass, a part of every block at a time.
        self.load_by_layer = options.load_by_layer
        self._layer_loads = ThreadPoolExecutor(4, thread_name_prefix="umbp-layers", initializer=pin)
        self._step_gates: list[tuple[LayerGate, Any, BlockLoadBatch]] = []
        self._layer_part: dict[str, tuple[int, int]] = {}  # layer -> (group, part)
        self._part_lengths: dict[bytes, tuple[int, ...]] = {}  # by layout fingerprint
        self._part_count: dict[int, int] = {}  # by cache group
        self._layer_wait_logged = False
        # Some group's objects are in parts and received straight into the KV cache.
        self._receives_in_parts = False
        self._layer_loads_turned_off = False  # since the last report
        self._lock = threading.Lock()
        self._finished_loads: set[str] = set()
        self._load_errors: set[int] = set()
        # Failed loads as block ids where vLLM takes them, else as failed requests.
        self.fails_per_request = not block_failures_reportable(kv_cache_config)
        self._failed_recving: set[str] = set()
        self._sync_failed: dict[str, None] = {}  # requests whose sync load failed
        # A sync load of this step failed: the forward pass computed over blocks that did
        # not load, so this step's stores would write KV computed from them.
        self._step_sync_failed = False
        # Seconds this step's forward pass has waited for its sync loads so far.
        self._step_sync_wait_s = 0.0
        self._dropped_stores_logged = False
        self._store_reports: dict[int, StoreEventResult] = {}
        # Block hashes whose load failed (invalid or error) since the last report; those
        # reported lately (bounded); those of them stored again since the last report.
        self._failed_loads: dict[bytes, None] = {}
        self._recent_failed: dict[bytes, None] = {}
        self._repaired: dict[bytes, None] = {}
        self._failed_requests: dict[str, None] = {}
        self._removed: dict[bytes, None] = {}
        # (event id, keys, gather) of launched gathers not yet reported (engine thread).
        self._unreported_gathers: list[tuple[int, frozenset[str], CopyHandle]] = []
        self._cancelled: set[str] = set()
        self._loading: dict[str, int] = {}  # request id -> loads in flight
        self._switch_held = False  # this worker holds LOAD_SWITCH_INTERVAL (loads in flight)
        self._futures: set[Any] = set()
        self.meta: UMBPConnectorMetadata | None = None
        self._stores_submitted = False
        self.bases: dict[str, int] = {}
        self.copier: BlockCopier | None = None
        # Loads into host KV caches receive straight into the blocks (tests turn it off
        # to compare with the staging path).
        self.direct_loads = True
        # Loads through staging copy each window as it arrives where the copier is
        # asynchronous (a GPU: the copy costs the transfer thread a launch); synchronous
        # host copies would hold up the receiving thread, measured no faster, so they
        # run after the batch. True or False forces either (benchmarks).
        self.scatter_as_loaded: bool | None = None
        self.sync_load_timeout_s = options.sync_load_timeout_s
        self.load_switch_interval_ms = options.gil_switch_interval_ms
        self.staging: StagingPool | None = None
        log.info(
            "umbp-redis worker %s: key namespace %s (%s)",
            self.topology.rank_label(),
            self.namespace.value,
            "derived" if self.namespace.derived else "configured",
        )

    # -- setup ------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Plan the object layout from the live tensors and allocate staging."""
        self.bases = self.planner.register_kv_caches(kv_caches)
        slot = max(lay.object_size for lay in self.planner.layouts.values())
        pin = any(t.is_cuda for t in kv_caches.values())
        max_bytes = self.options.max_staging_bytes
        budget = staging_budget(max_bytes, pinned=pin)
        if budget != max_bytes:
            log.info(
                "umbp-redis: pinned staging uses %d of max_staging_bytes=%d (pinned memory "
                "is allocated in powers of two)",
                budget,
                max_bytes,
            )
        if budget < slot:
            need = slot if not pin else 1 << (slot - 1).bit_length()
            raise ConfigError(
                f"kv_connector_extra_config['max_staging_bytes'] is {max_bytes}, which holds no "
                f"staging slot: one object is {slot} bytes, so it must be at least {need}"
                + (" (pinned staging is allocated in powers of two)" if pin else "")
            )
        self.staging = StagingPool(slot, budget, pin_memory=pin)
        templates = {g: self.planner.range_template(g, self.bases) for g in self.planner.layouts}
        self.copier = make_block_copier(
            self.options.copy_backend,
            kv_caches,
            templates,
            self.staging,
            self.planner.num_blocks,
        )
        log.info(
            "umbp-redis: %s block copies, %d staging slots of %d bytes%s",
            self.copier.name,
            self.staging.num_slots,
            slot,
            " (pinned)" if pin else "",
        )
        views_of = getattr(self.copier, "receive_views", None)
        for gid, lay in self.planner.layouts.items():
            self._part_lengths[lay.fingerprint] = lay.part_lengths()
            self._part_count[gid] = len(self._part_lengths[lay.fingerprint])
            for layer, part in lay.layer_parts().items():
                self._layer_part[layer] = (gid, part)
            if self._part_count[gid] > 1 and views_of is not None:
                views = views_of(gid, 0)
                self._receives_in_parts |= (
                    views is not None and sum(v.nbytes for v in views) == lay.object_size
                )
            log.info(
                "umbp-redis: group %d object %d bytes, %d regions, %d parts, layout %s",
                gid,
                lay.object_size,
                len(lay.regions),
                self._part_count[gid],
                lay.fingerprint_hex,
            )

    def handshake_metadata(self) -> UMBPHandshakeMetadata:
        """What the scheduler needs from this worker."""
        return UMBPHandshakeMetadata(
            namespace=self.namespace.value,
            topology=self.topology,
            loads_by_layer=self.sync_loads_by_layer(),
        )

    def sync_loads_by_layer(self) -> bool:
        """Whether this worker's sync loads run by layer: ``load_by_layer`` is on, loads
        receive straight into the KV cache (host memory) and objects are in parts."""
        return (
            self.load_by_layer
            and not self.fails_per_request
            and self.direct_loads
            and self._receives_in_parts
        )

    # -- per step ---------------------------------------------------------------------

    def bind(self, meta: UMBPConnectorMetadata) -> None:
        """Take this step's metadata."""
        self.meta = meta
        self._stores_submitted = False
        self._step_sync_failed = False
        self._step_sync_wait_s = 0.0
        if meta.cancelled_requests:
            with self._lock:
                # Only requests with a load in flight need remembering (bounded memory).
                self._cancelled.update(r for r in meta.cancelled_requests if r in self._loading)

    def start_load_kv(self) -> None:
        """Start (async) or run (sync) this step's loads."""
        meta = self.meta
        if meta is None or not meta.loads:
            return
        # Scatters into the destination blocks go after the engine's work so far.
        try:
            after = self.copier.engine_point() if self.copier is not None else None
        except Exception as e:  # without the ordering point, recompute instead of loading
            log.error("umbp-redis: cannot order loads after the engine's work: %r", e)
            for batch in meta.loads:
                self._fail_load(batch, batch.load_async)
            return
        # Sync loads first: the forward pass waits for them, not for the async ones.
        for batch in sorted(meta.loads, key=lambda b: b.load_async):
            if batch.fail_all:  # the scheduler could not plan it: vLLM recomputes
                self._fail_load(batch, batch.load_async)
                continue
            with self._lock:
                self._cancelled.discard(batch.request_id)
                self._loading[batch.request_id] = self._loading.get(batch.request_id, 0) + 1
                if not self._switch_held:
                    self._switch_held = LOAD_SWITCH_INTERVAL.hold(self.load_switch_interval_ms)
            if batch.load_async:
                self._track(self._loads.submit(self._run_load, batch, True, after))
            elif self._loads_by_layer(batch):
                # The forward pass waits for each layer's part (wait_for_layer_load) and
                # the step's end for the whole load (wait_for_save).
                groups: dict[int, int] = defaultdict(int)
                for g in batch.group_ids:
                    groups[g] += 1
                gate = LayerGate(groups, time.monotonic() + self.sync_load_timeout_s)
                fut = self._layer_loads.submit(self._run_load, batch, False, after, gate)
                self._track(fut)
                self._step_gates.append((gate, fut, batch))
            else:  # vLLM runs the forward pass once this returns
                t0 = time.perf_counter()
                self._run_load(batch, False, after)
                self._step_sync_wait_s += time.perf_counter() - t0

    def _loads_by_layer(self, batch: BlockLoadBatch) -> bool:
        """Whether a sync load runs alongside the forward pass (host KV caches, values
        stored in several parts)."""
        return self.sync_loads_by_layer() and any(
            self._part_count.get(g, 1) > 1 for g in set(batch.group_ids)
        )

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Before ``layer_name``'s attention: wait until this step's loads by layer have
        its part of every block, at most until their deadline (``sync_load_timeout_s``;
        blocks not loaded by then are reported failed at the step's end)."""
        if not self._step_gates:
            return
        where = self._layer_part.get(layer_name)
        if where is None:  # a layer no load of ours writes
            return
        t0 = time.perf_counter()
        for gate, _fut, _batch in self._step_gates:
            arrived = gate.wait(*where)
            if not arrived and not self._layer_wait_logged:
                self._layer_wait_logged = True
                log.warning(
                    "umbp-redis: a sync load had not brought layer %s in by "
                    "sync_load_timeout_s=%.3g; its blocks are recomputed (logged once)",
                    layer_name,
                    self.sync_load_timeout_s,
                )
        waited = time.perf_counter() - t0
        self._step_sync_wait_s += waited
        self.stats.add(layer_wait_ms=waited * 1e3)

    def _join_layer_loads(self) -> None:
        """End of the forward pass: wait for this step's loads by layer to end (each by
        its deadline, plus a grace); a load that has not ended, or one some layer of
        which the forward pass did not wait for, fails all its blocks."""
        gates, self._step_gates = self._step_gates, []
        t0 = time.perf_counter()
        for gate, fut, batch in gates:
            try:
                fut.result(
                    timeout=max(0.0, gate.deadline - time.monotonic()) + LAYER_LOAD_JOIN_GRACE_S
                )
            except Exception as e:
                log.error("umbp-redis: sync load of %s did not end: %r", batch.request_id, e)
                with self._lock:
                    self._note_load_failure(batch.request_id, set(batch.block_ids), sync=True)
                continue
            parts = {
                (g, p) for g in set(batch.group_ids) for p in range(self._part_count.get(g, 0))
            }
            unwaited = parts - gate.waited
            if unwaited:
                # The forward pass may have read those layers before their bytes were in.
                with self._lock:
                    self._note_load_failure(batch.request_id, set(batch.block_ids), sync=True)
                if self.load_by_layer:
                    self.load_by_layer = False
                    self._layer_loads_turned_off = True  # the scheduler hears of it
                    log.warning(
                        "umbp-redis: the forward pass did not wait for every layer of a "
                        "load by layer (not waited: %s); its blocks are recomputed and "
                        "sync loads now run before the forward pass (load_by_layer off)",
                        sorted(unwaited),
                    )
        if gates:
            self._step_sync_wait_s += time.perf_counter() - t0

    def wait_for_save(self) -> None:
        """Submit this step's stores (once per step); drop them all where a sync load of
        the step failed (see ``_drop_stores``)."""
        if self.meta is not None and not self._stores_submitted:
            self._stores_submitted = True
            self._join_layer_loads()
            self._account_sync_wait(self.meta)
            with self._lock:
                tainted = self._step_sync_failed
            if tainted:
                self._drop_stores(self.meta.stores)
            else:
                self._submit_stores(self.meta.stores)

    def _account_sync_wait(self, meta: UMBPConnectorMetadata) -> None:
        """Record how long this step waited for its sync loads and how many other
        requests of the step waited with them."""
        syncing = {b.request_id for b in meta.loads if not b.load_async and not b.fail_all}
        if not syncing:
            return
        self.stats.observe("sync_load_wait_s", self._step_sync_wait_s)
        self.stats.observe("stalled_requests", max(0, meta.step_requests - len(syncing)))

    def clear(self) -> None:
        """End of step: submit stores if no forward pass ran, drop the metadata."""
        self.wait_for_save()
        self.meta = None

    def _track(self, fut: Any) -> None:
        with self._lock:
            self._futures.add(fut)
        fut.add_done_callback(self._untrack)

    def _untrack(self, fut: Any) -> None:
        with self._lock:
            self._futures.discard(fut)
        exc = fut.exception()
        if exc is not None:
            log.error("umbp-redis transfer failed unexpectedly: %r", exc)

    def _plan(self, plan: BlockTransferPlan, request_id: str) -> BlockTransferPlan:
        """Key, size and layout of one block; the copier lowers the ranges per batch."""
        key = self.codec.key(plan.block_hash, plan.group_id)
        return self.planner.plan_for_block(
            key,
            plan.block_id,
            self.bases,
            group_id=plan.group_id,
            request_id=request_id,
            block_hash=plan.block_hash,
            lower=False,
        )

    # -- stores -----------------------------------------------------------------------

    def _drop_stores(self, batches: list[BlockStoreBatch]) -> None:
        """Report ``batches`` dropped without writing them.

        A sync load that failed left blocks the forward pass read as prefix; every block
        the step computed may depend on them (the failed request's, and any other
        request's that shared its cached blocks), so none of them is stored. vLLM rolls
        the failed request back and computes them again; they are stored then.
        """
        n = sum(len(b) for b in batches)
        if not n:
            for b in batches:
                self._report_store(b.event_id, frozenset())
            return
        self.stats.add(stores_dropped=n)
        if not self._dropped_stores_logged:
            self._dropped_stores_logged = True
            log.warning(
                "umbp-redis: a sync load failed, so the %d blocks this step computed are "
                "not stored (they may depend on the blocks that did not load); vLLM "
                "computes them again (logged once)",
                n,
            )
        for b in batches:
            pairs = zip(b.block_hashes, b.group_ids, strict=True)
            keys = frozenset(self.codec.key(h, g) for h, g in pairs)
            self._report_store(b.event_id, keys)

    def _submit_stores(self, batches: list[BlockStoreBatch]) -> None:
        if not batches or self.copier is None or self.staging is None:
            for b in batches:
                self._report_store(b.event_id, frozenset())
            return
        for batch in batches:
            try:
                self._submit_store(batch)
            except Exception as e:  # a bug drops this store, never the engine's step
                log.error("umbp-redis: store of %s failed: %r", batch.request_id, e)
                self.stats.add(store_failures=len(batch))
                self._report_store(batch.event_id, frozenset())
        self._report_finished_gathers()

    def _submit_store(self, batch: BlockStoreBatch) -> None:
        """Gather one batch into staging and queue its Redis writes (or report it dropped)."""
        assert self.copier is not None and self.staging is not None
        plans = [self._plan(p, batch.request_id) for p in batch if self.codec.stores(p.group_id)]
        if not plans or not self.can_store:
            self._report_store(batch.event_id, frozenset())
            return
        keys = frozenset(p.key for p in plans)
        slots = self.staging.acquire(len(plans))
        if slots is None:
            self.stats.add(stores_dropped=len(plans))
            log.debug("staging full: dropped %d block stores", len(plans))
            self._report_store(batch.event_id, keys)
            return
        t0 = time.thread_time()
        try:
            gathered = self.copier.gather(_copy_plan(plans, slots))
        except Exception as e:  # a copy bug drops the store, never the engine
            log.error("umbp-redis: gather of %d blocks failed: %r", len(plans), e)
            self.staging.release(slots)
            self.stats.add(store_failures=len(plans))
            self._report_store(batch.event_id, keys)
            return
        # The scheduler unpins the source blocks once the event is reported: only
        # after the gather has read them.
        self._unreported_gathers.append((batch.event_id, keys, gathered))
        gather_cpu_s = time.thread_time() - t0
        self._track(self._stores.submit(self._write, plans, slots, gathered, gather_cpu_s))

    def _report_finished_gathers(self) -> None:
        """Report the store events whose gathers are done, without blocking.

        A gather that failed is reported with its keys failed (the store thread logs
        and counts it). Runs on the engine's thread only.
        """
        pending = []
        for event_id, keys, handle in self._unreported_gathers:
            try:
                if not handle.done():
                    pending.append((event_id, keys, handle))
                    continue
                failed: frozenset[str] = frozenset()
            except Exception:
                failed = keys
            self._report_store(event_id, failed)
        self._unreported_gathers = pending

    def _report_store(self, event_id: int, failed: frozenset[str]) -> None:
        with self._lock:
            prev = self._store_reports.get(event_id)
            res = StoreEventResult(event_id, 1, failed)
            self._store_reports[event_id] = prev.merge(res) if prev else res

    def _write(
        self,
        plans: list[BlockTransferPlan],
        slots: list[int],
        gathered: CopyHandle,
        gather_cpu_s: float = 0.0,
    ) -> None:
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
            for fp, idx in _by_fingerprint(plans).items():
                items = [
                    (plans[i].key, self.staging.array(slots[i])[: plans[i].object_size])
                    for i in idx
                ]
                res = self.plane.store(items, fp, parts=self._part_lengths.get(fp))
                if self._recent_failed:
                    self._note_repaired(
                        [
                            plans[i].block_hash
                            for i, s in zip(idx, res, strict=True)
                            if s is StoreStatus.STORED
                        ]
                    )
                ok = [
                    plans[i].object_size
                    for i, s in zip(idx, res, strict=True)
                    if s is StoreStatus.STORED
                ]
                self.stats.add(
                    blocks_stored=len(ok),
                    bytes_stored=sum(ok),
                    store_failures=sum(s in (StoreStatus.ERROR, StoreStatus.OOM) for s in res),
                )
        finally:
            self.staging.release(slots)
            self.stats.add(stores=1, store_ms_total=(time.perf_counter() - t0) * 1e3)
            self.stats.observe("store_cpu_s", gather_cpu_s + time.thread_time() - cpu0)

    # -- loads ------------------------------------------------------------------------

    def _run_load(
        self,
        batch: BlockLoadBatch,
        report: bool,
        after: object | None,
        gate: LayerGate | None = None,
    ) -> None:
        t0 = time.perf_counter()
        # A sync load (not reported: the engine's step waits for it) ends in time.
        deadline = None if report else time.monotonic() + self.sync_load_timeout_s
        if gate is not None:
            deadline = gate.deadline
        failed: set[int] = set()
        slots: list[int] | None = None
        scatters: ScatterAsLoaded | None = None
        try:
            plans = [self._plan(p, batch.request_id) for p in batch]
            staging, copier = self.staging, self.copier
            # Host KV caches take the values straight into the destination blocks (no
            # staging, no scatter); a block whose value fails validation is reported
            # failed and recomputed before vLLM reads it.
            targets: list[Any] | None = self._receive_views(plans)
            if targets is None and staging is not None:
                slots = staging.acquire(len(plans))
                if slots is not None:
                    targets = [
                        staging.array(slot)[: p.object_size]
                        for slot, p in zip(slots, plans, strict=True)
                    ]
            if targets is None or copier is None:
                failed = {p.block_id for p in plans}
                return
            early: ScatterAsLoaded | None = None  # copies started as windows arrive
            if slots is not None:
                # Through staging: copies of valid values; with an asynchronous copier
                # each window's start as soon as it is received (see scatter_as_loaded).
                staged = slots
                scatters = ScatterAsLoaded(
                    copier,
                    lambda ii: _copy_plan([plans[i] for i in ii], [staged[i] for i in ii]),
                    after,
                    lambda: self._is_cancelled(batch.request_id),
                )
                overlap = self.scatter_as_loaded
                if overlap is None:
                    overlap = after is not None  # engine_point is None: synchronous copies
                early = scatters if overlap else None
            statuses: list[LoadStatus] = [LoadStatus.ERROR] * len(plans)
            for fp, idx in _by_fingerprint(plans).items():
                items = [(plans[i].key, targets[i]) for i in idx]
                res = self.plane.load(
                    items,
                    fp,
                    deadline=deadline,
                    on_loaded=_positions(early, idx),
                    parts=self._part_lengths.get(fp),
                    # Straight into the blocks: each part is usable once in (by layer).
                    on_part=_arrivals(gate, plans[idx[0]].group_id) if slots is None else None,
                )
                for i, s in zip(idx, res, strict=True):
                    statuses[i] = s
            copy_failed: set[int] = set()
            if scatters is not None:
                # Every valid block is copied (a plane that reported none is caught up
                # here) and all copies are done before the request is reported. A failed
                # copy fails its block (recomputed) without blaming the value.
                scatters.launch([i for i, st in enumerate(statuses) if st is LoadStatus.LOADED])
                scatters.wait()
                copy_failed = scatters.failed
            if gate is not None:  # every byte is in: the forward pass may read all layers
                gate.open_all()
            if self._is_cancelled(batch.request_id):
                return
            invalid = [
                p.key for p, st in zip(plans, statuses, strict=True) if st is LoadStatus.INVALID
            ]
            removed = 0
            if invalid:
                # A damaged or foreign object would fail every engine until its TTL runs
                # out; remove it so the next store replaces it.
                log.warning("umbp-redis: %d invalid objects removed (recomputing)", len(invalid))
                # A sync load's step waits for this too: same deadline.
                removed = self.plane.delete(invalid, deadline=deadline)
                if removed:
                    gone = [
                        p.block_hash
                        for p, st in zip(plans, statuses, strict=True)
                        if st is LoadStatus.INVALID
                    ]
                    with self._lock:
                        _remember(self._removed, gone)
            # Blocks that would fail again: error replies (the value stays), and invalid
            # values that could not be removed. A removed one is a miss until stored again.
            stuck = (
                (LoadStatus.ERROR,)
                if removed == len(invalid)
                else (LoadStatus.ERROR, LoadStatus.INVALID)
            )
            bad = [p.block_hash for p, st in zip(plans, statuses, strict=True) if st in stuck]
            if bad:
                with self._lock:
                    self._failed_requests[batch.request_id] = None
                    _remember(self._failed_loads, bad)
                    _remember(self._recent_failed, bad)
            loaded = [
                i
                for i, st in enumerate(statuses)
                if st is LoadStatus.LOADED and i not in copy_failed
            ]
            done = set(loaded)
            failed = {p.block_id for i, p in enumerate(plans) if i not in done}
            nbytes = sum(plans[i].object_size for i in loaded)
            self.stats.add(blocks_loaded=len(loaded), bytes_loaded=nbytes)
        except Exception as e:  # never let a transfer bug reach the engine: recompute instead
            log.error("umbp-redis load of %s failed: %r", batch.request_id, e)
            failed = set(batch.block_ids)
        finally:
            if scatters is not None:
                scatters.wait()  # no copy may still read a slot that is handed back
            if gate is not None:
                gate.open_all()
            if slots is not None and self.staging is not None:
                self.staging.release(slots)
            self.stats.add(
                loads=1,
                sync_loads=0 if report else 1,
                load_failures=len(failed),
                load_ms_total=(time.perf_counter() - t0) * 1e3,
            )
            with self._lock:
                self._note_load_failure(batch.request_id, failed, sync=not report)
                if report:
                    self._finished_loads.add(batch.request_id)
                left = self._loading.get(batch.request_id, 1) - 1
                if left > 0:
                    self._loading[batch.request_id] = left
                else:
                    self._loading.pop(batch.request_id, None)
                    self._cancelled.discard(batch.request_id)
                if not self._loading and self._switch_held:
                    self._switch_held = False
                    LOAD_SWITCH_INTERVAL.release()

    def _is_cancelled(self, request_id: str) -> bool:
        """Whether the scheduler cancelled ``request_id``'s loads (preempted)."""
        with self._lock:
            return request_id in self._cancelled

    def _receive_views(self, plans: list[BlockTransferPlan]) -> list[list[memoryview]] | None:
        """Each block's engine memory to receive its value into, or None where the
        copier needs staging (device memory) for any of them."""
        views_of = getattr(self.copier, "receive_views", None)
        if views_of is None or not self.direct_loads:
            return None
        out = []
        for p in plans:
            views = views_of(p.group_id, p.block_id)
            if views is None or sum(v.nbytes for v in views) != p.object_size:
                return None
            out.append(views)
        return out

    def _fail_load(self, batch: BlockLoadBatch, report: bool) -> None:
        """Report every block of ``batch`` as not loaded (vLLM recomputes them)."""
        self.stats.add(loads=1, sync_loads=0 if report else 1, load_failures=len(batch.block_ids))
        with self._lock:
            self._note_load_failure(batch.request_id, set(batch.block_ids), sync=not report)
            if report:
                self._finished_loads.add(batch.request_id)

    def _note_load_failure(self, request_id: str, block_ids: set[int], *, sync: bool) -> None:
        """Remember blocks that did not load, for the next report (lock held): as block
        ids, or as a failed request where vLLM cannot take block ids (several groups);
        a failed sync load also for the scheduler (``sync_failed_requests``)."""
        if not block_ids:
            return
        if sync:
            self._sync_failed[request_id] = None
            self._step_sync_failed = True
        if self.fails_per_request:
            self._failed_recving.add(request_id)
        else:
            self._load_errors |= block_ids

    # -- reports ----------------------------------------------------------------------

    def take_finished_loads(self) -> tuple[set[str], set[str]]:
        """Requests whose async loads are terminal since the last call, and those of
        them whose load failed (only with several cache groups: with one, the failed
        blocks are reported by ``get_block_ids_with_load_errors``), taken together."""
        with self._lock:
            done, self._finished_loads = self._finished_loads, set()
            failed, self._failed_recving = self._failed_recving & done, self._failed_recving - done
        return done, failed

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Destination blocks that did not load since the last call."""
        with self._lock:
            errs, self._load_errors = self._load_errors, set()
        return errs

    def take_stats(self) -> dict[str, float]:
        """Counters since the last call, with the data plane's refused logins/commands,
        unexpected errors (bugs, malformed replies) and cluster events since then."""
        try:
            counters = self.plane.counters() if hasattr(self.plane, "counters") else {}
        except Exception as e:  # a bug here must not reach vLLM's step
            log.error("umbp-redis: cannot read the data plane's counters: %r", e)
            counters = {}
        node_counters = getattr(self.plane, "node_counters", None)
        try:
            per_node = node_counters() if node_counters is not None else {}
        except Exception:
            per_node = {}
        totals = {name: int(counters.get(name, 0)) for name in CARRIED_COUNTERS}
        totals.update({f"{NODE_FAILURES_PREFIX}{node}": n for node, n in per_node.items()})
        for name, now in totals.items():  # the data plane's totals as this interval's deltas
            delta = now - self._seen_counters.get(name, 0)
            self._seen_counters[name] = now
            if delta > 0:
                self.stats.add(**{name: delta})
        return self.stats.take()

    def _note_repaired(self, stored: list[bytes]) -> None:
        """Blocks whose load had failed and that are now stored again (valid): the
        scheduler may offer them as hits again."""
        with self._lock:
            for h in stored:
                if h in self._recent_failed:
                    del self._recent_failed[h]
                    self._repaired[h] = None

    def build_worker_meta(self) -> UMBPConnectorWorkerMetadata | None:
        """The store-event reports, the block hashes whose load failed and those stored
        again after a failed load, since the last call (gathers found done now included)."""
        self._report_finished_gathers()
        with self._lock:
            reports, self._store_reports = self._store_reports, {}
            failed, self._failed_loads = tuple(self._failed_loads), {}
            repaired, self._repaired = tuple(self._repaired), {}
            requests, self._failed_requests = tuple(self._failed_requests), {}
            removed, self._removed = tuple(self._removed), {}
            sync_failed, self._sync_failed = tuple(self._sync_failed), {}
        off, self._layer_loads_turned_off = self._layer_loads_turned_off, False
        if not (reports or failed or repaired or requests or removed or sync_failed or off):
            return None
        return UMBPConnectorWorkerMetadata(
            reports, failed, repaired, requests, removed, sync_failed, off
        )

    def idle(self) -> bool:
        """No transfer in flight."""
        with self._lock:
            return not self._futures

    def shutdown(self) -> None:
        """Wait up to ``shutdown_timeout_s`` for in-flight transfers, then stop."""
        with self._lock:
            futs = list(self._futures)
        if futs:
            wait(futs, timeout=self.options.shutdown_timeout_s)
        self._loads.shutdown(wait=False, cancel_futures=True)
        self._layer_loads.shutdown(wait=False, cancel_futures=True)
        self._stores.shutdown(wait=False, cancel_futures=True)
