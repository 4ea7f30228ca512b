"""Stored markers: the one key per (block, cache group) that a lookup reads.

A block's values are one key per rank; its marker says every rank's value was stored.
The scheduler knows that once every worker reported the block's store event without a
failed key, and only then is the marker written (``SET marker 1 EX ttl``). Lookups read
markers alone, so their cost does not grow with TP, PP, PCP or DCP.

Markers and values live and die apart, so this job also keeps them in step:

- blocks a lookup found get their values' TTL (or LRU clock) refreshed too, about once
  per ``refresh_interval_s`` per block (see ``_refresh_commands``); a refresh that finds
  a rank value gone (expired, evicted, deleted) deletes the block's marker, so other
  engines miss instead of failing a load;
- blocks whose value a worker's load found missing, or invalid (and deleted), lose
  their marker.

Every write runs on a thread of its own, batched, bounded in time (``timeout_s``) and in
memory (``MAX_QUEUED`` commands; more are dropped and counted). The scheduler never
waits for it, except for a bounded ``flush`` at shutdown. A marker that was not written
is a miss; a marker whose value is gone is a load failure that vLLM recomputes (counted,
quarantined, stored again): never a wrong token.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from umbp_redis.data import BlockIdentityCodec
from umbp_redis.data.keys import parse_key
from umbp_redis.store.commands import expire_command, set_marker_command, touch_command
from umbp_redis.store.deployment import DataPlane
from umbp_redis.store.resp import encode_command

log = logging.getLogger(__name__)

# Commands waiting for the writer at most; more are dropped (counted).
MAX_QUEUED = 1 << 17
# Commands per round trip at most.
BATCH = 4096
# Store events waiting for their workers' reports at most (the oldest are forgotten),
# and blocks whose last value refresh is remembered at most.
MAX_TRACKED = 1 << 16
# The longest gap between two refreshes of a found block's values: Redis' LRU clock
# counts seconds, so a prefix found every second stays as recent as its marker.
MAX_REFRESH_INTERVAL_S = 1.0

# What a queued command does, for its reply.
_MARK, _REFRESH, _UNMARK, _RECORD = 0, 1, 2, 3


@dataclass
class _PendingEvent:
    """A store event's blocks, waiting for every worker's report."""

    blocks: list[tuple[bytes, int]]
    reports: int = 0
    failed: set[tuple[int, str]] = field(default_factory=set)


@dataclass(frozen=True)
class _Queued:
    """One command for the writer: what it does, its key and the block it is about."""

    kind: int
    key: bytes
    command: bytes
    block: tuple[bytes, int]
    codec: BlockIdentityCodec
    # A deletion: when the value was found gone; a marker written since is kept.
    since: float = 0.0


@dataclass(frozen=True)
class _FoundBlocks:
    """A lookup's found blocks, for the writer to refresh."""

    codec: BlockIdentityCodec
    n_blocks: int
    hash_of: Callable[[int], bytes | None]
    groups: list[int]
    present: Callable[[int, int], bool]


