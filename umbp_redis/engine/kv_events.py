"""KV cache events of the blocks this connector keeps in Redis, for routers.

Active only with vLLM's ``--kv-events-config``. A store event's blocks are announced
(``BlockStored``) once every worker reported the event and none failed; values found
missing, or invalid and deleted, are announced removed (``BlockRemoved``, one event per
cache group). Both say ``locality="REMOTE"`` (a tier shared by the fleet, not this
engine's memory), the medium ``REDIS`` and ``ownership="umbp-redis"`` (routers such as
vllm-router score a block with an ownership as an external tier, below the engine's own
memory). A store event carries what a router needs to
index the block as vLLM's own block pool publishes it: token ids, parent hash, block
size, the LoRA, the extra keys of the block's hash (LoRA name, multimodal identifiers,
``cache_salt``, prompt-embedding digests, untagged as vLLM publishes them), the cache
group and its spec kind and sliding window. A block stored again within
``ANNOUNCE_WINDOW_S`` is not announced again, unless it was announced removed since.
With a ``FleetBlockFeed`` the same announcements go to the namespace's other engines,
and theirs come back as this engine's events (see ``umbp_redis.engine.fleet_blocks``).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from umbp_redis.engine.fleet_blocks import FleetBlockFeed

# The "medium" of this connector's KV cache events.
KV_EVENTS_MEDIUM = "REDIS"
# Where the blocks are, relative to the engine publishing the events: shared, not its own.
KV_EVENTS_LOCALITY = "REMOTE"
# The tier the events name: routers credit a block with an ownership as external.
KV_EVENTS_OWNERSHIP = "umbp-redis"
# A block stored again within this many seconds is not announced again.
ANNOUNCE_WINDOW_S = 60.0
# Store events whose blocks are kept for their KV cache event at most, and blocks whose
# last announcement is remembered at most.
MAX_TRACKED_STORE_EVENTS = 16384


@dataclass(frozen=True)
class EventBlock:
    """A stored block's KV cache event data, taken from its request when planned."""

    block_hash: bytes
    parent_hash: bytes | None
    token_ids: tuple[int, ...]
    group: int
    extra_keys: tuple[Any, ...] | None = None  # untagged, as vLLM publishes them
    lora_id: int | None = None
    lora_name: str | None = None


@dataclass(frozen=True)
class GroupSpecInfo:
    """What a KV cache event says about a cache group's spec."""

    kind: str | None
    sliding_window: int | None


def group_spec_infos(kv_cache_groups: Sequence[Any]) -> dict[int, GroupSpecInfo]:
    """Each cache group's spec kind and sliding window, as vLLM's events name them."""
    from vllm.v1.kv_cache_interface import (
        get_kv_cache_spec_kind,
        get_kv_cache_spec_sliding_window,
    )

    return {
        g: GroupSpecInfo(
            get_kv_cache_spec_kind(group.kv_cache_spec).value,
            get_kv_cache_spec_sliding_window(group.kv_cache_spec),
        )
        for g, group in enumerate(kv_cache_groups)
    }


def event_blocks(
    request: Request,
    hash_of_block: Callable[[int], bytes | None],
    block_size: int,
    hashes: Sequence[bytes],
    indices: Sequence[int],
    group_ids: Sequence[int],
) -> list[EventBlock]:
    """The event data of blocks ``indices`` of ``request`` (``hash_of_block(i)``: the
    hash of its block ``i``), with the extra keys vLLM hashed into each block."""
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, to_event_extra_keys

    lora = request.lora_request
    lora_id = lora.adapter_id if lora is not None else None
    lora_name = lora.name if lora is not None else None
    token_ids = request.all_token_ids
    extra_of: dict[int, tuple[Any, ...] | None] = {}
    mm_index = 0
    for i in sorted(set(indices)):
        keys, mm_index = generate_block_hash_extra_keys(
            request, i * block_size, (i + 1) * block_size, mm_index
        )
        published = to_event_extra_keys([keys]) if keys is not None else None
        extra_of[i] = published[0] if published else None
    out = []
    for h, i, g in zip(hashes, indices, group_ids, strict=True):
        parent = hash_of_block(i - 1) if i > 0 else None
        out.append(
            EventBlock(
                h,
                parent,
                tuple(token_ids[i * block_size : (i + 1) * block_size]),
                g,
                extra_of[i],
                lora_id,
                lora_name,
            )
        )
    return out


