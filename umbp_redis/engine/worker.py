"""Worker half of the connector: vLLM's worker-side hooks, the step's order of work.

Stores (``block_storer``): the step's store batches are gathered into staging slots right
after the forward pass and written to Redis on a transfer thread; each batch's store
event is reported in the first step whose ``build_worker_meta`` finds its gather done,
so the scheduler keeps the source blocks pinned exactly as long as the copy reads them.
Loads (``block_loader``): async loads run on a transfer thread, sync ones before the
forward pass or alongside it by layer (``layer_gate``); a request is reported finished
when every block is terminal and its copies are done, and blocks that did not load are
reported so vLLM recomputes them. What the worker owes vLLM and the scheduler is kept in
one ledger (``worker_ledger``) until taken.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from umbp_redis.data import (
    BlockIdentityCodec,
    BlockLoadBatch,
    BlockTransferPlan,
    KVLayoutPlanner,
    RankTopology,
    UMBPConnectorMetadata,
    UMBPConnectorWorkerMetadata,
    UMBPHandshakeMetadata,
    UMBPNamespace,
    block_failures_reportable,
    tp_replicated_group_ids,
)
from umbp_redis.engine.block_loader import BlockLoader
from umbp_redis.engine.block_storer import BlockStorer
from umbp_redis.engine.copy.factory import make_block_copier
from umbp_redis.engine.copy.interface import BlockCopier
from umbp_redis.engine.layer_gate import LayerGate
from umbp_redis.engine.layer_loads import LayerLoads
from umbp_redis.engine.options import EngineOptions
from umbp_redis.engine.staging import StagingPool, staging_budget
from umbp_redis.engine.stats import COUNTERS, NODE_FAILURES_PREFIX, STORE_COUNTERS, StatsRecorder
from umbp_redis.engine.switch_interval import LOAD_SWITCH_INTERVAL, LOAD_SWITCH_INTERVAL_MS
from umbp_redis.engine.weights import weights_fingerprint
from umbp_redis.engine.worker_ledger import WorkerLedger
from umbp_redis.store.deployment import DataPlane, shared_plane
from umbp_redis.store.errors import ConfigError
from umbp_redis.store.settings import RedisSettings
from umbp_redis.store.thread_affinity import thread_pinner

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger(__name__)
T = TypeVar("T")

# How long shutdown waits for transfers in flight (each is bounded by op_timeout_s).
SHUTDOWN_TIMEOUT_S = 5.0


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


class WorkerStats(StatsRecorder):
    """Counters the worker reports through ``KVConnectorStats`` (reset on each report)."""

    FIELDS = tuple(c.name for c in COUNTERS if c.side in ("worker", "store"))


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
            weights = weights_fingerprint(
                vllm_config.model_config,
                options.weights_fingerprint,
                str(vllm_config.load_config.load_format),
            )
        self.namespace = UMBPNamespace.resolve(vllm_config, kv_cache_config, weights)
        self.codec = BlockIdentityCodec(
            self.namespace.value,
            self.topology,
            tp_replicated_group_ids(kv_cache_config, self.topology),
        )
        self.planner = KVLayoutPlanner(kv_cache_config)
        self._plane: DataPlane = plane or shared_plane(settings)
        self.stats = WorkerStats()
        # Failed loads as block ids where vLLM takes them, else as failed requests.
        self.fails_per_request = not block_failures_reportable(kv_cache_config)
        self.ledger = WorkerLedger(self.fails_per_request)
        # Free to leave the forward pass's cores where vLLM binds them (transfer_cpus).
        pin = thread_pinner(settings.transfer_cpus)
        self._loads = ThreadPoolExecutor(1, thread_name_prefix="umbp-load", initializer=pin)
        self._stores = ThreadPoolExecutor(1, thread_name_prefix="umbp-store", initializer=pin)
        # Sync loads run alongside the forward pass, a part of every block at a time.
        self.sync_load_timeout_s = options.sync_load_timeout_s
        self.layer_loads = LayerLoads(self.sync_load_timeout_s)
        self._layer_threads = ThreadPoolExecutor(
            4, thread_name_prefix="umbp-layers", initializer=pin
        )
        # Some group's objects are in parts and received straight into the KV cache.
        self._receives_in_parts = False
        self._lock = threading.Lock()
        # A sync load of this step failed: the forward pass computed over blocks that did
        # not load, so this step's stores would write KV computed from them.
        self._step_sync_failed = False
        # Seconds this step's forward pass has waited for its sync loads so far.
        self._step_sync_wait_s = 0.0
        self._cancelled: set[str] = set()
        self._loading: dict[str, int] = {}  # request id -> loads in flight
        self._switch_held = False  # this worker holds LOAD_SWITCH_INTERVAL (loads in flight)
        self._futures: set[Any] = set()
        self.meta: UMBPConnectorMetadata | None = None
        self._stores_submitted = False
        self.bases: dict[str, int] = {}
        self._copier: BlockCopier | None = None
        self.loader = BlockLoader(self.plane, self.stats, self.ledger, self._is_cancelled)
        self.storer = BlockStorer(
            self.plane,
            self.codec,
            self.stats,
            self.ledger,
            self._plan,
            lambda *args: self._track(self._stores.submit(*args)),
            can_store=self.can_store,
        )
        self.load_switch_interval_ms = LOAD_SWITCH_INTERVAL_MS
        self.staging: StagingPool | None = None
        log.info(
            "umbp-redis worker %s: key namespace %s (%s)",
            self.topology.rank_label(),
            self.namespace.value,
            "derived" if self.namespace.derived else "configured",
        )

    # -- setup ------------------------------------------------------------------------

    @property
    def plane(self) -> DataPlane:
        """The data plane every transfer of this worker goes through."""
        return self._plane

    @plane.setter
    def plane(self, plane: DataPlane) -> None:
        self._plane = self.loader.plane = self.storer.plane = plane

    @property
    def copier(self) -> BlockCopier | None:
        """How blocks move between the KV cache and staging (set by
        ``register_kv_caches``); the loader and the storer use the same one."""
        return self._copier

    @copier.setter
    def copier(self, copier: BlockCopier | None) -> None:
        self._copier = self.loader.copier = self.storer.copier = copier

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
        self.staging = self.loader.staging = self.storer.staging = StagingPool(
            slot, budget, pin_memory=pin
        )
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
            lengths = self.loader.part_lengths[lay.fingerprint] = lay.part_lengths()
            self.storer.part_lengths[lay.fingerprint] = lengths
            self.layer_loads.part_count[gid] = len(lengths)
            for layer, part in lay.layer_parts().items():
                self.layer_loads.layer_part[layer] = (gid, part)
            if len(lengths) > 1 and views_of is not None:
                views = views_of(gid, 0)
                self._receives_in_parts |= (
                    views is not None and sum(v.nbytes for v in views) == lay.object_size
                )
            log.info(
                "umbp-redis: group %d object %d bytes, %d regions, %d parts, layout %s",
                gid,
                lay.object_size,
                len(lay.regions),
                len(lengths),
                lay.fingerprint_hex,
            )

    def handshake_metadata(self) -> UMBPHandshakeMetadata:
        """What the scheduler needs from this worker."""
        return UMBPHandshakeMetadata(
            namespace=self.namespace.value,
            topology=self.topology,
            loads_by_layer=self.sync_loads_by_layer(),
        )

    @property
    def load_by_layer(self) -> bool:
        """Whether sync loads may run by layer (off once a forward pass skipped a wait)."""
        return self.layer_loads.enabled

    @load_by_layer.setter
    def load_by_layer(self, on: bool) -> None:
        self.layer_loads.enabled = on

    def sync_loads_by_layer(self) -> bool:
        """Whether this worker's sync loads run by layer: ``load_by_layer`` is on, loads
        receive straight into the KV cache (host memory) and objects are in parts."""
        return (
            self.load_by_layer
            and not self.fails_per_request
            and self.loader.direct_loads
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
            elif self.sync_loads_by_layer() and self.layer_loads.in_parts(batch):
                # The forward pass waits for each layer's part (wait_for_layer_load) and
                # the step's end for the whole load (wait_for_save).
                def run_by_layer(gate: LayerGate, b: BlockLoadBatch = batch) -> Future[None]:
                    return self._track(
                        self._layer_threads.submit(self._run_load, b, False, after, gate)
                    )

                self.layer_loads.start(batch, run_by_layer)
            else:  # vLLM runs the forward pass once this returns
                t0 = time.perf_counter()
                self._run_load(batch, False, after)
                self._step_sync_wait_s += time.perf_counter() - t0

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Before ``layer_name``'s attention: wait until this step's loads by layer have
        its part of every block, at most until their deadline (``sync_load_timeout_s``;
        blocks not loaded by then are reported failed at the step's end)."""
        waited = self.layer_loads.wait(layer_name)
        if waited:
            self._step_sync_wait_s += waited
            self.stats.add(layer_wait_ms=waited * 1e3)

    def wait_for_save(self) -> None:
        """Submit this step's stores (once per step); drop them all where a sync load of
        the step failed (see ``BlockStorer.drop``)."""
        if self.meta is not None and not self._stores_submitted:
            self._stores_submitted = True
            self._step_sync_wait_s += self.layer_loads.join(
                lambda rid, ids: self._load_failed(rid, ids, sync=True)
            )
            self._account_sync_wait(self.meta)
            with self._lock:
                tainted = self._step_sync_failed
            if tainted:
                self.storer.drop(self.meta.stores)
            else:
                self.storer.submit(self.meta.stores)

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

    def _track(self, fut: Future[T]) -> Future[T]:
        """Keep ``fut`` among the transfers in flight until it is done; returns it."""
        with self._lock:
            self._futures.add(fut)
        fut.add_done_callback(self._untrack)
        return fut

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

    # -- loads ------------------------------------------------------------------------

    def _run_load(
        self,
        batch: BlockLoadBatch,
        report: bool,
        after: object | None,
        gate: LayerGate | None = None,
    ) -> None:
        """Run one load (``report``: async, reported finished when done; else sync, by
        ``sync_load_timeout_s`` or the gate's deadline) and account for it."""
        t0 = time.perf_counter()
        deadline = None if report else time.monotonic() + self.sync_load_timeout_s
        if gate is not None:
            deadline = gate.deadline
        plans: list[BlockTransferPlan] = []
        try:
            plans = [self._plan(p, batch.request_id) for p in batch]
            failed = self.loader.load(batch, plans, deadline, after, gate)
        except Exception as e:  # never let a transfer bug reach the engine: recompute instead
            log.error("umbp-redis load of %s failed: %r", batch.request_id, e)
            failed = set(batch.block_ids)
            if gate is not None:
                gate.open_all()
        seconds = time.perf_counter() - t0
        self.stats.add(
            loads=1,
            sync_loads=0 if report else 1,
            load_failures=len(failed),
            load_ms_total=seconds * 1e3,
        )
        self.stats.observe("load_s", seconds)
        self._note_load_time(plans, failed, seconds)
        self._load_failed(batch.request_id, failed, sync=not report)
        if report:
            self.ledger.load_finished(batch.request_id)
        with self._lock:
            left = self._loading.get(batch.request_id, 1) - 1
            if left > 0:
                self._loading[batch.request_id] = left
            else:
                self._loading.pop(batch.request_id, None)
                self._cancelled.discard(batch.request_id)
            if not self._loading and self._switch_held:
                self._switch_held = False
                LOAD_SWITCH_INTERVAL.release()

    def _note_load_time(
        self, plans: list[BlockTransferPlan], failed: set[int], seconds: float
    ) -> None:
        """Tell the scheduler what a load cost (its load-or-compute choice): the bytes and
        seconds of a load that completed, or of one that ran out of time (it would have
        taken at least that long). A load that failed otherwise (a value missing or bad)
        says nothing about the link."""
        if plans and (not failed or seconds >= self.sync_load_timeout_s):
            self.ledger.load_timed(sum(p.object_size for p in plans), seconds, not failed)

    def _is_cancelled(self, request_id: str) -> bool:
        """Whether the scheduler cancelled ``request_id``'s loads (preempted)."""
        with self._lock:
            return request_id in self._cancelled

    def _fail_load(self, batch: BlockLoadBatch, report: bool) -> None:
        """Report every block of ``batch`` as not loaded (vLLM recomputes them)."""
        self.stats.add(loads=1, sync_loads=0 if report else 1, load_failures=len(batch.block_ids))
        self._load_failed(batch.request_id, batch.block_ids, sync=not report)
        if report:
            self.ledger.load_finished(batch.request_id)

    def _load_failed(self, request_id: str, block_ids: Iterable[int], *, sync: bool) -> None:
        """Owe vLLM the blocks that did not load; a failed sync load also taints this
        step's stores (see ``wait_for_save``)."""
        block_ids = set(block_ids)
        if not block_ids:
            return
        self.ledger.load_failed(request_id, block_ids, sync=sync)
        if sync:
            with self._lock:
                self._step_sync_failed = True

    # -- reports ----------------------------------------------------------------------

    def take_finished_loads(self) -> tuple[set[str], set[str]]:
        """Requests whose async loads are terminal since the last call, and those of
        them whose load failed (only with several cache groups: with one, the failed
        blocks are reported by ``get_block_ids_with_load_errors``), taken together."""
        return self.ledger.take_finished_loads()

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Destination blocks that did not load since the last call."""
        return self.ledger.take_load_errors()

    def take_stats(self) -> dict[str, float]:
        """Counters since the last call, with the data plane's refused logins/commands,
        unexpected errors (bugs, malformed replies) and cluster events since then."""
        try:
            counters, per_node = self.plane.counters(), self.plane.node_counters()
        except Exception as e:  # a bug here must not reach vLLM's step
            log.error("umbp-redis: cannot read the data plane's counters: %r", e)
            counters, per_node = {}, {}
        totals = {name: int(counters.get(name, 0)) for name in STORE_COUNTERS}
        totals.update({f"{NODE_FAILURES_PREFIX}{node}": n for node, n in per_node.items()})
        self.stats.add_totals(totals)  # the data plane's totals as this interval's deltas
        return self.stats.take()

    def build_worker_meta(self) -> UMBPConnectorWorkerMetadata | None:
        """The store-event reports, the block hashes whose load failed and those stored
        again after a failed load, since the last call (gathers found done now included)."""
        self.storer.report_finished_gathers()
        return self.ledger.drain(self.layer_loads.take_turned_off())

    def idle(self) -> bool:
        """No transfer in flight."""
        with self._lock:
            return not self._futures

    def shutdown(self) -> None:
        """Wait up to ``SHUTDOWN_TIMEOUT_S`` for in-flight transfers, then stop."""
        with self._lock:
            futs = list(self._futures)
        if futs:
            wait(futs, timeout=SHUTDOWN_TIMEOUT_S)
        self._loads.shutdown(wait=False, cancel_futures=True)
        self._layer_threads.shutdown(wait=False, cancel_futures=True)
        self._stores.shutdown(wait=False, cancel_futures=True)