class StoredMarkers:
    """Writes stored markers, refreshes found blocks' values, removes stale markers."""

    def __init__(
        self,
        plane: DataPlane,
        num_workers: int,
        *,
        ttl_s: int,
        refresh_ttl: bool,
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.plane = plane
        self.num_workers = num_workers
        self.refresh_ttl = refresh_ttl
        self.timeout_s = timeout_s
        self.refresh_interval_s = min(ttl_s / 4, MAX_REFRESH_INTERVAL_S)
        self._ttl = str(int(ttl_s)).encode()
        self._clock = clock
        self._events: OrderedDict[int, _PendingEvent] = OrderedDict()
        self._refreshed: OrderedDict[tuple[bytes, int], float] = OrderedDict()
        # (block hash, group) -> when its marker was last written.
        self._marked_at: OrderedDict[tuple[bytes, int], float] = OrderedDict()
        self._queue: deque[_Queued] = deque()
        self._found: deque[_FoundBlocks] = deque()
        self._cond = threading.Condition()
        self._busy = False
        self._closed = False
        self._thread: threading.Thread | None = None
        # Counters since startup (read by the scheduler's stats).
        self.written = 0  # markers written
        self.failed = 0  # markers, refreshes or deletions that did not land
        self.refreshed = 0  # value keys whose TTL or LRU clock was refreshed
        self.stale = 0  # markers deleted: a rank value was gone or invalid
        self.dropped = 0  # commands dropped: the queue was full
        self.records_written = 0  # namespace records written (``publish``)

    # -- scheduler side ----------------------------------------------------------------

    def track(self, event_id: int, hashes: Sequence[bytes], group_ids: Sequence[int]) -> None:
        """Keep a store event's blocks until every worker reported it."""
        self._events[event_id] = _PendingEvent(list(zip(hashes, group_ids, strict=True)))
        while len(self._events) > MAX_TRACKED:
            self._events.popitem(last=False)

    @property
    def awaiting_reports(self) -> int:
        """Store events tracked here that some worker has not reported yet."""
        return len(self._events)

    def note_store_report(
        self,
        codec: BlockIdentityCodec,
        event_id: int,
        finished: int,
        failed_keys: frozenset[str],
    ) -> None:
        """Count ``finished`` worker reports of a store event; once every worker reported,
        mark each of its blocks none of whose rank keys failed."""
        info = self._events.get(event_id)
        if info is None:
            return
        info.reports += finished
        for k in failed_keys:
            try:
                d = parse_key(k)
            except ValueError:
                continue
            info.failed.add((d.group_id, d.block_hash.hex()))
        if info.reports < self.num_workers:
            return
        del self._events[event_id]
        out = []
        for h, g in info.blocks:
            if (g, h.hex()) in info.failed:
                continue
            key = codec.marker_key(h, g)
            out.append(_Queued(_MARK, key, set_marker_command(key, self._ttl), (h, g), codec))
        self._enqueue(out)

    def note_found(
        self,
        codec: BlockIdentityCodec,
        n_blocks: int,
        hash_of: Callable[[int], bytes | None],
        groups: Sequence[int],
        present: Callable[[int, int], bool],
    ) -> None:
        """Refresh the values of blocks a lookup found: block ``b < n_blocks`` (hash
        ``hash_of(b)``) in ``groups[pos]`` where ``present(b, pos)``, unless refreshed
        within the interval. Cheap for the caller: the work is done on the writer thread."""
        if self._closed:
            return
        job = _FoundBlocks(codec, n_blocks, hash_of, list(groups), present)
        with self._cond:
            self._found.append(job)
            self._start()
            self._cond.notify()

    def note_removed(
        self, codec: BlockIdentityCodec, hashes: Sequence[bytes], groups: Sequence[int]
    ) -> None:
        """Delete the markers of blocks whose value a worker found missing, or invalid
        and deleted."""
        self._enqueue(self._unmark({(h, g): codec for h in hashes for g in groups}))

    def publish(self, codec: BlockIdentityCodec, key: bytes, command: bytes) -> None:
        """Send ``command``, a write of ``key`` that answers ``+OK`` (the namespace
        record), on the writer thread; counted in ``records_written`` or ``failed``."""
        self._enqueue([_Queued(_RECORD, key, command, (b"", -1), codec)])

    def flush(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for every queued command to be sent; whether it was."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._queue or self._found or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout_s: float = 1.0) -> None:
        """Send what is queued (up to ``timeout_s``), then stop the writer."""
        self.flush(timeout_s)
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    # -- writer thread -----------------------------------------------------------------

    def _enqueue(self, items: list[_Queued]) -> None:
        """Queue commands for the writer (the oldest kept when full: more are dropped)."""
        if not items:
            return
        with self._cond:
            room = max(MAX_QUEUED - len(self._queue), 0)
            if room < len(items):
                self.dropped += len(items) - room
                items = items[:room]
            self._queue.extend(items)
            self._start()
            self._cond.notify()

    def _start(self) -> None:
        """Start the writer thread on first use (held: ``_cond``)."""
        if self._thread is None and not self._closed:
            self._thread = threading.Thread(target=self._run, name="umbp-markers", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._found and not self._closed:
                    self._cond.wait()
                if self._closed and not self._queue and not self._found:
                    return
                found = list(self._found)
                self._found.clear()
                self._busy = True
            try:
                refresh = [q for job in found for q in self._refresh_commands(job)]
                self._enqueue(refresh)
                with self._cond:
                    batch = [self._queue.popleft() for _ in range(min(BATCH, len(self._queue)))]
                if batch:
                    self._send(batch)
            except Exception as e:  # a bug here must never reach the engine
                self.failed += 1
                log.error("umbp-redis: the stored-marker writer failed: %r", e)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _refresh_commands(self, job: _FoundBlocks) -> list[_Queued]:
        """The value refreshes a lookup's found blocks are due.

        Blocks are taken from the prefix's end back, and the walk stops at the first
        block refreshed within the interval: a refresh covers a whole found prefix (a
        block hash names its prefix chain), so the blocks before it were refreshed at
        most an interval before it. A prefix asked for again costs a few dict lookups."""
        now = self._clock()
        out = []
        for b in range(job.n_blocks - 1, -1, -1):
            h = job.hash_of(b)
            if h is None:
                continue
            fresh = False
            for pos, g in enumerate(job.groups):
                if not job.present(b, pos):
                    continue
                seen = self._refreshed.get((h, g))
                if seen is not None and now - seen < self.refresh_interval_s:
                    fresh = True
                    continue
                self._refreshed[(h, g)] = now
                self._refreshed.move_to_end((h, g))
                hx = h.hex()
                for p in job.codec.key_prefixes(g):
                    key = (p + hx).encode()
                    cmd = (
                        expire_command(key, self._ttl) if self.refresh_ttl else touch_command([key])
                    )
                    out.append(_Queued(_REFRESH, key, cmd, (h, g), job.codec))
            if fresh:
                break
        while len(self._refreshed) > MAX_TRACKED:
            self._refreshed.popitem(last=False)
        return out

    def _unmark(self, blocks: dict[tuple[bytes, int], BlockIdentityCodec]) -> list[_Queued]:
        """Deletions of the markers of ``blocks`` ((hash, group) -> codec), found stale now."""
        now = self._clock()
        return [
            _Queued(_UNMARK, key, encode_command(b"UNLINK", key), blk, codec, now)
            for blk, codec in blocks.items()
            for key in [codec.marker_key(*blk)]
        ]

    def _send(self, batch: list[_Queued]) -> None:
        """One round trip of ``batch``; its replies counted, stale markers queued.

        A deletion is dropped when the block was marked again since its value was found
        gone (stored again meanwhile: the new marker is right)."""
        marked_here = {q.block for q in batch if q.kind == _MARK}
        batch = [
            q
            for q in batch
            if q.kind != _UNMARK
            or (q.block not in marked_here and self._marked_at.get(q.block, -1.0) < q.since)
        ]
        if not batch:
            return
        sent_at = self._clock()
        replies = self.plane.run_keyed([(q.key, q.command) for q in batch], timeout=self.timeout_s)
        if replies is None:
            self.failed += len(batch)
            return
        stale: dict[tuple[bytes, int], BlockIdentityCodec] = {}
        for q, r in zip(batch, replies, strict=True):
            if q.kind == _MARK:
                if r == 1:
                    self.written += 1
                    # Its values were just stored with the TTL: no refresh due yet.
                    for seen in (self._refreshed, self._marked_at):
                        seen[q.block] = sent_at
                        seen.move_to_end(q.block)
                else:
                    self.failed += 1
            elif q.kind == _REFRESH:
                if r == 1:
                    self.refreshed += 1
                elif r == 0:  # a rank value is gone: the marker would promise a failing load
                    stale[q.block] = q.codec
                    self._refreshed.pop(q.block, None)
                else:  # unknown (an error reply, a failed node): nothing is concluded
                    self.failed += 1
                    self._refreshed.pop(q.block, None)
            elif q.kind == _RECORD:
                if r == 1:
                    self.records_written += 1
                else:
                    self.failed += 1
            elif r == 1:
                self.stale += 1
            elif r < 0:
                self.failed += 1
        while len(self._marked_at) > MAX_TRACKED:
            self._marked_at.popitem(last=False)
        if stale:
            self._enqueue(self._unmark(stale))
