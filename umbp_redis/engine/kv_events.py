"""KV cache events of the blocks this connector keeps in Redis, for routers.

Active only with vLLM's ``--kv-events-config``. A store event's blocks are announced
(``BlockStored``) once every worker reported the event and none failed; values found
missing, or invalid and deleted, are announced removed (``BlockRemoved``). Both carry
the medium ``REDIS``. A block stored again within ``ANNOUNCE_WINDOW_S`` is not
announced again.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

# The "medium" of this connector's KV cache events.
KV_EVENTS_MEDIUM = "REDIS"
# A block stored again within this many seconds is not announced again.
ANNOUNCE_WINDOW_S = 60.0
# Store events whose blocks are kept for their KV cache event at most, and blocks whose
# last announcement is remembered at most.
MAX_TRACKED_STORE_EVENTS = 16384

# A block's KV cache event data: hash, parent hash, token ids, cache group.
EventBlock = tuple[bytes, bytes | None, list[int], int]


def event_blocks(
    token_ids: Sequence[int],
    hash_of_block: Callable[[int], bytes | None],
    block_size: int,
    hashes: Sequence[bytes],
    indices: Sequence[int],
    group_ids: Sequence[int],
) -> list[EventBlock]:
    """The event data of blocks ``indices`` of a request (``hash_of_block(i)``: the hash
    of its block ``i``)."""
    out = []
    for h, i, g in zip(hashes, indices, group_ids, strict=True):
        parent = hash_of_block(i - 1) if i > 0 else None
        out.append((h, parent, list(token_ids[i * block_size : (i + 1) * block_size]), g))
    return out


@dataclass
class _PendingStore:
    """A store event's blocks, waiting for every worker's report."""

    blocks: list[EventBlock]
    reports: int = 0
    failed: bool = False


class StoredBlockEvents:
    """BlockStored / BlockRemoved events of the blocks stored in Redis, until taken."""

    def __init__(
        self,
        block_size: int,
        num_workers: int,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.block_size = block_size
        self.num_workers = num_workers
        self._clock = clock
        self._pending: OrderedDict[int, _PendingStore] = OrderedDict()
        # (block hash, group) -> when announced.
        self._announced: OrderedDict[tuple[bytes, int], float] = OrderedDict()
        self._events: list[Any] = []

    def track(self, event_id: int, blocks: list[EventBlock]) -> None:
        """Keep a store event's blocks until its reports are in (the oldest are forgotten
        beyond ``MAX_TRACKED_STORE_EVENTS``)."""
        self._pending[event_id] = _PendingStore(blocks)
        while len(self._pending) > MAX_TRACKED_STORE_EVENTS:
            self._pending.popitem(last=False)

    def note_store_report(self, event_id: int, finished: int, failed: bool) -> None:
        """Count ``finished`` worker reports of a store event; once every worker reported
        and none failed, its blocks are in Redis on every rank: announce them."""
        info = self._pending.get(event_id)
        if info is None:
            return
        info.reports += finished
        info.failed |= failed
        if info.reports < self.num_workers:
            return
        del self._pending[event_id]
        if info.failed:
            return
        from vllm.distributed.kv_events import BlockStored
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        now = self._clock()
        for h, parent, tokens, g in info.blocks:
            seen = self._announced.get((h, g))
            if seen is not None and now - seen < ANNOUNCE_WINDOW_S:
                continue
            self._announced[(h, g)] = now
            self._announced.move_to_end((h, g))
            while len(self._announced) > MAX_TRACKED_STORE_EVENTS:
                self._announced.popitem(last=False)
            self._events.append(
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

    def note_removed(self, hashes: Sequence[bytes], groups: Sequence[int]) -> None:
        """Announce blocks whose values were found missing, or invalid and deleted; a
        block stored again afterwards is announced again."""
        if not hashes:
            return
        for h in hashes:
            for g in groups:
                self._announced.pop((h, g), None)
        from vllm.distributed.kv_events import BlockRemoved
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        self._events.append(
            BlockRemoved(
                block_hashes=[maybe_convert_block_hash(h) for h in hashes],  # type: ignore[arg-type]
                medium=KV_EVENTS_MEDIUM,
            )
        )

    def take(self) -> list[Any]:
        """The events since the last call."""
        events, self._events = self._events, []
        return events
