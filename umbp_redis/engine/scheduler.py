"""Scheduler half of the connector: vLLM's scheduler-side hooks, dispatched to the jobs.

Runs in the engine's scheduler process. It never blocks on Redis for longer than
``lookup_timeout_s``, treats every Redis problem as a miss, and never raises into
vLLM's step: a bug in a hook is logged, counted and turned into a miss or a dropped
store (``hook_guard``).

The jobs, each in its own module: prefix lookups (``lookups``, with the load-failure
``quarantine``), whether a hit loads async (``load_policy``), store planning
(``store_planner``, and ``lazy_store`` in lazy mode), the pins that keep transfer
blocks allocated (``pins``) and KV cache events for routers (``kv_events``). This class
keeps each request's state (``request_state``) and the order of a step's work.
"""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from typing import TYPE_CHECKING, Any

from umbp_redis.data import (
    BlockIdentityCodec,
    CacheGroupPlans,
    RankTopology,
    RequestTracker,
    UMBPConnectorMetadata,
    UMBPConnectorWorkerMetadata,
    UMBPHandshakeMetadata,
    UMBPNamespace,
    UnsupportedCacheGroup,
    block_failures_reportable,
    tp_replicated_group_ids,
)
from umbp_redis.engine.block_markers import StoredMarkers
from umbp_redis.engine.fleet_blocks import FleetBlockFeed
from umbp_redis.engine.handshake import agreed_namespace
from umbp_redis.engine.hook_guard import check_engine_config, guarded_hook
from umbp_redis.engine.kv_events import StoredBlockEvents, group_spec_infos
from umbp_redis.engine.lazy_store import LazyStorePlanner
from umbp_redis.engine.load_benefit import LoadBenefit
from umbp_redis.engine.load_planner import LoadPlanner
from umbp_redis.engine.load_policy import LoadPolicy
from umbp_redis.engine.lookups import PrefixLookup
from umbp_redis.engine.namespace_advert import NamespaceAdvert
from umbp_redis.engine.options import EngineOptions
from umbp_redis.engine.pins import BlockPins
from umbp_redis.engine.quarantine import LoadQuarantine
from umbp_redis.engine.request_state import BlockHashing, RequestState
from umbp_redis.engine.stats import StatsRecorder
from umbp_redis.engine.store_planner import StorePlanner
from umbp_redis.store.deployment import DataPlane, shared_plane
from umbp_redis.store.errors import ConfigError
from umbp_redis.store.settings import RedisSettings

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

# How long a step with nothing to compute but loads in flight waits before it hands
# the step back: vLLM's engine loop would otherwise spin and take the CPU and the GIL
# from the transfers (measured: docs/performance.md, warm loads).
IDLE_WAIT_S = 0.001

# How long shutdown waits for the stored markers of reported stores to be written.
MARKER_FLUSH_S = 2.0

# The request statuses vLLM sets while applying a step's output (a stop condition met).
_STOPPED_BY_OUTPUT = frozenset(
    {"FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED", "FINISHED_REPETITION"}
)


def _stopped_by_output(request: Request) -> bool:
    """Whether vLLM ended ``request`` while applying a step's output (so it applied the
    outcome of every load of that step first)."""
    return request.status.name in _STOPPED_BY_OUTPUT


