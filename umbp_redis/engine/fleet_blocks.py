"""The fleet's blocks on this engine's KV event stream, through the namespace's
announcement stream (``umbp_redis.data.announcements``).

A router credits a block only to the engine whose event stream announced it, yet any
engine of a namespace can load any block in Redis. So each engine that publishes KV
cache events also:

- appends the blocks it announces (stored, or found gone) to the namespace's stream,
  trimmed to about ``MAX_STREAM_ENTRIES`` entries and expiring with the values' TTL;
- reads the other engines' entries and turns them into its own ``BlockStored`` /
  ``BlockRemoved`` events (``ownership`` ``umbp-redis``, medium ``REDIS``, locality
  ``REMOTE``), so a router credits every engine with every block at its external rate;
- checks, every ``VERIFY_INTERVAL_S``, that the stored marker of each block it credits
  is still there, and announces removed the blocks whose marker is gone (TTL, eviction,
  ``purge``, a failed load elsewhere): a credit outlives its block by at most that
  interval plus one poll.

A late engine reads the stream from its start (what the trimming left), checks those
blocks' markers once, and announces the ones still there. Blocks credited at once are
bounded (``MAX_CREDITED``: the oldest are announced removed), and so are the appends
and events waiting (more are dropped, counted). All I/O runs on one thread of its own,
each round trip bounded by ``timeout_s``; the scheduler only queues and takes. With
Redis away nothing is announced and nothing waits: a stale credit costs a router a
worse choice, never a wrong token (a load checks each value).

Events reach the router when vLLM publishes the scheduler's events, after each engine
step: an idle engine announces what it learned at its next step.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from umbp_redis.data import BlockIdentityCodec
from umbp_redis.data.announcements import Announcement, announcement_key, parse_announcement
from umbp_redis.engine.kv_events import EventBlock, GroupSpecInfo, removed_event, stored_event
from umbp_redis.store.commands import (
    exists_command,
    expire_command,
    xadd_command,
    xrange_after_command,
)
from umbp_redis.store.deployment import DataPlane

log = logging.getLogger(__name__)

# The stream is trimmed to about this many entries (XADD MAXLEN ~).
MAX_STREAM_ENTRIES = 1 << 16
# Blocks this engine's events credit at once at most; the oldest are announced removed.
MAX_CREDITED = 1 << 16
# Appends and events waiting at most; more are dropped (counted).
MAX_QUEUED = 1 << 16
# Events one engine step publishes at most (about 650 bytes each).
TAKE_MAX = 8192
# How often the stream is read for other engines' entries.
POLL_INTERVAL_S = 0.25
# How often the credited blocks' markers are checked.
VERIFY_INTERVAL_S = 10.0
# A block credited this recently is not checked yet: its marker may still be on its way.
VERIFY_GRACE_S = 2.0
# Entries read, and markers checked, per round trip at most.
BATCH = 4096


class FleetBlockFeed:
    """Announces this engine's blocks to the namespace and relays the others' as events."""

    def __init__(
        self,
        plane: DataPlane,
        codec: BlockIdentityCodec,
        engine_id: str,
        block_size: int,
        group_specs: dict[int, GroupSpecInfo],
        *,
        ttl_s: int,
        timeout_s: float,
        poll_interval_s: float = POLL_INTERVAL_S,
        verify_interval_s: float = VERIFY_INTERVAL_S,
        verify_grace_s: float = VERIFY_GRACE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.plane = plane
        self.codec = codec
        self.engine_id = engine_id
        self.block_size = block_size
        self.group_specs = group_specs
        self.timeout_s = timeout_s
        self.poll_interval_s = poll_interval_s
        self.verify_interval_s = verify_interval_s
        self.verify_grace_s = verify_grace_s
        self._clock = clock
        self._key = announcement_key(codec.namespace).encode()
        self._expire = expire_command(self._key, str(int(ttl_s)).encode())
        self._lock = threading.Condition()
        # (block hash, group) -> when this engine's events credited it.
        self._credited: OrderedDict[tuple[bytes, int], float] = OrderedDict()
        self._appends: deque[Announcement] = deque()
        self._events: deque[Any] = deque()
        self._last_id = b"-"
        self._caught_up = False
        self._next_verify = 0.0
        self._closed = False
        self._thread: threading.Thread | None = None
        self._error_logged = False
        # Counters since startup.
        self.announced = 0  # entries this engine appended
        self.relayed = 0  # other engines' blocks announced stored on this engine's events
        self.removed = 0  # blocks announced removed: gone from Redis, or beyond MAX_CREDITED
        self.failures = 0  # round trips that failed or ended unanswered
        self.dropped = 0  # appends or events dropped: their queue was full

    # -- scheduler side ----------------------------------------------------------------

    def start(self) -> None:
        """Start the feed's thread (reading the stream from its start)."""
        with self._lock:
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._run, name="umbp-fleet", daemon=True)
                self._thread.start()

    @property
    def caught_up(self) -> bool:
        """Whether the stream was read to its end once (later entries are relayed live)."""
        return self._caught_up

    def credits(self, block: tuple[bytes, int]) -> bool:
        """Whether this engine's events credit ``block`` (hash, group) now."""
        with self._lock:
            return block in self._credited

    def announce_stored(self, blocks: Sequence[EventBlock]) -> None:
        """Credit blocks this engine announced stored, and append them to the stream."""
        now = self._clock()
        with self._lock:
            evicted = self._credit_locked([(b.block_hash, b.group) for b in blocks], now)
            self._queue_locked(
                self._appends,
                [
                    Announcement(
                        True,
                        self.engine_id,
                        b.block_hash,
                        b.group,
                        b.parent_hash,
                        b.token_ids,
                        b.extra_keys,
                        b.lora_id,
                        b.lora_name,
                    )
                    for b in blocks
                ],
            )
            self._queue_locked(self._events, evicted)
            self._lock.notify_all()

    def announce_removed(self, hashes: Sequence[bytes], groups: Sequence[int]) -> None:
        """Uncredit blocks this engine announced removed, and append them to the stream."""
        with self._lock:
            for h in hashes:
                for g in groups:
                    self._credited.pop((h, g), None)
            self._queue_locked(
                self._appends,
                [Announcement(False, self.engine_id, h, g) for h in hashes for g in groups],
            )
            self._lock.notify_all()

    def take(self) -> list[Any]:
        """The events about other engines' blocks since the last call, the oldest
        ``TAKE_MAX`` at most (a late engine's backlog goes out over several steps)."""
        with self._lock:
            return [self._events.popleft() for _ in range(min(TAKE_MAX, len(self._events)))]

    def close(self) -> None:
        """Stop the thread after its round trip in progress (appends not sent are lost)."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()

    # -- bookkeeping (held: _lock) ---------------------------------------------------------

    def _queue_locked(self, queue: deque[Any], items: Iterable[Any]) -> None:
        """Append ``items`` to ``queue`` while it has room; count the rest dropped."""
        for item in items:
            if len(queue) >= MAX_QUEUED:
                self.dropped += 1
                continue
            queue.append(item)

    def _credit_locked(self, blocks: Iterable[tuple[bytes, int]], now: float) -> list[Any]:
        """Credit ``blocks``; the removal events of the oldest credits beyond the bound."""
        for blk in blocks:
            self._credited[blk] = now
            self._credited.move_to_end(blk)
        evicted: dict[int, list[bytes]] = {}
        while len(self._credited) > MAX_CREDITED:
            (h, g), _ = self._credited.popitem(last=False)
            evicted.setdefault(g, []).append(h)
        self.removed += sum(len(v) for v in evicted.values())
        return [removed_event(hs, g) for g, hs in evicted.items()]

    # -- feed thread -------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._closed and not self._appends:
                    self._lock.wait(self.poll_interval_s)
                if self._closed:
                    return
                appends = [self._appends.popleft() for _ in range(min(BATCH, len(self._appends)))]
            try:
                if appends:
                    self._append(appends)
                self._read()
                if self._caught_up and self._clock() >= self._next_verify:
                    self._verify()
                    self._next_verify = self._clock() + self.verify_interval_s
            except Exception as e:  # a bug here must never reach the engine
                self.failures += 1
                if not self._error_logged:  # once: the loop would repeat it every poll
                    self._error_logged = True
                    log.error("umbp-redis: the fleet block feed failed (counted hereafter): %r", e)

    def _append(self, items: list[Announcement]) -> None:
        """Append ``items`` to the stream in one round trip, its TTL renewed."""
        cmds = [(self._key, xadd_command(self._key, MAX_STREAM_ENTRIES, a.fields())) for a in items]
        cmds.append((self._key, self._expire))
        replies = self.plane.run_keyed(cmds, timeout=self.timeout_s)
        if replies is None or any(r != 1 for r in replies[:-1]):
            self.failures += 1
        else:
            self.announced += len(items)

    def _read(self) -> None:
        """Read the entries since the last one read (all of them on the first pass,
        their blocks checked before they are credited) and relay the other engines'."""
        while True:
            reply = self.plane.query_keyed(
                self._key,
                xrange_after_command(self._key, self._last_id, BATCH),
                timeout=self.timeout_s,
            )
            if not isinstance(reply, list):
                if reply is None:
                    self.failures += 1
                return
            entries = [e for e in (_entry(x) for x in reply) if e is not None]
            if entries:  # past malformed entries too: they are never read again
                self._last_id = entries[-1][0]
            anns = [a for _, a in entries if a is not None and a.engine != self.engine_id]
            if not self._caught_up:
                anns = self._present([a for a in anns if a.stored])
            self._relay(anns)
            if len(reply) < BATCH:
                self._caught_up = True
                return

    def _present(self, anns: list[Announcement]) -> list[Announcement]:
        """The stored announcements of ``anns`` whose blocks' markers exist now."""
        found = self._markers_exist([a.block for a in anns])
        return [a for a in anns if found.get(a.block) == 1]

    def _relay(self, anns: Sequence[Announcement]) -> None:
        """Turn other engines' announcements into this engine's events: a block stored
        that is not credited yet, a credited block removed."""
        now = self._clock()
        with self._lock:
            out: list[Any] = []
            for a in anns:
                if a.stored:
                    if a.block in self._credited:
                        continue
                    out += self._credit_locked([a.block], now)
                    spec = self.group_specs.get(a.group, GroupSpecInfo(None, None))
                    out.append(stored_event(_event_block(a), self.block_size, spec))
                    self.relayed += 1
                elif self._credited.pop(a.block, None) is not None:
                    out.append(removed_event([a.block_hash], a.group))
                    self.removed += 1
            self._queue_locked(self._events, out)

    def _verify(self) -> None:
        """Announce removed the credited blocks whose markers are gone."""
        cutoff = self._clock() - self.verify_grace_s
        with self._lock:
            blocks = [b for b, at in self._credited.items() if at <= cutoff]
        found = self._markers_exist(blocks)
        gone = [b for b in blocks if found.get(b) == 0]
        if not gone:
            return
        with self._lock:
            by_group: dict[int, list[bytes]] = {}
            for h, g in gone:
                at = self._credited.get((h, g))
                if at is not None and at <= cutoff:  # not credited again meanwhile
                    del self._credited[(h, g)]
                    by_group.setdefault(g, []).append(h)
            self.removed += sum(len(v) for v in by_group.values())
            self._queue_locked(self._events, [removed_event(hs, g) for g, hs in by_group.items()])

    def _markers_exist(self, blocks: Sequence[tuple[bytes, int]]) -> dict[tuple[bytes, int], int]:
        """``EXISTS`` of each block's stored marker: 1, 0, or -1 (unknown), in batches."""
        out: dict[tuple[bytes, int], int] = {}
        for i in range(0, len(blocks), BATCH):
            chunk = blocks[i : i + BATCH]
            keys = [self.codec.marker_key(h, g) for h, g in chunk]
            replies = self.plane.run_keyed(
                [(k, exists_command(k)) for k in keys], timeout=self.timeout_s
            )
            if replies is None:
                self.failures += 1
                replies = [-1] * len(chunk)
            out.update(zip(chunk, replies, strict=True))
        return out


def _entry(raw: Any) -> tuple[bytes, Announcement | None] | None:
    """(entry id, announcement) of one ``XRANGE`` reply item: the announcement None
    where the fields are malformed, the whole None where the item has no id."""
    if not (isinstance(raw, list) and len(raw) == 2 and isinstance(raw[0], bytes)):
        return None
    fields = raw[1]
    if not isinstance(fields, list) or not all(isinstance(f, bytes) for f in fields):
        return (raw[0], None)
    return (raw[0], parse_announcement(fields))


def _event_block(a: Announcement) -> EventBlock:
    """The KV event data of an announced block."""
    return EventBlock(
        a.block_hash, a.parent_hash, a.token_ids, a.group, a.extra_keys, a.lora_id, a.lora_name
    )
