"""Scheduler half of the connector: lookups, load specs, store plans, block pinning.

Runs in the engine's scheduler process. It never blocks on Redis for longer than
``lookup_timeout_s``, treats every Redis problem as a miss, and never raises into
vLLM's step: a bug in a hook is logged, counted and turned into a miss or a dropped
store (``_guarded``).

Keys and their encoded lookup commands are built once per block hash and kept with
the request; a lookup covers the whole prefix chain the request relies on (blocks
the engine's own prefix cache holds included), so every request that shares a prefix
refreshes it in Redis (TTL or LRU clock) and LRU eviction takes unshared suffixes first.

Stores are planned per request after the step that computed the blocks (``store_mode:
eager``) or, in lazy mode, when vLLM's free queue brings the blocks near eviction.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from umbp_redis.data import (
    BlockIdentityCodec,
    BlockLoadBatch,
    BlockStoreBatch,
    CacheGroupPlans,
    LoadSpec,
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
from umbp_redis.engine.stats import StatsRecorder
from umbp_redis.store.deployment import DataPlane, shared_plane
from umbp_redis.store.settings import RedisSettings

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)
R = TypeVar("R")

# Blocks the load-failure quarantine remembers at most (the oldest are forgotten).
QUARANTINE_MAX_BLOCKS = 65536
# Store events whose blocks are kept for their KV cache event at most.
MAX_TRACKED_STORE_EVENTS = 16384
# The "medium" of this connector's KV cache events.
KV_EVENTS_MEDIUM = "REDIS"
# A block stored again within this many seconds is not announced again.
ANNOUNCE_WINDOW_S = 60.0

# Lazy store mode: the request id of its store batches, and how many candidate blocks
# it remembers per KV cache block and group (the oldest are forgotten: not stored).
LAZY_REQUEST_ID = "umbp-lazy-offload"
LAZY_CANDIDATES_PER_BLOCK = 2

# Block hash algorithms of vLLM that are not collision resistant against crafted input.
_WEAK_HASH_ALGOS = ("xxhash", "xxhash_cbor")


def _guarded(fallback: Callable[..., Any]) -> Callable[[Callable[..., R]], Callable[..., R]]:
    """Run a hook; on any exception log it (traceback once per hook), count it and
    return ``fallback(self, *args, **kwargs)`` instead of raising into vLLM."""

    def wrap(fn: Callable[..., R]) -> Callable[..., R]:
        @functools.wraps(fn)
        def guarded(self: UMBPScheduler, *args: Any, **kwargs: Any) -> R:
            t0 = time.perf_counter()
            try:
                return fn(self, *args, **kwargs)
            except Exception as e:
                self.errors += 1
                first = fn.__name__ not in self._logged_errors
                self._logged_errors.add(fn.__name__)
                log.error(
                    "umbp-redis: %s failed (%r); treated as a miss or a dropped store",
                    fn.__name__,
                    e,
                    exc_info=first,
                )
                return fallback(self, *args, **kwargs)  # type: ignore[no-any-return]
            finally:
                self._hooks_s += time.perf_counter() - t0

        return guarded

    return wrap


# The request statuses vLLM sets while applying a step's output (a stop condition met).
_STOPPED_BY_OUTPUT = frozenset(
    {"FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED", "FINISHED_REPETITION"}
)


@dataclass
class _RequestState:
    request: Request
    tracker: RequestTracker
    local_tokens: int = 0
    hit_blocks: int = 0  # blocks [0, hit_blocks) are known to be in Redis
    load_failed: bool = False  # a load of it failed on a value that would fail again
    load_async: bool = True  # how the hit of the last lookup answer loads
    sync_load_from: int = 0  # the first block its last sync load loaded
    store_hold: int = 0  # steps its stores wait for its last sync load's outcome
    # Encoded lookup commands of blocks [0, len(lookup_cmds)), built once per block.
    lookup_cmds: list[Any] = field(default_factory=list)
    # The codec and the plane's lookup mode the commands were built with.
    codec: BlockIdentityCodec | None = None
    lookup_mode: str = ""
    replies_per_block: int = 1  # replies of one block's commands (every group's)
    # Per cache group (in self.groups order): (first reply, replies, keys) in a block's.
    group_replies: list[tuple[int, int, int]] = field(default_factory=list)
    # Where the prompt left the prefix Redis held (full-attention groups), seen by the
    # last lookup: a hit point for groups that store only the blocks before hit points.
    divergence: int = 0
    # (block, group position) the last lookup found absent, for groups that store only
    # the blocks before hit points (they may lack blocks the engine holds locally).
    absent: set[tuple[int, int]] = field(default_factory=set)


@dataclass
class _EventBlocks:
    """What a store event holds, for its BlockStored once every worker stored it."""

    blocks: list[_EventBlock]
    reports: int = 0
    failed: bool = False


# A block's KV cache event data: hash, parent hash, token ids, group.
_EventBlock = tuple[bytes, bytes | None, list[int], int]


@dataclass
class _PinnedEvent:
    blocks: list[Any]
    reports: int = 0
    pinned_at: float = field(default_factory=time.monotonic)


class UMBPScheduler:
    """Decides what each step loads and stores; see the connector for the vLLM hooks."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        kv_cache_config: KVCacheConfig,
        options: dict[str, Any],
        *,
        plane: DataPlane | None = None,
    ) -> None:
        self.errors = 0  # hook failures turned into misses (see _guarded)
        self.stats = StatsRecorder()  # the per-step account (lookups, hook time)
        self._hooks_s = 0.0  # seconds in guarded hooks since the last step's metadata
        self._logged_errors: set[str] = set()
        ktc = vllm_config.kv_transfer_config
        role = ktc.kv_role if ktc else "kv_both"
        if ktc is not None and getattr(ktc, "kv_load_failure_policy", "recompute") != "recompute":
            # vLLM reads the policy after creating this object. With "fail", a block
            # evicted between lookup and load (a routine event in a cache) would fail the
            # user's request; a miss must only cost a recompute.
            log.warning(
                "umbp-redis: kv_transfer_config.kv_load_failure_policy was %r; using "
                "'recompute' (a block evicted from Redis between lookup and load must be "
                'recomputed, not fail the request). Set "kv_load_failure_policy": '
                '"recompute" to silence this warning',
                ktc.kv_load_failure_policy,
            )
            ktc.kv_load_failure_policy = "recompute"
        algo = str(getattr(vllm_config.cache_config, "prefix_caching_hash_algo", "sha256"))
        if algo in _WEAK_HASH_ALGOS:
            log.warning(
                "umbp-redis: prefix_caching_hash_algo=%s is not collision resistant: in a "
                "cache shared by several tenants a crafted prompt could collide with another "
                "tenant's blocks and load their KV. Use sha256 or sha256_cbor for shared caches",
                algo,
            )
        self.can_load = role in ("kv_consumer", "kv_both") and options["enable_lookup"]
        self.can_store = role in ("kv_producer", "kv_both")
        self.load_mode = options["load_async"]  # "auto", True or False
        self.sync_load_max_bytes = int(options["sync_load_max_bytes"])
        self.layer_load_max_bytes = int(options["layer_load_max_bytes"])
        # Every worker's sync loads run by layer (their handshakes say so).
        self.workers_load_by_layer = False
        self.idle_wait_s = float(options["idle_wait_ms"]) / 1e3
        self.idle_waits = 0  # idle steps that waited for loads in flight
        self.lookup_async = bool(options["lookup_async"])
        self._lookup_pool = (
            ThreadPoolExecutor(1, thread_name_prefix="umbp-lookup") if self.lookup_async else None
        )
        self._lookups: dict[str, tuple[tuple[Any, ...], Future[list[int] | None]]] = {}
        self.save_decode = bool(options["save_decode_cache"])
        self.lazy = options["store_mode"] == "lazy"
        self.topology = RankTopology.from_vllm_config(vllm_config)
        self.groups = [
            gid
            for gid, g in enumerate(kv_cache_config.kv_cache_groups)
            if getattr(g, "enable_kv_transfer", True)
        ]
        self.block_size = int(
            kv_cache_config.kv_cache_groups[self.groups[0]].kv_cache_spec.block_size
        )
        try:
            self.group_plans = CacheGroupPlans.from_kv_cache_config(kv_cache_config, self.groups)
        except UnsupportedCacheGroup as e:
            log.error("umbp-redis: %s; this engine neither looks up nor stores blocks", e)
            self.group_plans = CacheGroupPlans(())
            self.can_load = self.can_store = False
        self.hash_block_size = int(kv_cache_config.hash_block_size or self.block_size)
        # Bytes one block's load moves on each worker (every layer of every group).
        self.bytes_per_block = sum(
            int(kv_cache_config.kv_cache_groups[g].kv_cache_spec.page_size_bytes)
            * len(kv_cache_config.kv_cache_groups[g].layer_names)
            for g in self.groups
        )
        # A failed sync load can only be reported as block ids: see
        # block_failures_reportable (models with several cache groups load async).
        self.sync_loads_possible = block_failures_reportable(kv_cache_config)
        if self.load_mode is False and not self.sync_loads_possible:
            log.warning(
                "umbp-redis: load_async=false is ignored: this model has %d KV cache groups "
                "and vLLM can recompute a failed load of such a model only if it was async",
                len(kv_cache_config.kv_cache_groups),
            )
        self.replicated = tp_replicated_group_ids(kv_cache_config, self.topology)
        configured = UMBPNamespace.configured(vllm_config)
        self.codec: BlockIdentityCodec | None = (
            BlockIdentityCodec(configured.value, self.topology, self.replicated)
            if configured
            else None
        )
        self.plane: DataPlane = plane or shared_plane(RedisSettings.from_options(options))
        warm_up = getattr(self.plane, "warm_up", None)
        if warm_up is not None:
            warm_up()  # the lookup connection is made now, off the scheduler thread
        self._refresh_ttl = bool(options["refresh_ttl_on_lookup"])
        self.report_timeout_s = float(options["store_report_timeout_s"])
        self.quarantine_s = float(options["load_failure_quarantine_s"])
        # Block hash -> monotonic time until which it is not offered as a hit.
        self.quarantine: OrderedDict[bytes, float] = OrderedDict()
        self.quarantine_skips = 0
        self.sync_load_uncached = 0  # blocks taken from vLLM's cache after failed sync loads
        # KV cache events (only with vLLM's --kv-events-config): the blocks of each store
        # event until every worker reported it, then BlockStored for take_events().
        events_cfg = getattr(vllm_config, "kv_events_config", None)
        self.kv_events = bool(events_cfg and getattr(events_cfg, "enable_kv_cache_events", 0))
        self._event_blocks: OrderedDict[int, _EventBlocks] = OrderedDict()
        self._kv_events: list[Any] = []
        # (block hash, group) -> when announced; one BlockStored per block and window.
        self._announced: OrderedDict[tuple[bytes, int], float] = OrderedDict()
        # (block hash, group) already in this step's stores.
        self._planned_this_step: set[tuple[bytes, int]] = set()
        self.stale_pins_released = 0
        # Per block-hash length: the codec they were built for and the encoder.
        # Per hash length: the codec and lookup mode it was built for, and the encoder.
        self._encoders: dict[int, tuple[BlockIdentityCodec, str, Any]] = {}
        self.num_workers = self.topology.num_rank_namespaces
        t = self.topology
        # Several ranks compute each token together: one rank's failed load reaches the
        # KV every rank computes after it in that step (see _plan_step). vLLM applies a
        # step's output before it schedules the next, or (async scheduling) one later.
        shared = t.tp_size * t.pp_size * t.pcp_size * t.dcp_size > 1
        async_sched = bool(getattr(vllm_config.scheduler_config, "async_scheduling", False))
        self.sync_load_store_hold = (2 if async_sched else 1) if shared else 0
        # Stores of requests that ended while held, for the next step (request_finished).
        self._ended_held_stores = UMBPConnectorMetadata()
        self.requests: dict[str, _RequestState] = {}
        self.pending_loads: list[BlockLoadBatch] = []
        self.pinned: dict[int, _PinnedEvent] = {}
        self.load_pins: dict[str, list[Any]] = {}
        self.block_pool: Any = None
        self._event_ids = itertools.count(1)
        # Lazy store mode: blocks computed here that Redis does not hold, as (hash,
        # group) -> their KV cache event data (None without events), stored once vLLM's
        # free queue brings them within lazy_window blocks of eviction.
        self._lazy_candidates: OrderedDict[tuple[bytes, int], _EventBlock | None] = OrderedDict()
        self._lazy_max = max(
            1024, LAZY_CANDIDATES_PER_BLOCK * int(kv_cache_config.num_blocks) * len(self.groups)
        )
        sched_cfg = getattr(vllm_config, "scheduler_config", None)
        step_tokens = int(getattr(sched_cfg, "max_num_batched_tokens", 0) or 8192)
        step_seqs = int(getattr(sched_cfg, "max_num_seqs", 0) or 256)
        # Blocks one step can take from the free queue at most: a full batch of new
        # tokens in every group, plus one block per running request.
        self.lazy_window = len(self.groups) * -(-step_tokens // self.block_size) + step_seqs
        self.lazy_blocks_stored = 0  # blocks pinned for a lazy store so far
        # Blocks of finished requests pinned for the next step's lazy store.
        self._lazy_early: list[tuple[bytes, int, Any, _EventBlock | None]] = []

    # -- startup ----------------------------------------------------------------------

    def bind_block_pool(self, block_pool: Any) -> None:
        """Keep the engine's block pool to pin store sources."""
        self.block_pool = block_pool

    def adopt_handshake(self, metadata: dict[Any, Any]) -> None:
        """Take the namespace the workers derived (they see the per-layer specs).

        Workers that disagree on the namespace, or report other parallel sizes than
        this scheduler's (its keys would name other ranks), disable lookups.
        """
        reports = [m for m in metadata.values() if isinstance(m, UMBPHandshakeMetadata)]
        spaces = {m.namespace for m in reports}
        mine = self.topology.with_ranks(tp_rank=0, pp_rank=0, pcp_rank=0)
        foreign = [
            m.topology
            for m in reports
            if m.topology.with_ranks(tp_rank=0, pp_rank=0, pcp_rank=0) != mine
        ]
        if foreign:
            log.error(
                "umbp-redis: a worker reported parallel sizes %s, the scheduler has %s; "
                "disabling lookups",
                foreign[0],
                mine,
            )
            self.codec = None
            return
        if len(spaces) != 1:
            log.error("workers reported namespaces %s; disabling lookups", sorted(spaces))
            self.codec = None
            return
        self.workers_load_by_layer = all(m.loads_by_layer for m in reports)
        if self.workers_load_by_layer and self.load_mode == "auto":
            log.info(
                "umbp-redis: the workers load by layer: loads of at most %d bytes per worker "
                "run alongside the step's forward pass (layer_load_max_bytes)",
                self.layer_load_max_bytes,
            )
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

    def _lookup_cmds(self, st: _RequestState, upto: int) -> list[Any]:
        """Encoded lookup commands of blocks [0, upto) (fewer if hashes run out), built
        incrementally: each block's commands are made once for the request's lifetime
        (again after a namespace change or when the plane's lookup mode changes)."""
        codec = self.codec
        assert codec is not None
        mode = self.plane.lookup_mode
        if st.codec is not codec or st.lookup_mode != mode:
            st.lookup_cmds, st.codec, st.lookup_mode = [], codec, mode
            st.group_replies = []
        cmds = st.lookup_cmds
        n_groups = len(self.groups)
        for i in range(len(cmds) // n_groups, upto):
            h = self._hash_of_block(st.request, i)
            if h is None:
                break
            hx = h.hex().encode()
            enc = self._encoders.get(len(hx))
            if enc is None or enc[0] is not codec or enc[1] != mode:
                encoders = [
                    self.plane.lookup_encoder(
                        [p.encode() for p in codec.key_prefixes(g)],
                        refresh_ttl=self._refresh_ttl,
                        hash_hex_len=len(hx),
                    )
                    for g in self.groups
                ]
                enc = self._encoders[len(hx)] = (codec, mode, encoders)
            cmds.extend(e.encode(hx) for e in enc[2])
            if not st.group_replies:
                first = 0
                for g, e in zip(self.groups, enc[2], strict=True):
                    st.group_replies.append((first, e.replies, len(codec.key_prefixes(g))))
                    first += e.replies
                st.replies_per_block = first
        return cmds

    def _lookup_fallback(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    @_guarded(_lookup_fallback)
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Block-aligned prefix tokens beyond ``num_computed_tokens`` present in Redis.

        One round trip covers blocks [0, last prompt block): the blocks the engine's
        own prefix cache holds are refreshed in Redis (not counted), the rest counted as
        the consecutive run whose every rank key exists. With ``lookup_async`` the first
        call starts the lookup and returns None; a later call with the same request
        state returns its answer (a changed request starts a new lookup).
        """
        st = self._state(request)
        st.local_tokens = num_computed_tokens
        # Blocks in vLLM's local cache were computed (and stored) or loaded here before:
        # they are not stored again (the lookup below refreshes them in Redis).
        st.hit_blocks = max(st.hit_blocks, num_computed_tokens // self.block_size)
        if not self.can_load or self.codec is None or st.load_failed:
            return 0, False
        bs = self.block_size
        max_blocks = (request.num_prompt_tokens - 1) // bs  # the last token is computed
        start = num_computed_tokens // bs
        cmds = self._lookup_cmds(st, max_blocks)
        n_blocks = len(cmds) // len(self.groups)
        if n_blocks <= start:
            return 0, False
        replies_per_block = st.replies_per_block
        count = n_blocks * replies_per_block
        if self._lookup_pool is not None:
            sig = (num_computed_tokens, n_blocks)
            entry = self._lookups.get(request.request_id)
            if entry is None or entry[0] != sig:
                n_cmds = n_blocks * len(self.groups)
                fut = self._lookup_pool.submit(self._timed_lookup, cmds[:n_cmds], count)
                self._lookups[request.request_id] = (sig, fut)
                return None, False
            if not entry[1].done():
                return None, False
            replies = entry[1].result()
        else:
            replies = self._timed_lookup(cmds, count)
        if replies is None or len(replies) != count:
            return 0, False
        now = time.monotonic() if self.quarantine else 0.0
        groups = st.group_replies
        skipped: set[int] = set()

        def present(b: int, pos: int) -> bool:
            first, n, keys = groups[pos]
            at = b * replies_per_block + first
            if sum(replies[at : at + n]) != keys:
                return False
            if now and self._quarantined(request, b, now):
                skipped.add(b)
                return False
            return True

        plans = self.group_plans
        if not plans.all_full:
            st.absent = {
                (b, pos)
                for pos, r in enumerate(plans.groups)
                if not r.stores_all()
                for b in range(n_blocks)
                if not present(b, pos)
            }
        st.divergence = plans.full_prefix_end(start, n_blocks, present)
        hit = plans.longest_hit_below(start, st.divergence, present)
        self.quarantine_skips += bool(skipped)
        st.hit_blocks = max(st.hit_blocks, hit)
        tokens = hit * bs - num_computed_tokens
        if tokens <= 0:
            return 0, False
        st.load_async = self.loads_async(tokens // bs)
        return tokens, st.load_async

    def _timed_lookup(self, cmds: list[Any], count: int) -> list[int] | None:
        """The data plane's lookup of ``cmds``, its time recorded as ``lookup_s``."""
        t0 = time.perf_counter()
        try:
            return self.plane.lookup_blocks(cmds, count)
        finally:
            self.stats.observe("lookup_s", time.perf_counter() - t0)

    def take_stats(self) -> dict[str, Any]:
        """The scheduler's per-step account since the last call (and reset it)."""
        return self.stats.take()

    def loads_async(self, blocks: int) -> bool:
        """Whether a load of ``blocks`` blocks runs while its request waits (async) or
        in the step that computes the request (sync): ``load_async`` when set, else
        sync for loads of at most ``sync_load_max_bytes`` per worker, whose wait costs
        less than the engine step an async load keeps its request waiting, or of at most
        ``layer_load_max_bytes`` where every worker loads by layer (the forward pass
        waits only for the layer it is at)."""
        if not self.sync_loads_possible:
            return True
        if self.load_mode != "auto":
            return bool(self.load_mode)
        limit = self.sync_load_max_bytes
        if self.workers_load_by_layer:
            limit = max(limit, self.layer_load_max_bytes)
        return blocks * self.bytes_per_block > limit

    def _quarantined(self, request: Request, index: int, now: float) -> bool:
        h = self._hash_of_block(request, index)
        until = self.quarantine.get(h) if h is not None else None
        if until is None:
            return False
        if until <= now:
            del self.quarantine[h]  # type: ignore[arg-type]
            return False
        return True

    def _quarantine_failed(self, hashes: tuple[bytes, ...]) -> None:
        """Stop offering blocks whose load failed as hits for ``load_failure_quarantine_s``."""
        if self.quarantine_s <= 0 or not hashes:
            return
        until = time.monotonic() + self.quarantine_s
        for h in hashes:
            self.quarantine[h] = until
            self.quarantine.move_to_end(h)
        while len(self.quarantine) > QUARANTINE_MAX_BLOCKS:
            self.quarantine.popitem(last=False)
        log.info(
            "umbp-redis: %d blocks failed to load; not offered as hits for %.0fs",
            len(hashes),
            self.quarantine_s,
        )

    def _alloc_fallback(self, request: Request, blocks: Any, num_external_tokens: int) -> None:
        """vLLM was promised ``num_external_tokens``: report their blocks failed instead."""
        if num_external_tokens <= 0:
            return
        try:
            st = self.requests[request.request_id]
            local = st.local_tokens
            bs = self.block_size
            block_ids = tuple(
                b
                for _, _, b in self._hit_blocks(
                    blocks, local // bs, (local + num_external_tokens) // bs
                )
            )
        except Exception as e:
            log.error("umbp-redis: cannot report the failed load of %s: %r", request.request_id, e)
            return
        self.pending_loads.append(
            BlockLoadBatch(
                request.request_id,
                (b"",) * len(block_ids),
                block_ids,
                (0,) * len(block_ids),
                event_id=next(self._event_ids),
                fail_all=True,
                load_async=st.load_async,
            )
        )

    def _hit_blocks(self, blocks: Any, first: int, last: int) -> list[tuple[int, int, int]]:
        """(block index, group, engine block id) of the blocks a hit over blocks
        ``[first, last)`` loads, in block order: every group's blocks its reach needs
        (a sliding window only the blocks before ``last``), never vLLM's null block."""
        ids = blocks.get_block_ids()
        kv_blocks = getattr(blocks, "blocks", None)
        needed = [(r.group_id, r.needed(last, first)) for r in self.group_plans.groups]
        out = []
        for i in range(first, last):
            for g, wanted in needed:
                if i not in wanted or i >= len(ids[g]):
                    continue
                if kv_blocks is not None and getattr(kv_blocks[g][i], "is_null", False):
                    continue
                out.append((i, g, ids[g][i]))
        return out

    @_guarded(_alloc_fallback)
    def update_state_after_alloc(
        self, request: Request, blocks: Any, num_external_tokens: int
    ) -> None:
        """Record where the hit blocks go; the load is emitted with the next metadata."""
        st = self._state(request)
        if num_external_tokens <= 0:
            return
        bs = self.block_size
        spec = LoadSpec(st.local_tokens, st.local_tokens + num_external_tokens, st.load_async)
        first = st.local_tokens // bs
        last = (st.local_tokens + num_external_tokens) // bs
        hashes, block_ids, group_ids = [], [], []
        for i, g, block_id in self._hit_blocks(blocks, first, last):
            h = self._hash_of_block(request, i)
            if h is None:
                break
            hashes.append(h)
            block_ids.append(block_id)
            group_ids.append(g)
        self.pending_loads.append(
            BlockLoadBatch(
                request.request_id,
                tuple(hashes),
                tuple(block_ids),
                tuple(group_ids),
                event_id=next(self._event_ids),
                load_async=spec.load_async,
            )
        )
        if not spec.load_async:
            st.sync_load_from = first
        if spec.load_async and self.block_pool is not None and block_ids:
            # Destinations stay allocated until the load is done, even if the request
            # is aborted meanwhile and its blocks are freed.
            pins = [self.block_pool.blocks[b] for b in block_ids]
            self.block_pool.touch(pins)
            self.load_pins.setdefault(request.request_id, []).extend(pins)
        st.tracker.num_loaded_tokens = spec.external_tokens

    # -- per step ---------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> UMBPConnectorMetadata:
        """This step's loads, stores and cancellations; resets the pending lists.

        The loads vLLM was promised always go out; a failure while planning stores only
        drops this step's stores (logged and counted).
        """
        t0 = time.perf_counter()
        meta = UMBPConnectorMetadata()
        meta.loads, self.pending_loads = self.pending_loads, []
        meta.step_requests = len(getattr(scheduler_output, "num_scheduled_tokens", None) or ())
        if (
            self.idle_wait_s > 0
            and self.load_pins
            and not meta.loads
            and not getattr(scheduler_output, "total_num_scheduled_tokens", 1)
        ):
            # Nothing to compute but loads in flight: a spinning engine loop would take
            # the CPU and the GIL from them. Bounded by idle_wait_ms per step.
            self.idle_waits += 1
            time.sleep(self.idle_wait_s)
        self._planned_this_step.clear()
        try:
            self._release_stale_pins()
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
                if batch.event_id in self.pinned:
                    self._release(batch.event_id)
            meta.stores = []
        self.stats.observe("scheduler_step_s", self._hooks_s + time.perf_counter() - t0)
        self._hooks_s = 0.0
        return meta

    def _release_stale_pins(self) -> None:
        """Unpin store sources whose worker reports never came within the bound."""
        if not self.pinned:
            return
        limit = time.monotonic() - self.report_timeout_s
        stale = [eid for eid, ev in self.pinned.items() if ev.pinned_at < limit]
        if stale:
            if self.stale_pins_released == 0:
                log.warning(
                    "umbp-redis: %d store events had no worker report within "
                    "store_report_timeout_s=%.0fs; their blocks are released",
                    len(stale),
                    self.report_timeout_s,
                )
            self.stale_pins_released += len(stale)
            for eid in stale:
                self._release(eid)

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
                self._plan_stores(st, new.num_computed_tokens, num_sched.get(new.req_id, 0), meta)
        cached = scheduler_output.scheduled_cached_reqs
        self._update_cached(scheduler_output)
        for i, rid in enumerate(cached.req_ids):
            st = self.requests.get(rid)
            if st is not None and not self._held(st):
                self._plan_stores(st, cached.num_computed_tokens[i], num_sched.get(rid, 0), meta)
        if self.lazy:
            self._plan_lazy_stores(meta)

    @staticmethod
    def _held(st: _RequestState) -> bool:
        """Whether a scheduled request's stores wait this step (``store_hold``)."""
        if st.store_hold <= 0:
            return False
        st.store_hold -= 1
        return st.store_hold > 0

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
        self,
        st: _RequestState,
        computed_before: int,
        scheduled: int,
        meta: UMBPConnectorMetadata,
    ) -> None:
        assert self.codec is not None
        req = st.request
        tokens_after_step = computed_before + scheduled
        bs = self.block_size
        tr = st.tracker
        # Blocks counted as in Redis (hit or loaded) that vLLM computes again now failed
        # to load (invalid or evicted value): this engine stores them afresh.
        redo_from = computed_before // bs
        if scheduled > 0 and redo_from < max(st.hit_blocks, tr.num_loaded_tokens // bs):
            st.hit_blocks = min(st.hit_blocks, redo_from)
            tr.num_loaded_tokens = min(tr.num_loaded_tokens, redo_from * bs)
            tr.num_saved_tokens = min(tr.num_saved_tokens, redo_from * bs)
        limit = (
            tokens_after_step if self.save_decode else min(tokens_after_step, req.num_prompt_tokens)
        )
        first = tr.num_saved_tokens // bs
        last = limit // bs
        # Blocks loaded from Redis or seen present in a lookup are not sent again.
        skip_below = max(st.hit_blocks, tr.num_loaded_tokens // bs)
        hashes, block_ids, group_ids, indices = [], [], [], []
        saved_to = first
        reaches = self.group_plans.groups
        # Groups that keep only the blocks before hit points: the prompt's end (the same
        # prompt, or a conversation continuing it) and where it left Redis's prefix.
        hit_points = {(req.num_prompt_tokens - 1) // bs, req.num_prompt_tokens // bs}
        if 0 < st.divergence:
            hit_points.add(st.divergence)
        kept = [
            None if r.stores_all() else set(r.stored(range(first, last), hit_points))
            for r in reaches
        ]
        null_id = getattr(getattr(self.block_pool, "null_block", None), "block_id", None)
        for i in range(first, last):
            h = self._hash_of_block(req, i)
            if h is None:
                break
            saved_to = i + 1
            below = i < skip_below  # in Redis, or in vLLM's local cache
            if below and not st.absent:
                continue
            for pos, g in enumerate(self.groups):
                if not tr.block_ids or i >= len(tr.block_ids[g]):
                    break
                wanted = kept[pos]
                if wanted is None:
                    if below:
                        continue
                elif i not in wanted or tr.block_ids[g][i] == null_id:
                    continue  # a block no hit point of this group needs
                elif below and (i, pos) not in st.absent:
                    continue  # needed, and Redis has it
                if (h, g) in self._planned_this_step:
                    continue  # another request of this step computed the same block
                self._planned_this_step.add((h, g))
                hashes.append(h)
                block_ids.append(tr.block_ids[g][i])
                group_ids.append(g)
                indices.append(i)
        tr.mark_saved(saved_to * bs, bs)
        if not hashes:
            return
        event_data = self._event_data(req, hashes, indices, group_ids) if self.kv_events else None
        if self.lazy:
            self._remember_candidates(hashes, group_ids, event_data)
            return
        self._emit_store(meta, req.request_id, hashes, block_ids, group_ids, event_data)

    def _emit_store(
        self,
        meta: UMBPConnectorMetadata,
        request_id: str,
        hashes: list[bytes],
        block_ids: list[int],
        group_ids: list[int],
        event_data: list[_EventBlock] | None,
        pinned: list[Any] | None = None,
    ) -> None:
        """One store batch into ``meta``, its source blocks pinned until reported
        (``pinned``: blocks the caller already pinned, one per block id)."""
        event = next(self._event_ids)
        batch = BlockStoreBatch(
            request_id, tuple(hashes), tuple(block_ids), tuple(group_ids), event_id=event
        )
        meta.stores.append(batch)
        if event_data is not None:
            self._event_blocks[event] = _EventBlocks(event_data)
            while len(self._event_blocks) > MAX_TRACKED_STORE_EVENTS:
                self._event_blocks.popitem(last=False)
        if pinned is not None:
            self.pinned[event] = _PinnedEvent(pinned)
        elif self.block_pool is not None:
            blocks = [self.block_pool.blocks[b] for b in block_ids]
            self.block_pool.touch(blocks)
            self.pinned[event] = _PinnedEvent(blocks)

    def _event_data(
        self, req: Request, hashes: list[bytes], indices: list[int], group_ids: list[int]
    ) -> list[_EventBlock]:
        """The KV cache event data (hash, parent, token ids, group) of blocks of ``req``."""
        bs = self.block_size
        tokens = req.all_token_ids
        blocks = []
        for h, i, g in zip(hashes, indices, group_ids, strict=True):
            parent = self._hash_of_block(req, i - 1) if i > 0 else None
            blocks.append((h, parent, list(tokens[i * bs : (i + 1) * bs]), g))
        return blocks

    # -- lazy store mode --------------------------------------------------------------

    def _remember_candidates(
        self, hashes: list[bytes], group_ids: list[int], event_data: list[_EventBlock] | None
    ) -> None:
        """Blocks computed this step, to store once vLLM is about to evict them."""
        cands = self._lazy_candidates
        for n, (h, g) in enumerate(zip(hashes, group_ids, strict=True)):
            cands[(h, g)] = event_data[n] if event_data is not None else None
            cands.move_to_end((h, g))
        while len(cands) > self._lazy_max:
            cands.popitem(last=False)

    def _plan_lazy_stores(self, meta: UMBPConnectorMetadata) -> None:
        """Store the candidate blocks among the next ``lazy_window`` blocks vLLM evicts.

        Walks vLLM's free queue from its head (the next block it reuses) and pins every
        cached block that is a candidate; pinned blocks leave the queue, so the walk
        goes on until ``lazy_window`` blocks that are safe to evict (never cached, or
        already in Redis) lie ahead of the rest. One step takes at most that many blocks
        from the queue, so no candidate is evicted before its store is planned. Pins are
        released by the store's reports (the blocks rejoin the queue, still cached).
        """
        pool = self.block_pool
        cands = self._lazy_candidates
        early, self._lazy_early = self._lazy_early, []
        if early:
            self._emit_store(
                meta,
                LAZY_REQUEST_ID,
                [h for h, _, _, _ in early],
                [b.block_id for _, _, b, _ in early],
                [g for _, g, _, _ in early],
                [d for _, _, _, d in early if d is not None] if self.kv_events else None,
                pinned=[b for _, _, b, _ in early],
            )
        if pool is None or not cands:
            return
        hashes: list[bytes] = []
        block_ids: list[int] = []
        group_ids: list[int] = []
        event_data: list[_EventBlock] = []
        safe = 0
        for block in pool.free_block_queue.iter_blocks_after(None):
            if safe >= self.lazy_window:
                break
            key = block.block_hash
            if key is not None and not block.is_null:
                hk = (bytes(key[:-4]), int.from_bytes(key[-4:], "big"))
                if hk in cands:
                    data = cands.pop(hk)
                    hashes.append(hk[0])
                    block_ids.append(block.block_id)
                    group_ids.append(hk[1])
                    if data is not None:
                        event_data.append(data)
                    continue
            safe += 1
        if not hashes:
            return
        self.lazy_blocks_stored += len(hashes)
        self._emit_store(
            meta,
            LAZY_REQUEST_ID,
            hashes,
            block_ids,
            group_ids,
            event_data if self.kv_events and len(event_data) == len(hashes) else None,
        )

    def _pin_finishing(self, st: _RequestState) -> None:
        """Pin the candidate blocks of a finishing request when vLLM's free queue is
        shorter than ``lazy_window``: freed, they would lie within reach of the next
        step's allocations before the next walk sees them. Stored with the next step."""
        pool = self.block_pool
        if pool is None or pool.get_num_free_blocks() >= self.lazy_window:
            return
        cands = self._lazy_candidates
        picked = []
        for g in self.groups:
            ids = st.tracker.block_ids[g] if st.tracker.block_ids else []
            for i, bid in enumerate(ids):
                h = self._hash_of_block(st.request, i)
                if h is None:
                    break
                if (h, g) in cands and not pool.blocks[bid].is_null:
                    picked.append((h, g, pool.blocks[bid], cands.pop((h, g))))
        if picked:
            pool.touch([b for _, _, b, _ in picked])
            self.lazy_blocks_stored += len(picked)
            self._lazy_early.extend(picked)

    def _note_store_report(self, eid: int, finished: int, failed: bool) -> None:
        """Count a store event's worker reports; once all are in and none failed, its
        blocks are in Redis on every rank: emit their BlockStored."""
        info = self._event_blocks.get(eid)
        if info is None:
            return
        info.reports += finished
        info.failed |= failed
        if info.reports < self.num_workers:
            return
        del self._event_blocks[eid]
        if info.failed:
            return
        from vllm.distributed.kv_events import BlockStored
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        now = time.monotonic()
        for h, parent, tokens, g in info.blocks:
            seen = self._announced.get((h, g))
            if seen is not None and now - seen < ANNOUNCE_WINDOW_S:
                continue
            self._announced[(h, g)] = now
            self._announced.move_to_end((h, g))
            while len(self._announced) > MAX_TRACKED_STORE_EVENTS:
                self._announced.popitem(last=False)
            self._kv_events.append(
                BlockStored(
                    block_hashes=[maybe_convert_block_hash(h)],  # type: ignore[arg-type]
                    parent_block_hash=(
                        maybe_convert_block_hash(parent) if parent is not None else None  # type: ignore[arg-type]
                    ),
                    token_ids=tokens,
                    block_size=self.block_size,
                    lora_id=None,
                    medium=KV_EVENTS_MEDIUM,
                    lora_name=None,
                    group_idx=g,
                )
            )

    def take_events(self) -> list[Any]:
        """KV cache events since the last call: BlockStored for blocks every worker stored
        in Redis, BlockRemoved for values found invalid and deleted (medium REDIS)."""
        events, self._kv_events = self._kv_events, []
        return events

    @_guarded(lambda self, connector_output: None)
    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Release store sources once every worker reported the event."""
        for rid in getattr(connector_output, "finished_recving", None) or ():
            pins = self.load_pins.pop(rid, None)
            if pins and self.block_pool is not None:
                self.block_pool.free_blocks(pins)
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if not isinstance(meta, UMBPConnectorWorkerMetadata):
            return
        self._quarantine_failed(meta.failed_loads)
        for h in meta.repaired_loads:  # stored again, valid: a hit again
            self.quarantine.pop(h, None)
        for rid in meta.failed_requests:
            st = self.requests.get(rid)
            if st is not None:
                st.load_failed = True
        for rid in meta.sync_failed_requests:
            self._uncache_failed_sync_load(rid)
        if meta.layer_loads_off and self.workers_load_by_layer:
            self.workers_load_by_layer = False  # large hits load async again
            log.warning(
                "umbp-redis: a worker turned loads by layer off; loads over "
                "sync_load_max_bytes run async again"
            )
        if self.kv_events:
            for eid, res in meta.store_results.items():
                self._note_store_report(eid, res.finished_workers, bool(res.failed_keys))
            if meta.removed_blocks:
                for h in meta.removed_blocks:
                    for g in self.groups:
                        self._announced.pop((h, g), None)  # stored again: announce again
                from vllm.distributed.kv_events import BlockRemoved
                from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

                self._kv_events.append(
                    BlockRemoved(
                        block_hashes=[maybe_convert_block_hash(h) for h in meta.removed_blocks],  # type: ignore[arg-type]
                        medium=KV_EVENTS_MEDIUM,
                    )
                )
        for eid, res in meta.store_results.items():
            ev = self.pinned.get(eid)
            if ev is None:
                continue
            ev.reports += res.finished_workers
            if ev.reports >= self.num_workers:
                self._release(eid)

    def _uncache_failed_sync_load(self, rid: str) -> None:
        """Take a request's blocks from its failed sync load on out of vLLM's prefix
        cache. vLLM cached them, and the blocks the same step computed after them, before
        the load ran; it rolls the request back to recompute them but keeps them cached
        meanwhile, so a request that hit them before the recompute (or after the request
        was aborted) would read KV that is not theirs."""
        st = self.requests.get(rid)
        pool = self.block_pool
        if st is None or pool is None or not st.tracker.block_ids:
            return
        ids = {b for g in self.groups for b in st.tracker.block_ids[g][st.sync_load_from :]}
        pool.evict_blocks(ids)
        self.sync_load_uncached += len(ids)

    def _release(self, eid: int) -> None:
        ev = self.pinned.pop(eid)
        if self.block_pool is not None:
            self.block_pool.free_blocks(ev.blocks)

    def _finished_fallback(self, request: Request) -> tuple[bool, None]:
        self.requests.pop(getattr(request, "request_id", None), None)  # type: ignore[arg-type]
        return False, None

    @_guarded(_finished_fallback)
    def request_finished(self, request: Request) -> tuple[bool, None]:
        """Forget the request; never delays freeing its blocks (in lazy store mode, its
        blocks may stay pinned until stored, see ``_pin_finishing``)."""
        st = self.requests.pop(request.request_id, None)
        if st is not None and st.store_hold > 0:
            self._plan_ended_held_stores(st, request)
        if self.lazy and st is not None and self._lazy_candidates:
            self._pin_finishing(st)
        self._lookups.pop(request.request_id, None)
        return False, None

    def _plan_ended_held_stores(self, st: _RequestState, request: Request) -> None:
        """Plan, for the next step, the held stores of a request that ended before its
        hold did (see ``_plan_step``; e.g. a prompt with one output token).

        vLLM sets a stop status only while it applies a step's output, after it has
        rolled back every request whose load failed: a request stopped that way loaded
        right on every rank, so its blocks are stored (pinned until reported). One that
        ended otherwise (aborted, failed) may not have, and stores nothing."""
        if getattr(getattr(request, "status", None), "name", "") not in _STOPPED_BY_OUTPUT:
            return
        if not self.can_store or self.codec is None:
            return
        self._plan_stores(st, request.num_computed_tokens, 0, self._ended_held_stores)

    @_guarded(lambda self: False)
    def has_pending_block_frees(self) -> bool:
        """Whether a pending report will return blocks to the free pool.

        True when some block is held by this connector's pins alone (its request has
        finished or was preempted while its store or load was in flight): vLLM then
        waits a step for the report instead of preempting a running request.
        """
        pinned = itertools.chain(
            (b for ev in self.pinned.values() for b in ev.blocks),
            (b for pins in self.load_pins.values() for b in pins),
            (b for _, _, b, _ in self._lazy_early),
        )
        return any(getattr(b, "ref_cnt", 0) == 1 for b in pinned)

    @property
    def pinned_blocks(self) -> int:
        """Blocks held for in-flight stores (0 when idle)."""
        return (
            sum(len(e.blocks) for e in self.pinned.values())
            + sum(len(p) for p in self.load_pins.values())
            + len(self._lazy_early)
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
        early, self._lazy_early = self._lazy_early, []
        if early and self.block_pool is not None:
            self.block_pool.free_blocks([b for _, _, b, _ in early])
        for rid in list(self.load_pins):
            pins = self.load_pins.pop(rid)
            if self.block_pool is not None:
                self.block_pool.free_blocks(pins)
