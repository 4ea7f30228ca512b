"""Prefix lookups: how many of a request's prompt blocks Redis holds, in one round trip.

A lookup reads one key per (block, cache group) whatever the parallelism: the block's
stored marker (``StoredMarkers``), written once every rank's value was stored. Keys and
their encoded lookup commands are built once per block hash and kept with the request;
a lookup covers the whole prefix chain the request relies on (blocks the engine's own
prefix cache holds included), so every request that shares a prefix refreshes it in
Redis (TTL or LRU clock: the marker at once, its values on the marker writer's thread)
and LRU eviction takes unshared suffixes first.
With a store admission rule (``store_after_requests`` above 1) a request's first lookup
also counts it against every block of its prompt, in the same round trip.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from umbp_redis.data import BlockIdentityCodec, CacheGroupPlans
from umbp_redis.engine.quarantine import LoadQuarantine
from umbp_redis.engine.request_state import BlockHashing, RequestState
from umbp_redis.engine.stats import StatsRecorder
from umbp_redis.store.deployment import DataPlane

# Told of the leading blocks an answered lookup found: (codec, how many, block -> its
# hash, the groups, (block, group position) -> whether Redis holds it).
FoundBlocksCallback = Callable[
    [BlockIdentityCodec, int, Callable[[int], bytes | None], list[int], Callable[[int, int], bool]],
    None,
]


class PrefixLookup:
    """Answers which prefix blocks of a request every rank's value was stored for.

    With ``lookup_async`` the lookup runs on a thread of its own: the first call for a
    request state starts it and answers None (ask again), a later call with the same
    state returns its answer. Blocks in ``quarantine`` end a hit. ``on_found`` hears
    of the leading blocks every answer found (the marker writer refreshes their values).

    With ``admit_after`` above 1 the first lookup of a request also increments each of
    its prompt blocks' request counter and records in ``st.admitted_blocks`` the leading
    blocks asked for by at least ``admit_after`` requests (0 when that lookup failed),
    and every lookup records in ``st.redis_prefix_blocks`` the leading blocks Redis
    holds, the engine's own included (the rule leaves some of those out of Redis).
    """

    def __init__(
        self,
        plane: DataPlane,
        groups: list[int],
        group_plans: CacheGroupPlans,
        hashing: BlockHashing,
        quarantine: LoadQuarantine,
        stats: StatsRecorder,
        *,
        refresh_ttl: bool,
        lookup_async: bool,
        admit_after: int = 1,
        on_found: FoundBlocksCallback | None = None,
    ) -> None:
        self.plane = plane
        self.groups = groups
        self.group_plans = group_plans
        self.hashing = hashing
        self.quarantine = quarantine
        self.stats = stats
        self.refresh_ttl = refresh_ttl
        self.admit_after = admit_after
        self.on_found = on_found
        self._pool = (
            ThreadPoolExecutor(1, thread_name_prefix="umbp-lookup") if lookup_async else None
        )
        # Per request: (signature, lookup in flight, whether it counts the request).
        self._pending: dict[str, tuple[tuple[Any, ...], Future[list[int] | None], bool]] = {}
        # Per hash length: the codec and lookup mode it was built for, and the encoders.
        self._encoders: dict[int, tuple[BlockIdentityCodec, str, Any]] = {}
        # Per hash length: the codec and lookup mode of the request-count encoder.
        self._count_encoders: dict[int, tuple[BlockIdentityCodec, str, Any]] = {}

    def hit_blocks(
        self, st: RequestState, num_computed_tokens: int, codec: BlockIdentityCodec
    ) -> int | None:
        """Blocks [0, n) of the request's prompt (its last token excluded) whose every
        rank key exists for every group that needs them: n, or None while an async
        lookup runs. Records what the groups that keep only some blocks lack in
        ``st.absent`` and where the prompt left Redis's prefix in ``st.divergence``."""
        request = st.request
        bs = self.hashing.block_size
        max_blocks = (request.num_prompt_tokens - 1) // bs  # the last token is computed
        start = num_computed_tokens // bs
        cmds = self._commands(st, codec, max_blocks)
        n_blocks = len(cmds) // len(self.groups)
        if n_blocks <= start:
            return 0
        replies_per_block = st.replies_per_block
        count = n_blocks * replies_per_block
        counts = self.admit_after > 1 and st.admitted_blocks is None
        if self._pool is not None:
            sig = (num_computed_tokens, n_blocks)
            entry = self._pending.get(request.request_id)
            if entry is None or entry[0] != sig:
                n_cmds = n_blocks * len(self.groups)
                send = cmds[:n_cmds] + (self._count_commands(st, codec, n_blocks) if counts else [])
                fut = self._pool.submit(self._timed, send, count, n_blocks if counts else 0)
                self._pending[request.request_id] = (sig, fut, counts)
                return None
            if not entry[1].done():
                return None
            replies = entry[1].result()
            counts = entry[2]
        else:
            send = cmds + (self._count_commands(st, codec, n_blocks) if counts else [])
            replies = self._timed(send, count, n_blocks if counts else 0)
        if counts:
            # A request counts itself in its first lookup (again only if an async lookup
            # was superseded before its answer came); a lookup that failed admits nothing.
            asked = replies[count::2] if replies is not None else []
            st.admitted_blocks = next(
                (b for b, c in enumerate(asked) if c < self.admit_after), len(asked)
            )
        if replies is None or len(replies) != count + (2 * n_blocks if counts else 0):
            return 0
        now = self.quarantine.now()
        groups = st.group_replies
        skipped = False

        def in_redis(b: int, pos: int) -> bool:
            first, n, keys = groups[pos]
            at = b * replies_per_block + first
            return sum(replies[at : at + n]) == keys

        def present(b: int, pos: int) -> bool:
            nonlocal skipped
            if not in_redis(b, pos):
                return False
            if now is not None and self.quarantine.holds(self.hashing.hash_of(request, b), now):
                skipped = True
                return False
            return True

        plans = self.group_plans
        if self.on_found is not None or self.admit_after > 1:
            # The leading blocks Redis holds, the engine's own included (one marker a
            # block answers 0 or 1: the first 0, found at C speed).
            if replies_per_block == 1 and plans.all_full:
                head = replies[:n_blocks]
                found = head.index(0) if 0 in head else n_blocks
            else:
                found = plans.full_prefix_end(0, n_blocks, in_redis)
            st.redis_prefix_blocks = found
            if self.on_found is not None and found:
                self.on_found(
                    codec, found, lambda b: self.hashing.hash_of(request, b), self.groups, in_redis
                )
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
        self.quarantine.skips += skipped
        return hit

    def _commands(self, st: RequestState, codec: BlockIdentityCodec, upto: int) -> list[Any]:
        """Encoded lookup commands of blocks [0, upto) (fewer if hashes run out), built
        incrementally: each block's commands are made once for the request's lifetime
        (again after a namespace change or when the plane's lookup mode changes)."""
        mode = self.plane.lookup_mode
        if st.codec is not codec or st.lookup_mode != mode:
            st.lookup_cmds, st.codec, st.lookup_mode = [], codec, mode
            st.group_replies = []
        cmds = st.lookup_cmds
        n_groups = len(self.groups)

        def make(hex_len: int) -> list[Any]:
            return [
                self.plane.lookup_encoder(
                    [codec.marker_prefix(g).encode()],
                    refresh_ttl=self.refresh_ttl,
                    hash_hex_len=hex_len,
                )
                for g in self.groups
            ]

        for hx in self._hashes_hex(st, len(cmds) // n_groups, upto):
            encoders = self._cached(self._encoders, codec, mode, len(hx), make)
            cmds.extend(e.encode(hx) for e in encoders)
            if not st.group_replies:
                first = 0
                for e in encoders:  # one marker a group
                    st.group_replies.append((first, e.replies, 1))
                    first += e.replies
                st.replies_per_block = first
        return cmds

    def _count_commands(
        self, st: RequestState, codec: BlockIdentityCodec, n_blocks: int
    ) -> list[Any]:
        """Encoded request counts of blocks [0, n_blocks) of ``st``'s request."""
        prefix = codec.request_count_prefix.encode()
        mode = self.plane.lookup_mode

        def make(hex_len: int) -> Any:
            return self.plane.request_count_encoder(prefix, hash_hex_len=hex_len)

        return [
            self._cached(self._count_encoders, codec, mode, len(hx), make).encode(hx)
            for hx in self._hashes_hex(st, 0, n_blocks)
        ]

    def _hashes_hex(self, st: RequestState, start: int, end: int) -> Iterator[bytes]:
        """The hex of blocks [start, end)'s hashes, up to the first block not hashed yet."""
        for i in range(start, end):
            h = self.hashing.hash_of(st.request, i)
            if h is None:
                return
            yield h.hex().encode()

    @staticmethod
    def _cached(
        cache: dict[int, tuple[BlockIdentityCodec, str, Any]],
        codec: BlockIdentityCodec,
        mode: str,
        hex_len: int,
        make: Callable[[int], Any],
    ) -> Any:
        """What ``make(hex_len)`` builds for hashes of ``hex_len`` hex digits, kept in
        ``cache`` until the codec or the plane's lookup ``mode`` changes."""
        entry = cache.get(hex_len)
        if entry is None or entry[0] is not codec or entry[1] != mode:
            entry = cache[hex_len] = (codec, mode, make(hex_len))
        return entry[2]

    def _timed(self, cmds: list[Any], count: int, counted_blocks: int = 0) -> list[int] | None:
        """The data plane's lookup of ``cmds`` (``count`` lookup replies, then two per
        counted block), its time recorded as ``lookup_s``."""
        t0 = time.perf_counter()
        try:
            if not counted_blocks:
                return self.plane.lookup_blocks(cmds, count)
            return self.plane.lookup_blocks(cmds, count + 2 * counted_blocks, counted_from=count)
        finally:
            self.stats.observe("lookup_s", time.perf_counter() - t0)

    def forget(self, request_id: str) -> None:
        """Drop a finished request's async lookup, if any."""
        self._pending.pop(request_id, None)

    def shutdown(self) -> None:
        """Stop the lookup thread (lookups in flight are cancelled)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
