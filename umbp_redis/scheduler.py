"""Scheduler half of the connector: lookups, load specs, store plans, block pinning.

Runs in the engine's scheduler process. It never blocks on Redis for longer than
``lookup_timeout_s`` and treats every Redis problem as a miss.
"""

from __future__ import annotations

import itertools
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from umbp_redis.config import RedisSettings
from umbp_redis.data import (
    BlockIdentityCodec,
    BlockLoadBatch,
    BlockStoreBatch,
    LoadSpec,
    RankTopology,
    RequestTracker,
    UMBPConnectorMetadata,
    UMBPConnectorWorkerMetadata,
    UMBPHandshakeMetadata,
    UMBPNamespace,
    tp_replicated_group_ids,
)
from umbp_redis.dataplane import RedisDataPlane, shared_dataplane

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


@dataclass
class _RequestState:
    request: Request
    tracker: RequestTracker
    local_tokens: int = 0
    hit_blocks: int = 0  # blocks [0, hit_blocks) are known to be in Redis
    load: LoadSpec | None = None


@dataclass
class _PinnedEvent:
    blocks: list[Any]
    reports: int = 0
    failed: set[str] = field(default_factory=set)


class UMBPScheduler:
    """Decides what each step loads and stores; see the connector for the vLLM hooks."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        kv_cache_config: KVCacheConfig,
        options: dict[str, Any],
        *,
        dataplane: RedisDataPlane | None = None,
    ) -> None:
        self.options = options
        role = (
            vllm_config.kv_transfer_config.kv_role if vllm_config.kv_transfer_config else "kv_both"
        )
        self.can_load = role in ("kv_consumer", "kv_both") and options["enable_lookup"]
        self.can_store = role in ("kv_producer", "kv_both")
        self.load_async = bool(options["load_async"])
        self.lookup_async = bool(options["lookup_async"])
        self._lookup_pool = (
            ThreadPoolExecutor(1, thread_name_prefix="umbp-lookup") if self.lookup_async else None
        )
        self._lookups: dict[str, tuple[tuple[Any, ...], Future[list[bool] | None]]] = {}
        self.save_decode = bool(options["save_decode_cache"])
        self.topology = RankTopology.from_vllm_config(vllm_config)
        self.groups = [
            gid
            for gid, g in enumerate(kv_cache_config.kv_cache_groups)
            if getattr(g, "enable_kv_transfer", True)
        ]
        self.block_size = int(
            kv_cache_config.kv_cache_groups[self.groups[0]].kv_cache_spec.block_size
        )
        self.hash_block_size = int(kv_cache_config.hash_block_size or self.block_size)
        self.replicated = tp_replicated_group_ids(kv_cache_config, self.topology)
        configured = UMBPNamespace.configured(vllm_config)
        self.codec: BlockIdentityCodec | None = (
            BlockIdentityCodec(configured.value, self.topology, self.replicated)
            if configured
            else None
        )
        self.dp = dataplane or shared_dataplane(RedisSettings.from_options(options))
        self.num_workers = self.topology.num_rank_namespaces
        self.requests: dict[str, _RequestState] = {}
        self.pending_loads: list[BlockLoadBatch] = []
        self.pending_cancels: list[str] = []
        self.pinned: dict[int, _PinnedEvent] = {}
        self.load_pins: dict[str, list[Any]] = {}
        self.block_pool: Any = None
        self._event_ids = itertools.count(1)

    # -- startup ----------------------------------------------------------------------

    def bind_block_pool(self, block_pool: Any) -> None:
        """Keep the engine's block pool to pin store sources."""
        self.block_pool = block_pool

    def adopt_handshake(self, metadata: dict[Any, Any]) -> None:
        """Take the namespace the workers derived (they see the per-layer specs)."""
        spaces = {m.namespace for m in metadata.values() if isinstance(m, UMBPHandshakeMetadata)}
        if len(spaces) != 1:
            log.error("workers reported namespaces %s; disabling lookups", sorted(spaces))
            self.codec = None
            return
        ns = spaces.pop()
        if self.codec is None or self.codec.namespace != ns:
            self.codec = BlockIdentityCodec(ns, self.topology, self.replicated)
            log.info("umbp-redis: using key namespace %s", ns)

    # -- lookups ----------------------------------------------------------------------

    def _hash_of_block(self, request: Request, index: int) -> bytes | None:
        ratio = self.block_size // self.hash_block_size
        pos = (index + 1) * ratio - 1
        hashes = request.block_hashes
        return bytes(hashes[pos]) if pos < len(hashes) else None

    def _state(self, request: Request) -> _RequestState:
        st = self.requests.get(request.request_id)
        if st is None or st.request is not request:
            st = _RequestState(request, RequestTracker(request.request_id))
            self.requests[request.request_id] = st
        return st

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Block-aligned prefix tokens beyond ``num_computed_tokens`` present in Redis.

        With ``lookup_async`` the first call starts the lookup and returns None; a later
        call with the same request state returns its answer (a changed request starts a
        new lookup and the stale answer is discarded).
        """
        st = self._state(request)
        st.local_tokens = num_computed_tokens
        if not self.can_load or self.codec is None:
            return 0, False
        bs = self.block_size
        max_blocks = (request.num_prompt_tokens - 1) // bs  # the last token is computed
        start = num_computed_tokens // bs
        hashes = []
        for i in range(start, max_blocks):
            h = self._hash_of_block(request, i)
            if h is None:
                break
            hashes.append(h)
        if not hashes:
            return 0, False
        keys: list[str] = []
        per_block = 0
        for h in hashes:
            block_keys = [k for g in self.groups for k in self.codec.rank_keys(h, g)]
            per_block = len(block_keys)
            keys.extend(block_keys)
        if self._lookup_pool is not None:
            sig = (num_computed_tokens, len(hashes), hashes[-1])
            entry = self._lookups.get(request.request_id)
            if entry is None or entry[0] != sig:
                fut = self._lookup_pool.submit(self.dp.lookup, keys)
                self._lookups[request.request_id] = (sig, fut)
                return None, False
            if not entry[1].done():
                return None, False
            present = entry[1].result()
        else:
            present = self.dp.lookup(keys)
        if present is None:
            return 0, False
        hits = 0
        for b in range(len(hashes)):
            if all(present[b * per_block : (b + 1) * per_block]):
                hits += 1
            else:
                break
        st.hit_blocks = max(st.hit_blocks, start + hits)
        tokens = (start + hits) * bs - num_computed_tokens
        if tokens <= 0:
            return 0, False
        return tokens, self.load_async

    def update_state_after_alloc(
        self, request: Request, blocks: Any, num_external_tokens: int
    ) -> None:
        """Record where the hit blocks go; the load is emitted with the next metadata."""
        st = self._state(request)
        if num_external_tokens <= 0:
            return
        bs = self.block_size
        spec = LoadSpec(st.local_tokens, st.local_tokens + num_external_tokens, self.load_async)
        st.load = spec
        first = st.local_tokens // bs
        last = (st.local_tokens + num_external_tokens) // bs
        ids = blocks.get_block_ids()
        hashes, block_ids, group_ids = [], [], []
        for i in range(first, last):
            h = self._hash_of_block(request, i)
            if h is None:
                break
            for g in self.groups:
                hashes.append(h)
                block_ids.append(ids[g][i])
                group_ids.append(g)
        self.pending_loads.append(
            BlockLoadBatch(
                request.request_id,
                tuple(hashes),
                tuple(block_ids),
                tuple(group_ids),
                event_id=next(self._event_ids),
            )
        )
        if self.load_async and self.block_pool is not None and block_ids:
            # Destinations stay allocated until the load is done, even if the request
            # is aborted meanwhile and its blocks are freed.
            pins = [self.block_pool.blocks[b] for b in block_ids]
            self.block_pool.touch(pins)
            self.load_pins.setdefault(request.request_id, []).extend(pins)
        st.tracker.num_loaded_tokens = spec.external_tokens

    # -- per step ---------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> UMBPConnectorMetadata:
        """This step's loads, stores and cancellations; resets the pending lists."""
        meta = UMBPConnectorMetadata(load_async=self.load_async)
        meta.loads, self.pending_loads = self.pending_loads, []
        preempted = scheduler_output.preempted_req_ids or set()
        if preempted:
            log.info(
                "umbp-redis: %d requests preempted; their pending transfers are dropped",
                len(preempted),
            )
        for rid in preempted:
            meta.cancelled_requests.append(rid)
            st = self.requests.get(rid)
            if st is not None:
                st.tracker.preempted = True
        meta.cancelled_requests.extend(self.pending_cancels)
        self.pending_cancels = []
        if not self.can_store or self.codec is None:
            for new in scheduler_output.scheduled_new_reqs:
                self._tracker_blocks(new.req_id, new.block_ids, replace=True)
            self._update_cached(scheduler_output)
            return meta
        num_sched = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            st = self._tracker_blocks(new.req_id, new.block_ids, replace=True)
            if st is not None:
                self._plan_stores(st, new.num_computed_tokens + num_sched.get(new.req_id, 0), meta)
        cached = scheduler_output.scheduled_cached_reqs
        self._update_cached(scheduler_output)
        for i, rid in enumerate(cached.req_ids):
            st = self.requests.get(rid)
            if st is not None:
                self._plan_stores(st, cached.num_computed_tokens[i] + num_sched.get(rid, 0), meta)
        return meta

    def _update_cached(self, scheduler_output: SchedulerOutput) -> None:
        cached = scheduler_output.scheduled_cached_reqs
        resumed: set[str] = getattr(cached, "resumed_req_ids", None) or set()
        for i, rid in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            if new_ids is None:
                continue
            self._tracker_blocks(rid, new_ids, replace=rid in resumed)

    def _tracker_blocks(self, rid: str, block_ids: Any, *, replace: bool) -> _RequestState | None:
        st = self.requests.get(rid)
        if st is None:
            return None
        if replace:
            st.tracker.replace_blocks(block_ids)
        else:
            st.tracker.append_blocks(block_ids)
        return st

    def _plan_stores(
        self, st: _RequestState, tokens_after_step: int, meta: UMBPConnectorMetadata
    ) -> None:
        assert self.codec is not None
        req = st.request
        limit = (
            tokens_after_step if self.save_decode else min(tokens_after_step, req.num_prompt_tokens)
        )
        bs = self.block_size
        tr = st.tracker
        first = tr.num_saved_tokens // bs
        last = limit // bs
        # Blocks loaded from Redis or seen present in a lookup are not sent again.
        skip_below = max(st.hit_blocks, tr.num_loaded_tokens // bs)
        hashes, block_ids, group_ids = [], [], []
        saved_to = first
        for i in range(first, last):
            h = self._hash_of_block(req, i)
            if h is None:
                break
            saved_to = i + 1
            if i < skip_below:
                continue
            for g in self.groups:
                if not tr.block_ids or i >= len(tr.block_ids[g]):
                    break
                hashes.append(h)
                block_ids.append(tr.block_ids[g][i])
                group_ids.append(g)
        tr.mark_saved(saved_to * bs, bs)
        if not hashes:
            return
        event = next(self._event_ids)
        batch = BlockStoreBatch(
            req.request_id, tuple(hashes), tuple(block_ids), tuple(group_ids), event_id=event
        )
        meta.stores.append(batch)
        if self.block_pool is not None:
            blocks = [self.block_pool.blocks[b] for b in block_ids]
            self.block_pool.touch(blocks)
            self.pinned[event] = _PinnedEvent(blocks)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Release store sources once every worker reported the event."""
        for rid in getattr(connector_output, "finished_recving", None) or ():
            pins = self.load_pins.pop(rid, None)
            if pins and self.block_pool is not None:
                self.block_pool.free_blocks(pins)
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if not isinstance(meta, UMBPConnectorWorkerMetadata):
            return
        for eid, res in meta.store_results.items():
            ev = self.pinned.get(eid)
            if ev is None:
                continue
            ev.reports += res.finished_workers
            ev.failed |= set(res.failed_keys)
            if ev.reports >= self.num_workers:
                self._release(eid)

    def _release(self, eid: int) -> None:
        ev = self.pinned.pop(eid)
        if self.block_pool is not None:
            self.block_pool.free_blocks(ev.blocks)

    def request_finished(self, request: Request) -> tuple[bool, None]:
        """Forget the request; never delays freeing its blocks."""
        self.requests.pop(request.request_id, None)
        self._lookups.pop(request.request_id, None)
        return False, None

    def has_pending_block_frees(self) -> bool:
        """Whether a pending report will return blocks to the free pool.

        True when some block is held by this connector's pins alone (its request has
        finished or was preempted while its store or load was in flight): vLLM then
        waits a step for the report instead of preempting a running request.
        """
        pinned = itertools.chain(
            (b for ev in self.pinned.values() for b in ev.blocks),
            (b for pins in self.load_pins.values() for b in pins),
        )
        return any(getattr(b, "ref_cnt", 0) == 1 for b in pinned)

    @property
    def pinned_blocks(self) -> int:
        """Blocks held for in-flight stores (0 when idle)."""
        return sum(len(e.blocks) for e in self.pinned.values()) + sum(
            len(p) for p in self.load_pins.values()
        )

    def reset_cache(self) -> bool:
        """Nothing is cached in this process; Redis keeps its objects."""
        return True

    def shutdown(self) -> None:
        """Release every pinned block and stop the lookup thread."""
        if self._lookup_pool is not None:
            self._lookup_pool.shutdown(wait=False, cancel_futures=True)
        for eid in list(self.pinned):
            self._release(eid)
        for rid in list(self.load_pins):
            pins = self.load_pins.pop(rid)
            if self.block_pool is not None:
                self.block_pool.free_blocks(pins)