class UMBPScheduler:
    """Decides what each step loads and stores; see the connector for the vLLM hooks."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        kv_cache_config: KVCacheConfig,
        settings: RedisSettings,
        options: EngineOptions,
        *,
        plane: DataPlane | None = None,
    ) -> None:
        self.errors = 0  # hook failures turned into misses (see guarded_hook)
        self.stats = StatsRecorder()  # the per-step account (lookups, hook time)
        self._hooks_s = 0.0  # seconds in guarded hooks since the last step's metadata
        self._logged_errors: set[str] = set()
        check_engine_config(vllm_config)
        ktc = vllm_config.kv_transfer_config
        role = ktc.kv_role if ktc else "kv_both"
        self.can_load = role in ("kv_consumer", "kv_both")
        self.can_store = role in ("kv_producer", "kv_both")
        # Blocks are admitted to Redis by request counts that lookups keep.
        self.store_after_requests = options.store_after_requests
        if self.store_after_requests > 1 and role == "kv_producer":
            raise ConfigError(
                "kv_connector_extra_config['store_after_requests'] above 1 counts requests "
                "in lookups, which a kv_producer does not make: use kv_role kv_both"
            )
        self.topology = RankTopology.from_vllm_config(vllm_config)
        groups = kv_cache_config.kv_cache_groups
        self.groups = [gid for gid, g in enumerate(groups) if g.enable_kv_transfer]
        block_size = int(groups[self.groups[0]].kv_cache_spec.block_size)
        self.block_size = block_size
        self.hashing = BlockHashing(block_size, int(kv_cache_config.hash_block_size or block_size))
        try:
            self.group_plans = CacheGroupPlans.from_kv_cache_config(kv_cache_config, self.groups)
        except UnsupportedCacheGroup as e:
            log.error("umbp-redis: %s; this engine neither looks up nor stores blocks", e)
            self.group_plans = CacheGroupPlans(())
            self.can_load = self.can_store = False
        # A failed sync load can only be reported as block ids: see
        # block_failures_reportable (models with several cache groups load async).
        self.load_policy = LoadPolicy(
            mode=options.load_async,
            sync_load_max_bytes=options.sync_load_max_bytes,
            bytes_per_block=sum(
                int(groups[g].kv_cache_spec.page_size_bytes) * len(groups[g].layer_names)
                for g in self.groups
            ),
            sync_loads_possible=block_failures_reportable(kv_cache_config),
            sync_load_timeout_s=options.sync_load_timeout_s,
        )
        if options.load_async is False and not self.load_policy.sync_loads_possible:
            log.warning(
                "umbp-redis: load_async=false is ignored: this model has %d KV cache groups "
                "and vLLM can recompute a failed load of such a model only if it was async",
                len(groups),
            )
        # Hits load only where that beats computing them (decline_slow_loads).
        self.benefit = LoadBenefit(
            self.load_policy.bytes_per_block, enabled=options.decline_slow_loads
        )
        self.idle_wait_s = IDLE_WAIT_S
        self.idle_waits = 0  # idle steps that waited for loads in flight
        self.replicated = tp_replicated_group_ids(kv_cache_config, self.topology)
        configured = UMBPNamespace.configured(vllm_config)
        self.codec: BlockIdentityCodec | None = (
            BlockIdentityCodec(configured.value, self.topology, self.replicated)
            if configured
            else None
        )
        self.plane: DataPlane = plane or shared_plane(settings)
        self.plane.warm_up()  # the lookup connection is made now, off the scheduler thread
        self.quarantine = LoadQuarantine(options.load_failure_quarantine_s)
        self.num_workers = self.topology.num_rank_namespaces
        self.markers = StoredMarkers(
            self.plane,
            self.num_workers,
            ttl_s=settings.ttl_seconds,
            refresh_ttl=settings.refresh_ttl_on_lookup,
            timeout_s=settings.op_timeout_s,
        )
        self.lookups = PrefixLookup(
            self.plane,
            self.groups,
            self.group_plans,
            self.hashing,
            self.quarantine,
            self.stats,
            refresh_ttl=settings.refresh_ttl_on_lookup,
            lookup_async=options.lookup_async,
            admit_after=self.store_after_requests,
            on_found=self.markers.note_found,
        )
        self.pins = BlockPins(self.num_workers)
        # The namespace record prefix lookups outside the engine read.
        self.advert = NamespaceAdvert(
            vllm_config,
            block_size,
            self.hashing.hash_block_size,
            self.group_plans,
            settings.ttl_seconds,
        )
        # KV cache events (only with vLLM's --kv-events-config).
        events_cfg = vllm_config.kv_events_config
        self.events: StoredBlockEvents | None = None
        # The fleet's blocks on this engine's events, once the namespace is known.
        self.fleet: FleetBlockFeed | None = None
        # (TTL, op timeout) of the feed to start with fleet_events; None: no feed.
        self._fleet_settings: tuple[int, float] | None = None
        if events_cfg and events_cfg.enable_kv_cache_events:
            specs = group_spec_infos(kv_cache_config.kv_cache_groups)
            self.events = StoredBlockEvents(block_size, self.num_workers, specs)
            if options.fleet_events:
                self._fleet_settings = (settings.ttl_seconds, settings.op_timeout_s)
            self._start_fleet_feed()
        sched_cfg = vllm_config.scheduler_config
        self.lazy = (
            LazyStorePlanner(
                self.groups,
                block_size,
                int(kv_cache_config.num_blocks),
                int(sched_cfg.max_num_batched_tokens),
                int(sched_cfg.max_num_seqs),
                with_events=self.events is not None,
            )
            if options.store_mode == "lazy"
            else None
        )
        self._event_ids = itertools.count(1)
        self.stores = StorePlanner(
            self.groups,
            self.group_plans,
            self.hashing,
            self.pins,
            self._event_ids,
            save_decode=options.save_decode_cache,
            events=self.events,
            lazy=self.lazy,
            admission=self.store_after_requests > 1,
            markers=self.markers,
        )
        t = self.topology
        # Several ranks compute each token together: one rank's failed load reaches the
        # KV every rank computes after it in that step (see _plan_step). vLLM applies a
        # step's output before it schedules the next, or (async scheduling) one later.
        shared = t.tp_size * t.pp_size * t.pcp_size * t.dcp_size > 1
        async_sched = bool(sched_cfg.async_scheduling)
        self.sync_load_store_hold = (2 if async_sched else 1) if shared else 0
        # Stores of requests that ended while held, for the next step (request_finished).
        self._ended_held_stores = UMBPConnectorMetadata()
        self.requests: dict[str, RequestState] = {}
        self.loads = LoadPlanner(
            self.group_plans, self.hashing, self.load_policy, self.pins, self._event_ids
        )

    # -- startup ----------------------------------------------------------------------

    def bind_block_pool(self, block_pool: Any) -> None:
        """Keep the engine's block pool to pin transfer blocks."""
        self.pins.bind(block_pool)

    def adopt_handshake(self, metadata: dict[Any, Any]) -> None:
        """Take the namespace the workers derived (they see the per-layer specs).

        Workers that disagree on the namespace, or report other parallel sizes than
        this scheduler's (its keys would name other ranks), disable lookups.
        """
        reports = [m for m in metadata.values() if isinstance(m, UMBPHandshakeMetadata)]
        ns = agreed_namespace(reports, self.topology)
        if ns is None:
            self.codec = None
            return
        policy = self.load_policy
        policy.workers_load_by_layer = all(m.loads_by_layer for m in reports)
        if policy.workers_load_by_layer and policy.mode == "auto":
            log.info(
                "umbp-redis: the workers load by layer: loads of at most %d bytes per worker "
                "run alongside the step's forward pass",
                policy.layer_load_max_bytes,
            )
        if self.codec is None or self.codec.namespace != ns:
            self.codec = BlockIdentityCodec(ns, self.topology, self.replicated)
            log.info("umbp-redis: using key namespace %s", ns)
            self._start_fleet_feed()

    def _start_fleet_feed(self) -> None:
        """Announce to, and relay from, the namespace's fleet (with ``fleet_events``, KV
        events and a namespace; a feed of another namespace is closed)."""
        if self._fleet_settings is None or self.codec is None or self.events is None:
            return
        if self.fleet is not None:
            if self.fleet.codec.namespace == self.codec.namespace:
                return
            self.fleet.close()
        ttl_s, timeout_s = self._fleet_settings
        self.fleet = FleetBlockFeed(
            self.plane,
            self.codec,
            uuid.uuid4().hex,
            self.block_size,
            self.events.group_specs,
            ttl_s=ttl_s,
            timeout_s=timeout_s,
        )
        self.events.feed = self.fleet
        self.fleet.start()

    # -- lookups ----------------------------------------------------------------------

    def _state(self, request: Request) -> RequestState:
        st = self.requests.get(request.request_id)
        if st is None or st.request is not request:
            st = RequestState(request, RequestTracker(request.request_id))
            self.requests[request.request_id] = st
        return st

    def _lookup_fallback(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    @guarded_hook(_lookup_fallback)
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Block-aligned prefix tokens beyond ``num_computed_tokens`` present in Redis,
        and whether they load async.

        One round trip covers blocks [0, last prompt block): the blocks the engine's
        own prefix cache holds are refreshed in Redis (not counted), the rest counted as
        the consecutive run whose every rank key exists. With ``lookup_async`` the first
        call starts the lookup and returns None; a later call with the same request
        state returns its answer (a changed request starts a new lookup).
        """
        st = self._state(request)
        st.local_tokens = num_computed_tokens
        bs = self.block_size
        admission = self.store_after_requests > 1
        if not admission:
            # Blocks in vLLM's local cache were computed (and stored) or loaded here
            # before: they are not stored again (the lookup refreshes them in Redis).
            st.known_stored_blocks = max(st.known_stored_blocks, num_computed_tokens // bs)
        if not self.can_load or self.codec is None or st.load_failed:
            return 0, False
        hit = self.lookups.hit_blocks(st, num_computed_tokens, self.codec)
        if hit is None:
            return None, False
        if admission:
            # Local blocks the rule kept out of Redis are stored once admitted.
            st.known_stored_blocks = max(st.known_stored_blocks, st.redis_prefix_blocks)
        else:
            st.known_stored_blocks = max(st.known_stored_blocks, hit)
        tokens = hit * bs - num_computed_tokens
        if tokens <= 0:
            return 0, False
        tokens = self._offered_tokens(st, tokens)
        if tokens <= 0:
            return 0, False
        blocks = tokens // bs
        probe = blocks < hit - num_computed_tokens // bs  # a probe loads async: no deadline
        expected = self.benefit.expected_load_s(blocks)
        st.load_async = probe or self.load_policy.loads_async(blocks, expected)
        return tokens, st.load_async

    def _offered_tokens(self, st: RequestState, tokens: int) -> int:
        """How many of a hit's ``tokens`` (block-aligned) to offer, as ``LoadBenefit``
        decides; a request asked about again with the same hit gets the same answer
        (counted once)."""
        asked = (st.local_tokens, tokens)
        if st.offer is not None and st.offer[0] == asked:
            return st.offer[1]
        blocks = self.benefit.blocks_to_offer(tokens // self.block_size, tokens)
        st.offer = (asked, blocks * self.block_size)
        return st.offer[1]

    def _counter_totals(self) -> dict[str, int]:
        """The scheduler's counters since startup, by their name in the stats data."""
        return {
            "unexpected_errors": self.errors,  # hook failures: connector bugs
            "quarantine_skips": self.quarantine.skips,
            "idle_waits": self.idle_waits,
            "stale_pins_released": self.pins.stale_released,
            "sync_load_uncached": self.loads.uncached_blocks,
            "lazy_blocks_stored": self.lazy.blocks_stored if self.lazy is not None else 0,
            "markers_written": self.markers.written,
            "marker_failures": self.markers.failed,
            "values_refreshed": self.markers.refreshed,
            "stale_markers_removed": self.markers.stale,
            "marker_commands_dropped": self.markers.dropped,
            "fleet_blocks_announced": self.fleet.announced if self.fleet is not None else 0,
            "fleet_blocks_relayed": self.fleet.relayed if self.fleet is not None else 0,
            "fleet_blocks_removed": self.fleet.removed if self.fleet is not None else 0,
            "fleet_feed_failures": self.fleet.failures if self.fleet is not None else 0,
            "fleet_feed_dropped": self.fleet.dropped if self.fleet is not None else 0,
            "loads_declined": self.benefit.declined,
            "tokens_declined": self.benefit.tokens_declined,
            "load_probes": self.benefit.probes,
        }

    def take_stats(self) -> dict[str, Any]:
        """The scheduler's per-step account and its counters' increments since the last
        call (and reset them)."""
        self.stats.add_totals(self._counter_totals())
        return self.stats.take()

    # -- loads ------------------------------------------------------------------------

    def _alloc_fallback(self, request: Request, blocks: Any, num_external_tokens: int) -> None:
        """vLLM was promised ``num_external_tokens``: report their blocks failed instead."""
        if num_external_tokens <= 0:
            return
        try:
            st = self.requests[request.request_id]
            self.loads.plan_failed(st, request, blocks, num_external_tokens)
        except Exception as e:
            log.error("umbp-redis: cannot report the failed load of %s: %r", request.request_id, e)

    @guarded_hook(_alloc_fallback)
    def update_state_after_alloc(
        self, request: Request, blocks: Any, num_external_tokens: int
    ) -> None:
        """Record where the hit blocks go; the load is emitted with the next metadata."""
        st = self._state(request)
        if num_external_tokens > 0:
            self.loads.plan(st, request, blocks, num_external_tokens)

    # -- per step ---------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> UMBPConnectorMetadata:
        """This step's loads, stores and cancellations; resets the pending lists.

        The loads vLLM was promised always go out; a failure while planning stores only
        drops this step's stores (logged and counted).
        """
        t0 = time.perf_counter()
        meta = UMBPConnectorMetadata()
        meta.loads = self.loads.take()
        meta.step_requests = len(scheduler_output.num_scheduled_tokens)
        step_tokens = scheduler_output.total_num_scheduled_tokens
        if (
            self.idle_wait_s > 0
            and (self.pins.loads or self.pins.stores)
            and not meta.loads
            and not step_tokens
        ):
            # Nothing to compute but transfers in flight: a spinning engine loop would
            # take the CPU and the GIL from them. IDLE_WAIT_S per such step.
            self.idle_waits += 1
            time.sleep(self.idle_wait_s)
        self.stores.start_step()
        try:
            if self.codec is not None and self.can_store:
                due = self.advert.due(self.codec.namespace)
                if due is not None:
                    self.markers.publish(self.codec, *due)
            self.pins.release_stale()
            self._plan_step(scheduler_output, meta)
        except Exception as e:
            self.errors += 1
            first = "build_connector_meta" not in self._logged_errors
            self._logged_errors.add("build_connector_meta")
            log.error(
                "umbp-redis: planning this step's stores failed (%r); they are dropped",
                e,
                exc_info=first,
            )
            for batch in meta.stores:
                self.pins.release_store(batch.event_id)
            meta.stores = []
        self.stats.observe("scheduler_step_s", self._hooks_s + time.perf_counter() - t0)
        # A step with a sync load does not time computing alone (its forward pass waits).
        sync_loads = any(not b.load_async for b in meta.loads)
        self.benefit.note_step_planned(step_tokens, not sync_loads)
        self._hooks_s = 0.0
        return meta

    def _plan_step(self, scheduler_output: SchedulerOutput, meta: UMBPConnectorMetadata) -> None:
        preempted = scheduler_output.preempted_req_ids or set()
        if preempted:
            log.info(
                "umbp-redis: %d requests preempted; their pending transfers are dropped",
                len(preempted),
            )
        for rid in preempted:
            meta.cancelled_requests.append(rid)
        if not self.can_store or self.codec is None:
            for new in scheduler_output.scheduled_new_reqs:
                self._tracker_blocks(new.req_id, new.block_ids, replace=True)
            self._update_cached(scheduler_output)
            return
        meta.stores.extend(self._ended_held_stores.stores)
        self._ended_held_stores.stores = []
        num_sched = scheduler_output.num_scheduled_tokens
        # With several ranks, a request's blocks computed in the step of its sync load
        # are stored only once vLLM has applied that step's output: a rank whose load
        # failed drops its stores of that step, but the other ranks' KV of those blocks
        # was computed from its garbage too (all-reduce, pipeline stages). By then vLLM
        # has rolled a failed request back, so only blocks that loaded right are planned.
        if self.sync_load_store_hold:
            for b in meta.loads:
                st = self.requests.get(b.request_id)
                if st is not None and not b.load_async:
                    st.store_hold = self.sync_load_store_hold + 1
        for new in scheduler_output.scheduled_new_reqs:
            st = self._tracker_blocks(new.req_id, new.block_ids, replace=True)
            if st is not None and not self._held(st):
                self.stores.plan_request(
                    st, new.num_computed_tokens, num_sched.get(new.req_id, 0), meta
                )
        cached = scheduler_output.scheduled_cached_reqs
        self._update_cached(scheduler_output)
        for i, rid in enumerate(cached.req_ids):
            st = self.requests.get(rid)
            if st is not None and not self._held(st):
                self.stores.plan_request(
                    st, cached.num_computed_tokens[i], num_sched.get(rid, 0), meta
                )
        if self.lazy is not None:
            self.lazy.plan(meta, self.pins.block_pool, self.stores.emit)

    @staticmethod
    def _held(st: RequestState) -> bool:
        """Whether a scheduled request's stores wait this step (``store_hold``)."""
        if st.store_hold <= 0:
            return False
        st.store_hold -= 1
        return st.store_hold > 0

    def _update_cached(self, scheduler_output: SchedulerOutput) -> None:
        cached = scheduler_output.scheduled_cached_reqs
        resumed = cached.resumed_req_ids
        for i, rid in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            if new_ids is None:
                continue
            self._tracker_blocks(rid, new_ids, replace=rid in resumed)

    def _tracker_blocks(self, rid: str, block_ids: Any, *, replace: bool) -> RequestState | None:
        st = self.requests.get(rid)
        if st is None:
            return None
        if replace:
            st.tracker.replace_blocks(block_ids)
        else:
            st.tracker.append_blocks(block_ids)
        return st

    # -- reports ----------------------------------------------------------------------

    def take_events(self) -> list[Any]:
        """KV cache events since the last call: BlockStored for blocks every worker stored
        in Redis, BlockRemoved for values found missing, or invalid and deleted (medium
        REDIS)."""
        return self.events.take() if self.events is not None else []

    @guarded_hook(lambda self, connector_output: None)
    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Take the workers' reports: finished loads and stores release their pins,
        failed loads are quarantined, KV events are emitted; the step's output and the
        loads' times feed the load-or-compute estimates."""
        self.benefit.note_step_output()  # vLLM reports each step's output once
        for rid in connector_output.finished_recving or ():
            self.pins.load_done(rid)
        meta = connector_output.kv_connector_worker_meta
        if not isinstance(meta, UMBPConnectorWorkerMetadata):
            return
        for nbytes, seconds, complete in meta.load_times:
            self.benefit.note_load(nbytes, seconds, complete)
        self.quarantine.add(meta.failed_loads)
        for h in meta.repaired_loads:  # stored again, valid: a hit again
            self.quarantine.release(h)
        for rid in meta.failed_requests:
            st = self.requests.get(rid)
            if st is not None:
                st.load_failed = True
        for rid in meta.sync_failed_requests:
            if (st := self.requests.get(rid)) is not None:
                self.loads.uncache_failed_sync_load(st, self.groups)
        if meta.layer_loads_off and self.load_policy.workers_load_by_layer:
            self.load_policy.workers_load_by_layer = False  # large hits load async again
            log.warning(
                "umbp-redis: a worker turned loads by layer off; loads over "
                "sync_load_max_bytes run async again"
            )
        if self.events is not None:
            for eid, res in meta.store_results.items():
                self.events.note_store_report(eid, res.finished_workers, bool(res.failed_keys))
            self.events.note_removed(meta.removed_blocks, self.groups)
        if self.codec is not None:
            for eid, res in meta.store_results.items():
                self.markers.note_store_report(
                    self.codec, eid, res.finished_workers, res.failed_keys
                )
            self.markers.note_removed(self.codec, meta.removed_blocks, self.groups)
        for eid, res in meta.store_results.items():
            self.pins.store_reported(eid, res.finished_workers)

    def _finished_fallback(self, request: Request) -> tuple[bool, None]:
        self.requests.pop(request.request_id, None)
        return False, None

    @guarded_hook(_finished_fallback)
    def request_finished(self, request: Request) -> tuple[bool, None]:
        """Forget the request; never delays freeing its blocks (in lazy store mode, its
        blocks may stay pinned until stored, see ``LazyStorePlanner.pin_finishing``)."""
        st = self.requests.pop(request.request_id, None)
        if st is not None and not _stopped_by_output(request):
            unconfirmed = self.loads.uncache_unconfirmed_sync_load(st, request, self.groups)
            self.quarantine.add(unconfirmed)
        if st is not None and st.store_hold > 0:
            self._plan_ended_held_stores(st, request)
        if self.lazy is not None and st is not None and self.lazy.has_candidates:
            self.lazy.pin_finishing(
                self.pins.block_pool,
                st.tracker.block_ids,
                lambda i: self.hashing.hash_of(request, i),
            )
        self.lookups.forget(request.request_id)
        return False, None

    def _plan_ended_held_stores(self, st: RequestState, request: Request) -> None:
        """Plan, for the next step, the held stores of a request that ended before its
        hold did (see ``_plan_step``; e.g. a prompt with one output token).

        vLLM sets a stop status only while it applies a step's output, after it has
        rolled back every request whose load failed: a request stopped that way loaded
        right on every rank, so its blocks are stored (pinned until reported). One that
        ended otherwise (aborted, failed) may not have, and stores nothing."""
        if not _stopped_by_output(request):
            return
        if not self.can_store or self.codec is None:
            return
        self.stores.plan_request(st, request.num_computed_tokens, 0, self._ended_held_stores)

    @guarded_hook(lambda self: False)
    def has_pending_block_frees(self) -> bool:
        """Whether a pending report will return blocks to the free pool.

        True when some block is held by this connector's pins alone (its request has
        finished or was preempted while its store or load was in flight): vLLM then
        waits a step for the report instead of preempting a running request.
        """
        early = (b for _, _, b, _ in self.lazy.early) if self.lazy is not None else ()
        pinned = itertools.chain(self.pins.blocks(), early)
        return any(b.ref_cnt == 1 for b in pinned)

    @guarded_hook(lambda self: False)
    def has_pending_push_work(self) -> bool:
        """Whether stores await their workers' reports: vLLM keeps stepping until they
        come (or ``release_stale`` gives up on them), so their blocks get their stored
        markers although no request is left."""
        return bool(self.pins.stores)

    @property
    def pinned_blocks(self) -> int:
        """Blocks held for in-flight transfers (0 when idle)."""
        return len(self.pins) + (len(self.lazy.early) if self.lazy is not None else 0)

    def reset_cache(self) -> bool:
        """Nothing is cached in this process; Redis keeps its objects."""
        return True

    def shutdown(self) -> None:
        """Release every pinned block, stop the lookup thread and write the markers of
        the stores reported so far (waiting up to ``MARKER_FLUSH_S``)."""
        self.lookups.shutdown()
        if self.fleet is not None:
            self.fleet.close()
        self.markers.close(MARKER_FLUSH_S)
        self.pins.release_all()
        if self.lazy is not None:
            self.lazy.release_early(self.pins.block_pool)
