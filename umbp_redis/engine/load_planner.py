"""Load planning: the load batches of the hits vLLM accepted, for the next step."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

from umbp_redis.data import BlockLoadBatch, CacheGroupPlans
from umbp_redis.engine.load_policy import LoadPolicy
from umbp_redis.engine.pins import BlockPins
from umbp_redis.engine.request_state import BlockHashing, RequestState

if TYPE_CHECKING:
    from vllm.v1.request import Request


class LoadPlanner:
    """Turns each accepted hit into a load batch for the next step's metadata.

    An async load's destination blocks stay pinned until the load is done, even if its
    request is aborted meanwhile; a sync load remembers where it started, so a failed
    one can be taken out of vLLM's prefix cache (``uncache_failed_sync_load``).
    """

    def __init__(
        self,
        group_plans: CacheGroupPlans,
        hashing: BlockHashing,
        policy: LoadPolicy,
        pins: BlockPins,
        event_ids: itertools.count[int],
    ) -> None:
        self.group_plans = group_plans
        self.hashing = hashing
        self.policy = policy
        self.pins = pins
        self.event_ids = event_ids
        self.pending: list[BlockLoadBatch] = []
        self.uncached_blocks = 0  # blocks taken from vLLM's cache after failed sync loads

    def take(self) -> list[BlockLoadBatch]:
        """The batches planned since the last call."""
        batches, self.pending = self.pending, []
        return batches

    def load_targets(self, blocks: Any, first: int, last: int) -> list[tuple[int, int, int]]:
        """(block index, group, engine block id) of the blocks a hit over blocks
        ``[first, last)`` loads, in block order: every group's blocks its reach needs
        (a sliding window only the blocks before ``last``), never vLLM's null block."""
        ids = blocks.get_block_ids()
        kv_blocks = blocks.blocks
        needed = [(r.group_id, r.needed(last, first)) for r in self.group_plans.groups]
        out = []
        for i in range(first, last):
            for g, wanted in needed:
                if i not in wanted or i >= len(ids[g]):
                    continue
                if kv_blocks[g][i].is_null:
                    continue
                out.append((i, g, ids[g][i]))
        return out

    def plan(self, st: RequestState, request: Request, blocks: Any, tokens: int) -> None:
        """Plan the load of the ``tokens`` hit tokens after ``st.local_tokens`` into
        ``blocks`` (vLLM's allocation for the request)."""
        bs = self.hashing.block_size
        first = st.local_tokens // bs
        last = (st.local_tokens + tokens) // bs
        hashes, block_ids, group_ids = [], [], []
        for i, g, block_id in self.load_targets(blocks, first, last):
            h = self.hashing.hash_of(request, i)
            if h is None:
                break
            hashes.append(h)
            block_ids.append(block_id)
            group_ids.append(g)
        self.pending.append(
            BlockLoadBatch(
                request.request_id,
                tuple(hashes),
                tuple(block_ids),
                tuple(group_ids),
                event_id=next(self.event_ids),
                load_async=st.load_async,
            )
        )
        if st.load_async:
            self.pins.pin_load(request.request_id, block_ids)
        else:
            self._note_sync_load(st, request, first)
        st.tracker.num_loaded_tokens = tokens

    def plan_failed(self, st: RequestState, request: Request, blocks: Any, tokens: int) -> None:
        """Plan a load whose every block fails: vLLM was promised ``tokens`` that cannot
        be loaded, and recomputes their blocks."""
        bs = self.hashing.block_size
        first = st.local_tokens // bs
        block_ids = tuple(
            b for _, _, b in self.load_targets(blocks, first, (st.local_tokens + tokens) // bs)
        )
        self.pending.append(
            BlockLoadBatch(
                request.request_id,
                (b"",) * len(block_ids),
                block_ids,
                (0,) * len(block_ids),
                event_id=next(self.event_ids),
                fail_all=True,
                load_async=st.load_async,
            )
        )
        if not st.load_async:
            self._note_sync_load(st, request, first)

    @staticmethod
    def _note_sync_load(st: RequestState, request: Request, first: int) -> None:
        """Remember where a sync load starts and how many tokens the request had output
        then (see ``uncache_unconfirmed_sync_load``)."""
        st.sync_load_from = first
        st.sync_load_outputs = request.num_output_tokens

    def uncache_unconfirmed_sync_load(
        self, st: RequestState, request: Request, groups: list[int]
    ) -> list[bytes]:
        """At a request's end: where it output no token since its last sync load was
        planned, vLLM has not applied that load's outcome (an abort before the step's
        output came back); take the load's blocks out of vLLM's prefix cache, as a failed
        load's, since they may hold bytes that are not their KV. Returns the hashes of the
        blocks it loaded (none when the load was confirmed), for the quarantine: a failed
        load's values may be gone from Redis while their markers are not yet."""
        if st.sync_load_outputs is None:
            return []
        if request.num_output_tokens > st.sync_load_outputs:
            return []
        self.uncache_failed_sync_load(st, groups)
        first = st.sync_load_from
        last = first + st.tracker.num_loaded_tokens // self.hashing.block_size
        return [h for i in range(first, last) if (h := self.hashing.hash_of(request, i))]

    def uncache_failed_sync_load(self, st: RequestState, groups: list[int]) -> None:
        """Take a request's blocks from its failed sync load on out of vLLM's prefix
        cache. vLLM cached them, and the blocks the same step computed after them, before
        the load ran; it rolls the request back to recompute them but keeps them cached
        meanwhile, so a request that hit them before the recompute (or after the request
        was aborted) would read KV that is not theirs."""
        pool = self.pins.block_pool
        if pool is None or not st.tracker.block_ids:
            return
        ids = {b for g in groups for b in st.tracker.block_ids[g][st.sync_load_from :]}
        pool.evict_blocks(ids)
        self.uncached_blocks += len(ids)
