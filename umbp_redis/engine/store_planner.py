"""Store planning: which blocks a step's requests computed that Redis lacks, as store
batches whose source blocks stay pinned until every worker reported them."""

from __future__ import annotations

import itertools
from typing import Any

from umbp_redis.data import BlockStoreBatch, CacheGroupPlans, UMBPConnectorMetadata
from umbp_redis.engine.block_markers import StoredMarkers
from umbp_redis.engine.kv_events import EventBlock, StoredBlockEvents, event_blocks
from umbp_redis.engine.lazy_store import LazyStorePlanner
from umbp_redis.engine.pins import BlockPins
from umbp_redis.engine.request_state import BlockHashing, RequestState


class StorePlanner:
    """Plans each scheduled request's stores after the step that computes its blocks
    (``store_mode: eager``), or hands them to ``lazy`` as candidates (lazy mode).

    A block goes out at most once per step across requests; blocks Redis or vLLM's
    local cache already holds are not sent again, except for groups that keep only
    some blocks and lack them. With ``events``, each batch's blocks are announced once
    stored on every rank, and ``markers`` gets each batch's blocks to mark once stored on
    every rank. With ``admission`` only the blocks a lookup admitted
    (``st.admitted_blocks``) are stored; a request no lookup counted stores none.
    """

    def __init__(
        self,
        groups: list[int],
        group_plans: CacheGroupPlans,
        hashing: BlockHashing,
        pins: BlockPins,
        event_ids: itertools.count[int],
        *,
        save_decode: bool,
        events: StoredBlockEvents | None,
        lazy: LazyStorePlanner | None,
        admission: bool = False,
        markers: StoredMarkers | None = None,
    ) -> None:
        self.groups = groups
        self.group_plans = group_plans
        self.hashing = hashing
        self.pins = pins
        self.event_ids = event_ids
        self.save_decode = save_decode
        self.events = events
        self.lazy = lazy
        self.admission = admission
        self.markers = markers
        # (block hash, group) already in this step's stores.
        self._planned_this_step: set[tuple[bytes, int]] = set()

    def start_step(self) -> None:
        """Forget the previous step's planned blocks."""
        self._planned_this_step.clear()

    def plan_request(
        self,
        st: RequestState,
        computed_before: int,
        scheduled: int,
        meta: UMBPConnectorMetadata,
    ) -> None:
        """Plan the stores of the blocks ``st``'s request completes in a step that
        computes ``scheduled`` tokens after ``computed_before``."""
        req = st.request
        tokens_after_step = computed_before + scheduled
        bs = self.hashing.block_size
        tr = st.tracker
        # Blocks counted as in Redis (hit or loaded) that vLLM computes again now failed
        # to load (invalid or evicted value): this engine stores them afresh.
        redo_from = computed_before // bs
        if scheduled > 0 and redo_from < max(st.known_stored_blocks, tr.num_loaded_tokens // bs):
            st.known_stored_blocks = min(st.known_stored_blocks, redo_from)
            tr.num_loaded_tokens = min(tr.num_loaded_tokens, redo_from * bs)
            tr.num_saved_tokens = min(tr.num_saved_tokens, redo_from * bs)
        limit = (
            tokens_after_step if self.save_decode else min(tokens_after_step, req.num_prompt_tokens)
        )
        first = tr.num_saved_tokens // bs
        last = limit // bs
        if self.admission:
            last = min(last, st.admitted_blocks or 0)
        # Blocks loaded from Redis or seen present in a lookup are not sent again.
        skip_below = max(st.known_stored_blocks, tr.num_loaded_tokens // bs)
        hashes, block_ids, group_ids, indices = [], [], [], []
        saved_to = first
        # Groups that keep only the blocks before hit points: the prompt's end (the same
        # prompt, or a conversation continuing it) and where it left Redis's prefix.
        hit_points = {(req.num_prompt_tokens - 1) // bs, req.num_prompt_tokens // bs}
        if 0 < st.divergence:
            hit_points.add(st.divergence)
        kept = [
            None if r.stores_all() else set(r.stored(range(first, last), hit_points))
            for r in self.group_plans.groups
        ]
        pool = self.pins.block_pool
        null_id = pool.null_block.block_id if pool is not None else None
        for i in range(first, last):
            h = self.hashing.hash_of(req, i)
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
        event_data = None
        if self.events is not None:
            event_data = event_blocks(
                req,
                lambda i: self.hashing.hash_of(req, i),
                bs,
                hashes,
                indices,
                group_ids,
            )
        if self.lazy is not None:
            self.lazy.remember(hashes, group_ids, event_data)
            return
        self.emit(meta, req.request_id, hashes, block_ids, group_ids, event_data)

    def emit(
        self,
        meta: UMBPConnectorMetadata,
        request_id: str,
        hashes: list[bytes],
        block_ids: list[int],
        group_ids: list[int],
        event_data: list[EventBlock] | None,
        pinned: list[Any] | None = None,
    ) -> None:
        """One store batch into ``meta``, its source blocks pinned until reported
        (``pinned``: blocks the caller already pinned, one per block id)."""
        event = next(self.event_ids)
        meta.stores.append(
            BlockStoreBatch(
                request_id, tuple(hashes), tuple(block_ids), tuple(group_ids), event_id=event
            )
        )
        if event_data is not None and self.events is not None:
            self.events.track(event, event_data)
        if self.markers is not None:
            self.markers.track(event, hashes, group_ids)
        self.pins.pin_store(event, block_ids, pinned)
