"""Lazy store mode (``store_mode: lazy``): blocks are stored when vLLM is about to
evict them, not after the step that computed them.

Blocks computed here that Redis does not hold are remembered as candidates. Each step
walks vLLM's free queue from its head (the next block it reuses) and stores the
candidates among the next ``window`` blocks it would evict; a finishing request's
candidates are pinned at once when the free queue is shorter than that.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from umbp_redis.data import UMBPConnectorMetadata
from umbp_redis.engine.kv_events import EventBlock

# The request id of lazy store batches.
LAZY_REQUEST_ID = "umbp-lazy-offload"
# Candidate blocks remembered per KV cache block and group (the oldest are forgotten:
# not stored).
LAZY_CANDIDATES_PER_BLOCK = 2


class EmitStore(Protocol):
    """Adds one store batch to a step's metadata, its source blocks pinned."""

    def __call__(
        self,
        meta: UMBPConnectorMetadata,
        request_id: str,
        hashes: list[bytes],
        block_ids: list[int],
        group_ids: list[int],
        event_data: list[EventBlock] | None,
        pinned: list[Any] | None = None,
    ) -> None: ...


class LazyStorePlanner:
    """Candidate blocks, and the stores of those vLLM is about to evict."""

    def __init__(
        self,
        groups: Sequence[int],
        block_size: int,
        num_blocks: int,
        step_tokens: int,
        step_seqs: int,
        with_events: bool,
    ) -> None:
        self.groups = list(groups)
        self.with_events = with_events
        self._candidates: OrderedDict[tuple[bytes, int], EventBlock | None] = OrderedDict()
        self._max = max(1024, LAZY_CANDIDATES_PER_BLOCK * num_blocks * len(self.groups))
        # Blocks one step can take from the free queue at most: a full batch of new
        # tokens in every group, plus one block per running request.
        self.window = len(self.groups) * -(-step_tokens // block_size) + step_seqs
        self.blocks_stored = 0  # blocks pinned for a lazy store so far
        # Blocks of finished requests pinned for the next step's store, with their
        # (hash, group) and event data.
        self.early: list[tuple[bytes, int, Any, EventBlock | None]] = []

    def remember(
        self, hashes: list[bytes], group_ids: list[int], event_data: list[EventBlock] | None
    ) -> None:
        """Blocks computed this step, to store once vLLM is about to evict them."""
        cands = self._candidates
        for n, (h, g) in enumerate(zip(hashes, group_ids, strict=True)):
            cands[(h, g)] = event_data[n] if event_data is not None else None
            cands.move_to_end((h, g))
        while len(cands) > self._max:
            cands.popitem(last=False)

    @property
    def has_candidates(self) -> bool:
        """Whether any block waits for its lazy store."""
        return bool(self._candidates)

    def plan(self, meta: UMBPConnectorMetadata, pool: Any, emit: EmitStore) -> None:
        """Store the candidate blocks among the next ``window`` blocks vLLM evicts.

        Walks vLLM's free queue from its head and pins every cached block that is a
        candidate; pinned blocks leave the queue, so the walk goes on until ``window``
        blocks that are safe to evict (never cached, or already in Redis) lie ahead of
        the rest. One step takes at most that many blocks from the queue, so no
        candidate is evicted before its store is planned. Pins are released by the
        store's reports (the blocks rejoin the queue, still cached).
        """
        cands = self._candidates
        early, self.early = self.early, []
        if early:
            emit(
                meta,
                LAZY_REQUEST_ID,
                [h for h, _, _, _ in early],
                [b.block_id for _, _, b, _ in early],
                [g for _, g, _, _ in early],
                [d for _, _, _, d in early if d is not None] if self.with_events else None,
                pinned=[b for _, _, b, _ in early],
            )
        if pool is None or not cands:
            return
        hashes: list[bytes] = []
        block_ids: list[int] = []
        group_ids: list[int] = []
        event_data: list[EventBlock] = []
        safe = 0
        for block in pool.free_block_queue.iter_blocks_after(None):
            if safe >= self.window:
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
        self.blocks_stored += len(hashes)
        emit(
            meta,
            LAZY_REQUEST_ID,
            hashes,
            block_ids,
            group_ids,
            event_data if self.with_events and len(event_data) == len(hashes) else None,
        )

    def pin_finishing(
        self,
        pool: Any,
        block_ids: Sequence[Sequence[int]],
        hash_of_block: Callable[[int], bytes | None],
    ) -> None:
        """Pin the candidate blocks of a finishing request (``block_ids`` per group,
        ``hash_of_block(i)`` its block hashes) when vLLM's free queue is shorter than
        ``window``: freed, they would lie within reach of the next step's allocations
        before the next walk sees them. Stored with the next step."""
        if pool is None or pool.get_num_free_blocks() >= self.window:
            return
        cands = self._candidates
        picked = []
        for g in self.groups:
            ids = block_ids[g] if block_ids else []
            for i, bid in enumerate(ids):
                h = hash_of_block(i)
                if h is None:
                    break
                if (h, g) in cands and not pool.blocks[bid].is_null:
                    picked.append((h, g, pool.blocks[bid], cands.pop((h, g))))
        if picked:
            pool.touch([b for _, _, b, _ in picked])
            self.blocks_stored += len(picked)
            self.early.extend(picked)

    def release_early(self, pool: Any) -> None:
        """Unpin the finished requests' blocks not stored yet (shutdown)."""
        early, self.early = self.early, []
        if early and pool is not None:
            pool.free_blocks([b for _, _, b, _ in early])