def stored_event(block: EventBlock, block_size: int, spec: GroupSpecInfo) -> Any:
    """The ``BlockStored`` event of one block in Redis."""
    from vllm.distributed.kv_events import BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    return BlockStored(
        block_hashes=[maybe_convert_block_hash(block.block_hash)],  # type: ignore[arg-type]
        parent_block_hash=(
            maybe_convert_block_hash(block.parent_hash)  # type: ignore[arg-type]
            if block.parent_hash is not None
            else None
        ),
        token_ids=list(block.token_ids),
        block_size=block_size,
        lora_id=block.lora_id,
        medium=KV_EVENTS_MEDIUM,
        lora_name=block.lora_name,
        extra_keys=[block.extra_keys],
        group_idx=block.group,
        kv_cache_spec_kind=spec.kind,
        kv_cache_spec_sliding_window=spec.sliding_window,
        locality=KV_EVENTS_LOCALITY,
        ownership=KV_EVENTS_OWNERSHIP,
    )


def removed_event(hashes: Sequence[bytes], group: int) -> Any:
    """The ``BlockRemoved`` event of blocks of one cache group gone from Redis."""
    from vllm.distributed.kv_events import BlockRemoved
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    return BlockRemoved(
        block_hashes=[maybe_convert_block_hash(h) for h in hashes],  # type: ignore[arg-type]
        medium=KV_EVENTS_MEDIUM,
        group_idx=group,
        locality=KV_EVENTS_LOCALITY,
        ownership=KV_EVENTS_OWNERSHIP,
    )


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
        group_specs: Mapping[int, GroupSpecInfo] | None = None,
        *,
        feed: FleetBlockFeed | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.block_size = block_size
        self.num_workers = num_workers
        self.group_specs = dict(group_specs or {})
        self.feed = feed
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
        and none failed, its blocks are in Redis on every rank: announce them (to the
        fleet too, with a feed)."""
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
        now = self._clock()
        announced = []
        for b in info.blocks:
            key = (b.block_hash, b.group)
            seen = self._announced.get(key)
            if (
                seen is not None
                and now - seen < ANNOUNCE_WINDOW_S
                and (self.feed is None or self.feed.credits(key))
            ):
                continue
            self._announced[key] = now
            self._announced.move_to_end(key)
            while len(self._announced) > MAX_TRACKED_STORE_EVENTS:
                self._announced.popitem(last=False)
            spec = self.group_specs.get(b.group, GroupSpecInfo(None, None))
            self._events.append(stored_event(b, self.block_size, spec))
            announced.append(b)
        if self.feed is not None and announced:
            self.feed.announce_stored(announced)

    def note_removed(self, hashes: Sequence[bytes], groups: Sequence[int]) -> None:
        """Announce blocks whose values were found missing, or invalid and deleted (one
        event per group of ``groups``; to the fleet too, with a feed); a block stored
        again afterwards is announced again."""
        if not hashes:
            return
        for h in hashes:
            for g in groups:
                self._announced.pop((h, g), None)
        self._events.extend(removed_event(hashes, g) for g in groups)
        if self.feed is not None:
            self.feed.announce_removed(hashes, groups)

    def take(self) -> list[Any]:
        """The events since the last call: this engine's, then the fleet's (with a feed)."""
        events, self._events = self._events, []
        if self.feed is not None:
            events += self.feed.take()
        return events
