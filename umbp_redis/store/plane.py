"""The Redis data plane shared by the scheduler and the workers.

* ``lookup``: per-key presence of many keys in one round trip on a connection kept
  warm off the caller's thread (re-arming the TTL of hits, or at least their LRU
  clock), or ``None`` ("unknown") on any error; one deadline covers all of it.
* ``store``: many objects from the caller's staging memory, each written as the hash of
  ``value_format`` and its TTL in one ``MULTI``/``EXEC``, payload bytes handed to
  ``sendmsg`` as memoryviews.
* ``load``: many objects straight into caller buffers (``recv_into``), each validated
  (magic, version, key digest, fingerprint, sizes, checksum: ``value_reads``) before it
  counts as loaded. Only bytes that fail validation are ``INVALID``; an error reply (MOVED,
  READONLY, NOPERM, OOM...) or a broken connection is ``ERROR``.

Large batches are spread over several connections; bytes in flight per connection
are bounded; nothing here raises into the caller, for a Redis failure or a
malformed reply: results say per key what happened.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypedDict, TypeVar, Unpack

from umbp_redis.store.commands import (
    ASKING,
    EXEC,
    MULTI,
    LookupEncoder,
    RequestCountEncoder,
    body_heads,
    expire_command,
    hmget_command,
    hmget_part_command,
    hset_head,
    lookup_commands,
    transaction_replies,
    ttl_argument,
)
from umbp_redis.store.connection import (
    AuthAlarm,
    ConnectionPool,
    RedisConnection,
    WarmConnection,
    refused_command,
)
from umbp_redis.store.errors import (
    RedisAuthError,
    RedisDataPlaneError,
    RedisLoadingError,
    RedisOOMError,
    RedisRedirectError,
    RedisTimeoutError,
)
from umbp_redis.store.resp import Buffer, ErrorReply, encode_command, send_buffers
from umbp_redis.store.settings import RedisSettings
from umbp_redis.store.thread_affinity import thread_pinner
from umbp_redis.store.value_format import encode_value, part_split
from umbp_redis.store.value_reads import (
    LoadStatus,
    ValueRead,
    ValueReader,
    target_nbytes,
    target_views,
    views_nbytes,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

# Called with the indices of keys a load found valid, a batch at a time (see ``load``).
LoadedCallback = Callable[[list[int]], None]
# Called with a part number and the indices of keys whose part it is done with (``load``).
PartCallback = Callable[[int, list[int]], None]
# The (key, buffer) pairs of a store or load: each value's bytes, or where they go.
KeyedBuffers = Sequence[tuple[str | bytes, Buffer]]


class StoreOptions(TypedDict, total=False):
    """The keyword options of every data plane's ``store``, each None by default
    (``RedisDataPlane.store`` says what they do)."""

    parts: Sequence[int] | None


class LoadOptions(StoreOptions, total=False):
    """The keyword options of every data plane's ``load``, each None by default
    (``RedisDataPlane.load`` says what they do); ``parts`` as in ``store``."""

    deadline: float | None
    on_loaded: LoadedCallback | None
    on_part: PartCallback | None


_MIN_BYTES_PER_CONNECTION = 4 << 20


class StoreStatus(enum.Enum):
    """Outcome of storing one key."""

    STORED = "stored"
    OOM = "oom"
    ERROR = "error"


# The outcome of a store or a load, one key's.
Outcome = TypeVar("Outcome", StoreStatus, LoadStatus)


@dataclass
class DataPlaneStats:
    """Counters since the data plane was made (read them with ``snapshot``)."""

    lookups: int = 0
    lookup_errors: int = 0
    lookup_timeouts: int = 0
    lookup_keys: int = 0
    lookup_hits: int = 0
    stored_objects: int = 0
    stored_bytes: int = 0
    store_failures: int = 0
    loaded_objects: int = 0
    loaded_bytes: int = 0
    load_missing: int = 0
    load_invalid: int = 0
    load_errors: int = 0
    upkeep_errors: int = 0
    unexpected_errors: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **deltas: int) -> None:
        """Add to counters atomically."""
        with self._lock:
            for k, v in deltas.items():
                setattr(self, k, getattr(self, k) + v)

    def snapshot(self) -> dict[str, int]:
        """The counters as a dict."""
        with self._lock:
            return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}


# The counter each outcome adds one to and, for a value stored or loaded, the counter
# its bytes add to.
_OUTCOME_COUNTERS: dict[StoreStatus | LoadStatus, tuple[str, str | None]] = {
    StoreStatus.STORED: ("stored_objects", "stored_bytes"),
    StoreStatus.OOM: ("store_failures", None),
    StoreStatus.ERROR: ("store_failures", None),
    LoadStatus.LOADED: ("loaded_objects", "loaded_bytes"),
    LoadStatus.MISSING: ("load_missing", None),
    LoadStatus.INVALID: ("load_invalid", None),
    LoadStatus.ERROR: ("load_errors", None),
}


def record_outcomes(
    stats: DataPlaneStats, items: KeyedBuffers, statuses: Sequence[Outcome]
) -> None:
    """Add the per-key outcome of one ``store`` or ``load`` call to ``stats``."""
    deltas: dict[str, int] = {}
    for (_, buf), status in zip(items, statuses, strict=True):
        count, nbytes = _OUTCOME_COUNTERS[status]
        deltas[count] = deltas.get(count, 0) + 1
        if nbytes is not None:
            deltas[nbytes] = deltas.get(nbytes, 0) + target_nbytes(buf)
    stats.add(**deltas)


def _key_bytes(key: str | bytes) -> bytes:
    return key if isinstance(key, bytes) else key.encode()


def _transaction_status(
    multi: Any, hset: Any, expire: Any, exec_reply: Any
) -> tuple[StoreStatus, Exception | None]:
    """One object's store outcome from its four replies, and the server's error if any.

    Queued commands answer ``QUEUED`` or an error (OOM, LOADING, ACL); an error there
    aborts the transaction, so nothing was written. Were ``MULTI`` itself refused, the
    commands ran on their own and their replies are their results.
    """
    if isinstance(multi, ErrorReply):
        _warn_no_transactions(multi)
        results: list[Any] = [hset, expire]
    else:
        for queued in (hset, expire):
            if isinstance(queued, ErrorReply):
                return _error_status(queued), queued.exc
        if isinstance(exec_reply, ErrorReply):
            return _error_status(exec_reply), exec_reply.exc
        if not isinstance(exec_reply, list) or len(exec_reply) != 2:
            return StoreStatus.ERROR, None
        results = exec_reply
    for r in results:
        if isinstance(r, ErrorReply):
            return _error_status(r), r.exc
    if not isinstance(results[0], int) or results[1] != 1:
        return StoreStatus.ERROR, None
    return StoreStatus.STORED, None


_warned_no_transactions = False


def _warn_no_transactions(refusal: ErrorReply) -> None:
    global _warned_no_transactions
    if not _warned_no_transactions and not isinstance(refusal.exc, RedisLoadingError):
        _warned_no_transactions = True
        log.warning(
            "umbp-redis: Redis refused MULTI (%s); values and their TTLs are written "
            "without a transaction, so a lost connection can leave a value without a TTL. "
            "Allow the @transaction commands to this user",
            refusal.message,
        )


def _error_status(err: ErrorReply) -> StoreStatus:
    return StoreStatus.OOM if isinstance(err.exc, RedisOOMError) else StoreStatus.ERROR


def _part_count(parts: Sequence[int] | None) -> int:
    return len(part_split(parts) or (0,))


def _byte_windows(sizes: Sequence[int], budget: int) -> list[range]:
    """Consecutive index ranges whose sizes add up to at most ``budget`` (>= 1 item each)."""
    out: list[range] = []
    start, acc = 0, 0
    for i, n in enumerate(sizes):
        if i > start and acc + n > budget:
            out.append(range(start, i))
            start, acc = i, 0
        acc += n
    if start < len(sizes):
        out.append(range(start, len(sizes)))
    return out


def _split(n: int, parts: int) -> list[range]:
    step = -(-n // parts)
    return [range(i, min(n, i + step)) for i in range(0, n, step)]


class RedisDataPlane:
    """Lookups, stores and loads of KV objects against one Redis server."""

    lookup_mode = "standalone"

    def __init__(self, settings: RedisSettings) -> None:
        self.settings = settings
        self.auth = AuthAlarm(settings)
        self.pool = ConnectionPool(settings, self.auth)
        self.lookup_conn = WarmConnection(settings, self.auth)
        self.stats = DataPlaneStats()
        self._executor = ThreadPoolExecutor(
            max_workers=max(1, settings.transfer_connections - 1),
            thread_name_prefix="umbp-redis-io",
            initializer=thread_pinner(settings.transfer_cpus),
        )
        self._ttl = ttl_argument(settings.ttl_seconds)
        self._unexpected_logged = False
        self._values = ValueReader(settings.checksum, lambda e: self._note_refusals([e], "HMGET"))

    def counters(self) -> dict[str, int]:
        """Every counter, refused logins and commands (``auth_failures``) included."""
        return {**self.stats.snapshot(), "auth_failures": self.auth.count}

    def node_counters(self) -> dict[str, int]:
        """One server: no per-master counters."""
        return {}

    def warm_up(self) -> None:
        """Start making the lookup connection now, off the caller's thread."""
        self.lookup_conn.start()

    def _unexpected(self, what: str, exc: BaseException) -> None:
        """Count a bug or malformed reply (logged once per process with its traceback)."""
        self.stats.add(unexpected_errors=1)
        if not self._unexpected_logged:
            self._unexpected_logged = True
            log.error(
                "umbp-redis: unexpected error in %s (counted as a miss): %r",
                what,
                exc,
                exc_info=exc,
            )
        else:
            log.debug("unexpected error in %s: %r", what, exc)

    def _note_refusals(self, replies: Sequence[Any], default_command: str) -> None:
        """Report the first permission refusal among error replies to the auth alarm."""
        for r in replies:
            if isinstance(r, ErrorReply) and isinstance(r.exc, RedisAuthError):
                self.auth.report(refused_command(r.message, default_command), r.message)
                return

    # -- lookup -----------------------------------------------------------------------

    def lookup(
        self,
        keys: Sequence[str | bytes],
        *,
        refresh_ttl: bool | None = None,
        timeout: float | None = None,
    ) -> list[bool] | None:
        """Presence of each key, in order, in one round trip; None when it is unknown.

        With ``refresh_ttl`` (default: the ``refresh_ttl_on_lookup`` option) each hit's
        TTL is re-armed by the same command (``EXPIRE`` answers 1 exactly for hits);
        without, ``TOUCH`` checks it and refreshes its LRU clock. Everything (waiting for
        the connection, sending, reading) ends within ``timeout`` (default
        ``lookup_timeout_s``).
        """
        if not keys:
            return []
        refresh = self.settings.refresh_ttl_on_lookup if refresh_ttl is None else refresh_ttl
        kb = [_key_bytes(k) for k in keys]
        buf = b"".join(lookup_commands([k], refresh_ttl=refresh, ttl=self._ttl)[0] for k in kb)
        replies = self.lookup_replies(buf, len(kb), timeout=timeout)
        if replies is None:
            return None
        present = [r == 1 for r in replies]
        self.stats.add(lookup_keys=len(kb), lookup_hits=sum(present))
        return present

    def lookup_replies(
        self,
        buf: bytes,
        count: int,
        *,
        timeout: float | None = None,
        counted_from: int | None = None,
    ) -> list[int] | None:
        """Send pre-encoded lookup commands (``lookup_commands``) and read their ``count``
        integer replies, all within ``timeout`` (default ``lookup_timeout_s``); None on any
        error, timeout or error reply (counted; never raises). Replies from position
        ``counted_from`` on are request counts: an error reply there (a full Redis
        refusing ``INCR``) reads 0 and fails nothing.
        """
        wait = self.settings.lookup_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + wait
        self.stats.add(lookups=1)
        try:
            with self.lookup_conn.connection(deadline) as conn:
                send_buffers(conn.sock, [buf], use_sendmsg=False, deadline=deadline)
                replies = conn.reader.read_int_replies(count)
        except RedisTimeoutError as e:
            self.stats.add(lookup_errors=1, lookup_timeouts=1)
            log.debug("lookup of %d replies timed out: %s", count, e)
            return None
        except RedisDataPlaneError as e:
            self.stats.add(lookup_errors=1)
            log.debug("lookup of %d replies failed: %s", count, e)
            return None
        except Exception as e:  # a bug or a malformed reply is a miss, never an exception
            self.stats.add(lookup_errors=1)
            self._unexpected("lookup", e)
            return None
        end = count if counted_from is None else counted_from
        errors = [r for r in replies[:end] if isinstance(r, ErrorReply)]
        if errors:
            self.stats.add(lookup_errors=1)
            log.debug("lookup got error replies: %s", errors[0])
            self._note_refusals(errors, "EXPIRE")
            return None
        return [0 if isinstance(r, ErrorReply) else r for r in replies]

    def lookup_encoder(
        self, prefixes: Sequence[bytes], *, refresh_ttl: bool, hash_hex_len: int
    ) -> LookupEncoder:
        """The encoder of one block's lookup commands, for ``lookup_blocks``."""
        return LookupEncoder(
            prefixes, refresh_ttl=refresh_ttl, ttl=self._ttl, hash_hex_len=hash_hex_len
        )

    def request_count_encoder(self, prefix: bytes, *, hash_hex_len: int) -> RequestCountEncoder:
        """The encoder of one block's request count, for ``lookup_blocks``."""
        return RequestCountEncoder(prefix, ttl=self._ttl, hash_hex_len=hash_hex_len)

    def lookup_blocks(
        self, blocks: Sequence[bytes], count: int, *, counted_from: int | None = None
    ) -> list[int] | None:
        """Replies to blocks encoded by ``lookup_encoder`` (``count`` in all), in order,
        then from reply ``counted_from`` on those of ``request_count_encoder``'s blocks;
        None when unknown (as ``lookup_replies``)."""
        return self.lookup_replies(b"".join(blocks), count, counted_from=counted_from)

    def run_keyed(
        self, commands: Sequence[tuple[bytes, bytes]], *, timeout: float
    ) -> list[int] | None:
        """Send pre-encoded one-key commands (key, command) in one round trip and read
        their replies, in order: an integer as is, ``+OK`` as 1, an error reply (a
        redirect, a refusal) as -1, unknown; None when the round trip failed or did not
        end within ``timeout`` seconds (counted as ``upkeep_errors``; never raises)."""
        if not commands:
            return []
        deadline = time.monotonic() + timeout
        buf = b"".join(c for _, c in commands)
        got = self._upkeep(
            "keyed commands",
            lambda: self._int_round_trip(buf, len(commands), ok_replies=True, deadline=deadline),
        )
        if got is None:
            return None
        self._note_refusals([r for r in got if isinstance(r, ErrorReply)], "SET")
        return [r if isinstance(r, int) else -1 for r in got]

    def query_keyed(self, key: bytes, command: bytes, *, timeout: float) -> Any:
        """The reply of one pre-encoded one-key command: bytes, int, str, None or a list
        of them; None also when the round trip failed, did not end within ``timeout``
        seconds or was refused (counted as ``upkeep_errors``; never raises)."""
        deadline = time.monotonic() + timeout
        reply = self._upkeep("a keyed query", lambda: self._exchange(command, deadline=deadline))
        if isinstance(reply, ErrorReply):
            self.stats.add(upkeep_errors=1)
            self._note_refusals([reply], command.split(b"\r\n", 3)[2].decode(errors="replace"))
            return None
        return reply

    # -- shared round trips ------------------------------------------------------------

    def _upkeep(self, what: str, exchange: Callable[[], T]) -> T | None:
        """``exchange()``'s result, or None when it fails (counted as ``upkeep_errors``;
        never raises)."""
        try:
            return exchange()
        except RedisDataPlaneError as e:
            self.stats.add(upkeep_errors=1)
            log.debug("%s failed: %s", what, e)
        except Exception as e:  # a bug or a malformed reply: counted, never raised
            self.stats.add(upkeep_errors=1)
            self._unexpected(what, e)
        return None

    def _int_round_trip(
        self,
        buf: bytes,
        count: int,
        *,
        timeout: float | None = None,
        ok_replies: bool = False,
        deadline: float | None = None,
    ) -> list[int | ErrorReply]:
        """Send one pre-encoded buffer of ``count`` commands and read their integer replies
        (with ``ok_replies``, any reply: ``+OK`` of ``ASKING`` then reads as 1); with
        ``deadline`` (monotonic seconds) the exchange ends by then or raises."""
        with self.pool.connection(timeout=timeout, deadline=deadline) as conn:
            send_buffers(conn.sock, [buf], use_sendmsg=False, deadline=deadline)
            if not ok_replies:
                return conn.reader.read_int_replies(count)
            out: list[int | ErrorReply] = []
            for _ in range(count):
                r = conn.reader.read_reply()
                out.append(r if isinstance(r, int | ErrorReply) else 1)
            return out

    def _command(self, *args: bytes | str | int, deadline: float | None = None) -> Any:
        """One small command and its reply (raises ``RedisDataPlaneError``); with
        ``deadline`` (monotonic seconds) the exchange ends by then or raises."""
        return self._exchange(encode_command(*args), deadline=deadline)

    def _exchange(self, command: bytes, *, deadline: float | None = None) -> Any:
        """Send one pre-encoded command and read its reply (raises
        ``RedisDataPlaneError``); with ``deadline`` it ends by then or raises."""
        with self.pool.connection(deadline=deadline) as conn:
            send_buffers(conn.sock, [command], use_sendmsg=False, deadline=deadline)
            return conn.reader.read_reply()

    @staticmethod
    def _windowed(
        groups: Sequence[range], send: Callable[[range], None], read: Callable[[range], list[T]]
    ) -> list[T]:
        """Send group i+1 before reading group i's replies: at most two groups in flight."""
        out: list[T] = []
        pending: list[range] = []
        for g in groups:
            send(g)
            pending.append(g)
            if len(pending) > 1:
                out.extend(read(pending.pop(0)))
        for g in pending:
            out.extend(read(g))
        return out

    # -- fan-out helper ---------------------------------------------------------------

    def _fan_out(
        self,
        n_items: int,
        total_bytes: int,
        run: Callable[[range], list[T]],
        on_error: T,
    ) -> list[T]:
        parts = min(
            self.settings.transfer_connections,
            n_items,
            max(1, total_bytes // _MIN_BYTES_PER_CONNECTION),
        )
        chunks = _split(n_items, parts) if n_items else []

        def guarded(rng: range) -> list[T]:
            try:
                return run(rng)
            except RedisDataPlaneError as e:
                log.debug("transfer of %d objects failed: %s", len(rng), e)
                return [on_error] * len(rng)
            except Exception as e:  # a bug or malformed reply fails these keys, nothing more
                self._unexpected("transfer", e)
                return [on_error] * len(rng)

        futures = [self._executor.submit(guarded, c) for c in chunks[1:]]
        out = guarded(chunks[0]) if chunks else []
        for f in futures:
            out.extend(f.result())
        return out

    # -- store ------------------------------------------------------------------------

    def _settled(
        self, items: KeyedBuffers, raw: Sequence[Outcome | RedisRedirectError], error: Outcome
    ) -> list[Outcome]:
        """The outcomes of a ``store_raw`` or ``load_raw`` of ``items``, a redirect read as
        ``error`` (one server has no other node to send a key to), added to the counters."""
        out = [error if isinstance(r, RedisRedirectError) else r for r in raw]
        record_outcomes(self.stats, items, out)
        return out

    def store(
        self, items: KeyedBuffers, fingerprint: bytes, **options: Unpack[StoreOptions]
    ) -> list[StoreStatus]:
        """Write each (key, payload) with the ``ttl_seconds`` TTL; per-key status, in order.

        A key is written with its TTL or not at all (one transaction per object).
        The payload buffers are read during the call only and are sent as memoryviews
        (no copy). ``parts`` (lengths adding up to every payload's) writes each value in
        that many body fields (``value_format`` version 3), so it can be loaded a part at
        a time.
        """
        raw = self.store_raw(items, fingerprint, **options)
        return self._settled(items, raw, StoreStatus.ERROR)

    def store_raw(
        self,
        items: KeyedBuffers,
        fingerprint: bytes,
        *,
        asking: bool = False,
        **options: Unpack[StoreOptions],
    ) -> list[StoreStatus | RedisRedirectError]:
        """``store`` without counting, a ``MOVED``/``ASK`` answer returned as its error
        (for the cluster client); with ``asking`` each object is preceded by ``ASKING``."""
        if not items:
            return []
        views = [memoryview(payload).cast("B") for _, payload in items]
        sub = [(_key_bytes(key), view) for (key, _), view in zip(items, views, strict=True)]
        error: StoreStatus | RedisRedirectError = StoreStatus.ERROR
        parts = options.get("parts")
        return self._fan_out(
            len(sub),
            sum(v.nbytes for v in views),
            lambda rng: self._store_range(sub, rng, fingerprint, asking, parts),
            error,
        )

    def _store_range(
        self,
        sub: list[tuple[bytes, memoryview]],
        rng: range,
        fingerprint: bytes,
        asking: bool = False,
        parts: Sequence[int] | None = None,
    ) -> list[StoreStatus | RedisRedirectError]:
        window = max(1, self.settings.max_inflight_bytes // 2)
        chunk = sub[rng.start : rng.stop]
        windows = _byte_windows([v.nbytes for _, v in chunk], window)
        with self.pool.connection() as conn:
            return self._windowed(
                windows,
                lambda g: self._send_stores(
                    conn, chunk[g.start : g.stop], fingerprint, asking, parts
                ),
                lambda g: self._read_stores(conn, len(g), asking, parts),
            )

    def _send_stores(
        self,
        conn: RedisConnection,
        group: Sequence[tuple[bytes, memoryview]],
        fingerprint: bytes,
        asking: bool = False,
        parts: Sequence[int] | None = None,
    ) -> None:
        # Each object is MULTI, HSET, EXPIRE, EXEC: the server applies the value and its
        # TTL together or not at all (a connection lost mid-batch leaves no key without
        # a TTL, which volatile-* eviction would never remove).
        bufs: list[Buffer] = []
        with_checksum = self.settings.checksum
        multi = ASKING + MULTI if asking else MULTI
        after = b""  # the previous object's EXPIRE and EXEC, sent with this one's start
        for key, payload in group:
            field_h, bodies = encode_value(
                fingerprint, payload, key, with_checksum=with_checksum, parts=parts
            )
            heads = body_heads(bodies)
            bufs.append(after + multi + hset_head(key, field_h, len(bodies)) + heads[0])
            for i, (offset, body_len) in enumerate(bodies):
                if i:
                    bufs.append(heads[i])
                bufs.append(payload[offset : offset + body_len])
            after = b"\r\n" + expire_command(key, self._ttl) + EXEC
        bufs.append(after)
        send_buffers(conn.sock, bufs, use_sendmsg=conn.use_sendmsg)

    def _read_stores(
        self,
        conn: RedisConnection,
        n: int,
        asking: bool = False,
        parts: Sequence[int] | None = None,
    ) -> list[StoreStatus | RedisRedirectError]:
        reader = conn.reader
        usual = transaction_replies(1 + _part_count(parts))
        out: list[StoreStatus | RedisRedirectError] = []
        loading: RedisLoadingError | None = None
        for _ in range(n):
            if asking:
                reader.read_reply()  # ASKING's +OK (an error there shows again below)
            if reader.take_expected(usual) is not None:  # the usual replies, taken whole
                out.append(StoreStatus.STORED)
                continue
            replies = [reader.read_reply() for _ in range(4)]
            # A refused MULTI is handled (commands then run one by one); the rest is not.
            self._note_refusals(
                [r for x in replies[1:] for r in (x if isinstance(x, list) else [x])], "HSET"
            )
            status, err = _transaction_status(*replies)
            if isinstance(err, RedisLoadingError):
                loading = err
            out.append(err if isinstance(err, RedisRedirectError) else status)
        if loading is not None:
            raise loading
        return out

    # -- load -------------------------------------------------------------------------

    def load(
        self, items: KeyedBuffers, fingerprint: bytes, **options: Unpack[LoadOptions]
    ) -> list[LoadStatus]:
        """Read each key into its destination (a buffer, or a list of buffers that take
        consecutive pieces of the payload: see ``target_views``); per-key status, in order.
        With ``deadline`` (monotonic seconds) the whole call ends by then: keys not read
        by then are ``ERROR`` (else each socket operation waits ``op_timeout_s`` at most).
        With ``on_loaded``, it is called with the indices (into ``items``) of keys found
        ``LOADED``, a batch at a time as their replies are read (from the transfer
        threads, while later replies are still arriving), before the call returns; a key
        reported there can still end ``ERROR`` if its connection fails later.

        ``parts`` is how the values are split (as ``store`` wrote them); a value split
        otherwise is ``INVALID``. With ``on_part`` (and several parts) part ``i`` of
        every key of a connection is read before part ``i + 1`` of any, and
        ``on_part(i, indices)`` is called once those keys' part ``i`` has been received
        (or found failed): their destinations hold that part's bytes, but a key is
        proven valid only by its final status (the checksum covers the whole payload).

        A destination's content is meaningful only where the status is ``LOADED``: a
        value that fails validation is reported ``INVALID`` and a missing key
        ``MISSING``; a connection failure marks the keys of that connection ``ERROR``.
        """
        raw = self.load_raw(items, fingerprint, **options)
        return self._settled(items, raw, LoadStatus.ERROR)

    def load_raw(
        self,
        items: KeyedBuffers,
        fingerprint: bytes,
        *,
        asking: bool = False,
        **options: Unpack[LoadOptions],
    ) -> list[LoadStatus | RedisRedirectError]:
        """``load`` without counting, a ``MOVED``/``ASK`` answer returned as its error
        (for the cluster client); with ``asking`` each ``HMGET`` follows an ``ASKING``."""
        if not items:
            return []
        dests = [target_views(d) for _, d in items]
        sub = [(_key_bytes(k), dests[i]) for i, (k, _) in enumerate(items)]
        total = sum(views_nbytes(d) for d in dests)
        error: LoadStatus | RedisRedirectError = LoadStatus.ERROR
        split = part_split(options.get("parts"))
        by_part = options.get("on_part") if split is not None else None
        deadline, on_loaded = options.get("deadline"), options.get("on_loaded")
        return self._fan_out(
            len(sub),
            total,
            lambda rng: self._load_range(
                sub, rng, fingerprint, asking, deadline, on_loaded, split, by_part
            ),
            error,
        )

    def _load_range(
        self,
        sub: Sequence[tuple[bytes, list[memoryview]]],
        rng: range,
        fingerprint: bytes,
        asking: bool = False,
        deadline: float | None = None,
        on_loaded: LoadedCallback | None = None,
        parts: tuple[int, ...] | None = None,
        on_part: PartCallback | None = None,
    ) -> list[LoadStatus | RedisRedirectError]:
        window = max(1, self.settings.max_inflight_bytes // 2)
        idx = list(rng)
        pre = ASKING if asking else b""
        if parts is not None and on_part is not None:
            return self._load_range_by_part(
                sub, idx, fingerprint, pre, deadline, on_loaded, parts, on_part
            )
        nparts = _part_count(parts)

        def read(conn: RedisConnection, g: range) -> list[LoadStatus | RedisRedirectError]:
            res = []
            for j in g:
                v = ValueRead(*sub[idx[j]])
                if self._values.read_fields(
                    conn.reader, v, fingerprint, parts, 0, nparts, bool(pre)
                ):
                    self._values.finish_value(v)
                assert v.status is not None
                res.append(v.status)
            if on_loaded is not None:
                done = [idx[j] for j, st in zip(g, res, strict=True) if st is LoadStatus.LOADED]
                if done:
                    on_loaded(done)
            return res

        windows = _byte_windows([views_nbytes(sub[i][1]) + 128 for i in idx], window)
        with self.pool.connection(deadline=deadline) as conn:
            return self._windowed(
                windows,
                lambda g: send_buffers(
                    conn.sock,
                    [b"".join(pre + hmget_command(sub[idx[j]][0], nparts) for j in g)],
                    use_sendmsg=False,
                    deadline=deadline,
                ),
                lambda g: read(conn, g),
            )

    def _load_range_by_part(
        self,
        sub: Sequence[tuple[bytes, list[memoryview]]],
        idx: list[int],
        fingerprint: bytes,
        pre: bytes,
        deadline: float | None,
        on_loaded: LoadedCallback | None,
        parts: tuple[int, ...],
        on_part: PartCallback,
    ) -> list[LoadStatus | RedisRedirectError]:
        """Part 0 (with the header) of every key, then part 1 of every key, ...; reports
        each part through ``on_part`` once this connection's keys have it."""
        window = max(1, self.settings.max_inflight_bytes // 2)
        units = [(p, j) for p in range(len(parts)) for j in range(len(idx))]
        state = [ValueRead(*sub[i]) for i in idx]
        last = len(idx) - 1

        def command(p: int, j: int) -> bytes:
            key = sub[idx[j]][0]
            return pre + (hmget_command(key, 1) if p == 0 else hmget_part_command(key, p))

        def read(conn: RedisConnection, g: range) -> list[None]:
            for u in g:
                p, j = units[u]
                self._values.read_fields(conn.reader, state[j], fingerprint, parts, p, 1, bool(pre))
                if j == last:  # a key sent elsewhere (MOVED, ASK) is reported from there
                    on_part(
                        p,
                        [
                            i
                            for i, st in zip(idx, state, strict=True)
                            if not isinstance(st.status, RedisRedirectError)
                        ],
                    )
            return []

        windows = _byte_windows([parts[p] + 128 for p, _ in units], window)
        with self.pool.connection(deadline=deadline) as conn:
            self._windowed(
                windows,
                lambda g: send_buffers(
                    conn.sock,
                    [b"".join(command(*units[u]) for u in g)],
                    use_sendmsg=False,
                    deadline=deadline,
                ),
                lambda g: read(conn, g),
            )
        out: list[LoadStatus | RedisRedirectError] = []
        for v in state:
            if v.status is None:
                self._values.finish_value(v)
            assert v.status is not None
            out.append(v.status)
        if on_loaded is not None:
            done = [i for i, st in zip(idx, out, strict=True) if st is LoadStatus.LOADED]
            if done:
                on_loaded(done)
        return out

    # -- misc -------------------------------------------------------------------------

    def delete(self, keys: Sequence[str | bytes], *, deadline: float | None = None) -> int:
        """UNLINK keys; the number removed (0 on error, or when ``deadline``, monotonic
        seconds, passes first)."""
        if not keys:
            return 0
        try:
            reply = self._command("UNLINK", *[_key_bytes(k) for k in keys], deadline=deadline)
        except RedisDataPlaneError:
            return 0
        return reply if isinstance(reply, int) else 0

    def ping(self) -> float | None:
        """Round-trip seconds of a PING, or None when the server does not answer."""
        t0 = time.perf_counter()
        try:
            reply = self._command("PING")
        except RedisDataPlaneError:
            return None
        return time.perf_counter() - t0 if reply == "PONG" else None

    def close(self) -> None:
        """Stop the I/O threads and close connections."""
        self._executor.shutdown(wait=True)
        self.lookup_conn.close()
        self.pool.close()
