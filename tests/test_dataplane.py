"""The data plane against real redis-server processes."""

from __future__ import annotations

import socket
import struct
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import redis
from fake_servers import FakeServer, FrozenServer, loading_server
from helpers import check_stored_markers
from keys import block_keys, counter_prefix, rank_prefixes
from typed_redis import raw
from waiting import wait_until

from umbp_redis.data import parse_key
from umbp_redis.store import plane as dataplane
from umbp_redis.store import resp
from umbp_redis.store.errors import RedisLoadingError, RedisUnavailableError
from umbp_redis.store.plane import LoadStatus, RedisDataPlane, StoreStatus, _transaction_status
from umbp_redis.store.settings import RedisSettings
from umbp_redis.store.value_format import HEADER, HEADER_SIZE, MAGIC, body_length, key_digest
from umbp_redis.testing.embedded_redis import EmbeddedRedis, free_port

FP = b"\x07" * 16


def make_plane(url: str, **kw) -> RedisDataPlane:  # type: ignore[no-untyped-def]
    return RedisDataPlane(RedisSettings.from_url(url, **kw))


def warmed(d: RedisDataPlane) -> RedisDataPlane:
    """``d`` once its lookup connection is made. A lookup never waits past
    ``lookup_timeout_s``, making that connection (off the caller's thread) included: on
    a loaded machine a new plane's first lookup can read as unknown. Tests of what
    lookups answer wait for the connection first."""
    d.warm_up()
    wait_until(lambda: d.lookup_conn.connects, what="the lookup connection")
    return d


@pytest.fixture
def plane(redis_url: str) -> Iterator[RedisDataPlane]:
    d = warmed(make_plane(redis_url, checksum=True))
    yield d
    d.close()


def payloads(n: int, size: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, size), dtype=np.uint8)


# --- lookup --------------------------------------------------------------------------


def test_lookup_reports_presence_in_order(plane: RedisDataPlane, redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)
    keys = block_keys(300)
    present = {i for i in range(300) if (i * 7) % 3 == 0}
    for i in present:
        r.set(keys[i], b"x")
    assert plane.lookup(keys, refresh_ttl=False) == [i in present for i in range(300)]
    assert plane.lookup([]) == []
    assert r.ttl(keys[0]) == -1  # no refresh asked


def test_a_scheduler_lookup_of_1000_blocks_is_one_send(
    plane: RedisDataPlane, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scheduler's path: blocks encoded by ``lookup_encoder``, asked with
    ``lookup_blocks``: every command in one pre-encoded buffer, one send."""
    sent: list[int] = []
    real = resp.send_buffers

    def counting(sock, buffers, *, use_sendmsg, deadline=None):  # type: ignore[no-untyped-def]
        sent.append(len(buffers))
        return real(sock, buffers, use_sendmsg=use_sendmsg, deadline=deadline)

    prefixes = rank_prefixes("onesend")
    enc = plane.lookup_encoder(prefixes, refresh_ttl=True, hash_hex_len=64)
    blocks = [enc.encode(b"%064x" % i) for i in range(1000)]
    monkeypatch.setattr("umbp_redis.store.plane.send_buffers", counting)
    assert plane.lookup_blocks(blocks, 1000 * enc.replies) == [0] * 1000
    assert sent == [1]


def test_lookup_refreshes_ttl_of_hits(plane: RedisDataPlane, redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)
    keys = block_keys(3)
    r.set(keys[0], b"x", ex=10)
    assert plane.lookup(keys, refresh_ttl=True) == [True, False, False]
    assert r.ttl(keys[0]) > 10_000  # re-armed to ttl_seconds (default 86400)
    assert not r.exists(keys[1])


def test_request_counts_ride_with_a_lookup_and_a_full_redis_refusing_them_fails_nothing(
    own_redis: EmbeddedRedis,
) -> None:
    r = redis.Redis.from_url(own_redis.url)
    plane = warmed(make_plane(own_redis.url, ttl_seconds=600))
    (prefix,) = rank_prefixes("cnt")
    counters = counter_prefix("cnt")
    enc = plane.lookup_encoder([prefix], refresh_ttl=True, hash_hex_len=64)
    cnt = plane.request_count_encoder(counters, hash_hex_len=64)
    hashes = [b"%064x" % i for i in range(3)]
    r.set(prefix + hashes[0], b"x")
    blocks = [enc.encode(h) for h in hashes] + [cnt.encode(h) for h in hashes]
    # Lookup replies, then (count, EXPIRE's 1) per block.
    assert plane.lookup_blocks(blocks, 9, counted_from=3) == [1, 0, 0, 1, 1, 1, 1, 1, 1]
    assert plane.lookup_blocks(blocks, 9, counted_from=3) == [1, 0, 0, 2, 1, 2, 1, 2, 1]
    assert 0 < r.ttl(counters + hashes[1]) <= 600
    with pytest.raises(ValueError):
        parse_key(counters + hashes[1])  # not a block key: ls and inspect skip it
    # A full Redis that evicts nothing refuses INCR: the counts read 0 (nothing is
    # admitted), the lookup still answers.
    r.config_set("maxmemory-policy", "noeviction")
    r.config_set("maxmemory", 1)
    assert plane.lookup_blocks(blocks, 9, counted_from=3) == [1, 0, 0, 0, 1, 0, 1, 0, 1]
    assert r.get(counters + hashes[0]) == b"2"
    plane.close()


def test_stored_markers_are_written_refreshed_and_removed_on_a_server(
    plane: RedisDataPlane, redis_url: str
) -> None:
    r = redis.Redis.from_url(redis_url)
    check_stored_markers(plane, r)
    r.close()


def test_keyed_commands_read_an_error_reply_as_unknown(
    plane: RedisDataPlane, redis_url: str
) -> None:
    r = redis.Redis.from_url(redis_url)
    h, s, n = (k.encode() for k in block_keys(3, "keyed"))
    r.hset(h, "f", b"x")
    cmds = [
        (h, resp.encode_command(b"INCR", h)),
        (s, resp.encode_command(b"SET", s, b"1")),
        (n, resp.encode_command(b"EXPIRE", n, b"9")),
    ]
    # WRONGTYPE says nothing about the key's presence: -1, not the 0 of an absent key.
    assert plane.run_keyed(cmds, timeout=2.0) == [-1, 1, 0]
    r.close()


def test_keyed_commands_to_no_server_end_within_their_timeout(own_redis: EmbeddedRedis) -> None:
    """Refused, or sent to a server that stops answering: None (counted), by the call's
    ``timeout``, whatever ``connect_timeout_s`` and ``op_timeout_s`` (an hour here) say:
    the calls return with the server still frozen, on the connection they had and
    on a new one."""
    k = block_keys(1, "keyed")[0].encode()
    cmd = [(k, resp.encode_command(b"SET", k, b"1"))]
    d = make_plane(f"redis://127.0.0.1:{free_port()}", connect_timeout_s=0.2)
    assert d.run_keyed(cmd, timeout=0.5) is None
    assert d.counters()["upkeep_errors"] == 1
    d.close()
    d = make_plane(own_redis.url, connect_timeout_s=3600, op_timeout_s=3600, fail_fast_s=0)
    assert d.run_keyed(cmd, timeout=10) == [1]  # connected
    with FrozenServer(own_redis) as frozen:
        assert d.run_keyed(cmd, timeout=0.5) is None  # on the connection it had
        assert d.run_keyed(cmd, timeout=0.5) is None  # on a new one (that one was closed)
        assert frozen.still_frozen  # ended by their timeout: nothing was answered
    assert d.counters()["upkeep_errors"] == 2
    assert d.pool.connects == 1  # the new connection's handshake was never answered
    d.close()


# --- values in parts (loads by layer) --------------------------------------------------

PARTS = (96 << 10, 64 << 10, (160 << 10) + 7)


@pytest.mark.parametrize("connections", [1, 3])
def test_values_in_parts_load_whole_or_a_part_of_every_key_at_a_time(
    redis_url: str, connections: int
) -> None:
    """Stored in parts, a value is one field per part; loaded whole it is byte-exact; by
    part, part i of every key of a connection is in its destination when reported and
    before part i + 1 of any, and the checksum still decides the final status."""
    r = redis.Redis.from_url(redis_url)
    size = sum(PARTS)
    n = 12
    d = make_plane(redis_url, checksum=True, transfer_connections=connections)
    try:
        src = payloads(n, size, seed=31)
        keys = block_keys(n, f"parts{connections}")
        assert (
            d.store(list(zip(keys, src, strict=True)), FP, parts=PARTS) == [StoreStatus.STORED] * n
        )
        assert sorted(r.hkeys(keys[0])) == [b"b", b"b1", b"b2", b"h"]
        assert [r.hstrlen(keys[0], f) for f in ("b", "b1", "b2")] == [body_length(x) for x in PARTS]
        whole = np.zeros_like(src)
        items = [(k, memoryview(whole[i])) for i, k in enumerate(keys)]
        assert d.load(items, FP, parts=PARTS) == [LoadStatus.LOADED] * n
        assert np.array_equal(src, whole)
        # A reader expecting another split (or none) finds them invalid, not loaded.
        other = np.zeros_like(src)
        items = [(k, memoryview(other[i])) for i, k in enumerate(keys)]
        assert d.load(items, FP) == [LoadStatus.INVALID] * n
        assert d.load(items, FP, parts=PARTS[::-1]) == [LoadStatus.INVALID] * n

        # By part: damage part 2 of key 5; every key's parts arrive in order.
        body = bytearray(raw(r.hget(keys[5], "b2")))
        body[3] ^= 0xFF
        r.hset(keys[5], "b2", bytes(body))
        dst = np.zeros_like(src)
        starts = np.cumsum((0,) + PARTS)
        seen: dict[int, list[int]] = {}
        lock = threading.Lock()
        wrong: list[tuple[int, int]] = []

        def arrived(part: int, indices: list[int]) -> None:
            lo, hi = starts[part], starts[part + 1]
            with lock:
                for i in indices:
                    if seen.get(i, [-1])[-1] != part - 1:
                        wrong.append((i, part))  # out of order
                    seen.setdefault(i, []).append(part)
                    if i != 5 or part < 2:  # the bytes are there when reported
                        if not np.array_equal(dst[i, lo:hi], src[i, lo:hi]):
                            wrong.append((i, part))

        items = [(k, memoryview(dst[i])) for i, k in enumerate(keys)]
        st = d.load(items, FP, parts=PARTS, on_part=arrived)
        assert st == [LoadStatus.INVALID if i == 5 else LoadStatus.LOADED for i in range(n)]
        assert not wrong and all(seen[i] == [0, 1, 2] for i in range(n))
        assert np.array_equal(np.delete(src, 5, 0), np.delete(dst, 5, 0))
        # A value deleted before its load: missing, its parts reported all the same.
        r.delete(keys[7])
        seen.clear()
        st = d.load(items, FP, parts=PARTS, on_part=arrived)
        assert st[7] is LoadStatus.MISSING and seen[7] == [0, 1, 2]
        # A later part gone (the value removed or rewritten between two parts' reads):
        # nothing is known of it, an error, not invalid; the other keys still load.
        r.hdel(keys[3], "b1")
        for by_part in (arrived, None):
            st = d.load(items, FP, parts=PARTS, on_part=by_part)
            assert st[3] is LoadStatus.ERROR and st[4] is LoadStatus.LOADED
    finally:
        d.close()


# --- store ---------------------------------------------------------------------------


def test_store_then_load_is_byte_exact_with_ttl(plane: RedisDataPlane, redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)
    for size in (1000, 65536, 2 << 20, 3 * 65536 + 123):
        src = payloads(6, size, seed=size)
        keys = block_keys(6, f"{size:x}")
        assert plane.store(list(zip(keys, src, strict=True)), FP) == [StoreStatus.STORED] * 6
        for k in keys:
            assert 86000 < r.ttl(k) <= 86400
            assert r.hstrlen(k, "b") == body_length(size)
        dst = np.zeros_like(src)
        st = plane.load([(k, memoryview(dst[i])) for i, k in enumerate(keys)], FP)
        assert st == [LoadStatus.LOADED] * 6
        assert np.array_equal(src, dst)


def test_store_takes_the_ttl_seconds_option(redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)
    k = block_keys(1)[0]
    short = make_plane(redis_url, ttl_seconds=60)
    try:
        short.store([(k, payloads(1, 100)[0])], FP)
    finally:
        short.close()
    assert 0 < r.ttl(k) <= 60


def test_store_sends_staging_memory_without_copies(
    plane: RedisDataPlane, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = payloads(4, 65536)
    seen: list[memoryview] = []
    real = resp.send_buffers

    def spy(sock, buffers, *, use_sendmsg):  # type: ignore[no-untyped-def]
        seen.extend(b for b in buffers if isinstance(b, memoryview))
        return real(sock, buffers, use_sendmsg=use_sendmsg)

    monkeypatch.setattr("umbp_redis.store.plane.send_buffers", spy)
    plane.store(list(zip(block_keys(4), src, strict=True)), FP)
    assert len(seen) == 4
    for i, mv in enumerate(seen):
        assert np.shares_memory(np.asarray(mv), src[i])  # a view of the staging row
        assert mv.nbytes == body_length(65536)


def test_memory_footprint_within_2_percent(redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)
    d = make_plane(redis_url)

    def dataset() -> int:
        info = r.info("memory")
        return int(info["used_memory"]) - int(info["mem_clients_normal"])

    def planes_clients() -> set[str]:
        """The server's connections named by a data plane (``CLIENT SETNAME``)."""
        return {c["id"] for c in r.client_list() if c["name"] == "umbp-redis"}

    def dropped(ids: set[str]) -> Callable[[], bool]:
        return lambda: not planes_clients() & ids

    for size, count in ((65536, 256), (2 << 20, 16)):
        # SYNC: Valkey 8 frees a plain FLUSHALL's values in the background
        # (lazyfree-lazy-user-flush), which would shrink the dataset while it is measured.
        r.execute_command("FLUSHALL", "SYNC")
        before = dataset()
        earlier = planes_clients()
        d.store(list(zip(block_keys(count, f"m{size:x}"), payloads(count, size), strict=True)), FP)
        ours = planes_clients() - earlier  # the store's connections
        assert ours
        d.pool.close()  # our connections' query buffers are not the objects' footprint
        wait_until(dropped(ours), what="the server to drop the store's connections")
        ratio = (dataset() - before) / (count * size)
        assert 0.99 < ratio <= 1.02, (size, ratio)
    d.close()


# --- load: invalid values ------------------------------------------------------------


def _stored(plane: RedisDataPlane, size: int = 65536, tag: str = "inv") -> tuple[str, np.ndarray]:
    k = block_keys(1, tag)[0]
    src = payloads(1, size, seed=9)
    assert plane.store([(k, src[0])], FP) == [StoreStatus.STORED]
    return k, src


def _load_one(plane: RedisDataPlane, k: str, size: int = 65536, fp: bytes = FP) -> LoadStatus:
    dst = np.zeros(size, dtype=np.uint8)
    return plane.load([(k, dst.data)], fp)[0]


def test_missing_and_wrong_fingerprint(plane: RedisDataPlane) -> None:
    assert _load_one(plane, block_keys(1, "nothing")[0]) is LoadStatus.MISSING
    k, _ = _stored(plane)
    assert _load_one(plane, k, fp=b"\x08" * 16) is LoadStatus.INVALID
    assert _load_one(plane, k, size=65536 - 1) is LoadStatus.INVALID  # wrong length expected


@pytest.mark.parametrize(
    "damage",
    ["short", "long", "magic", "version", "checksum", "body", "no_body", "other_key", "no_csum"],
)
def test_each_invalid_value_is_reported_invalid(
    plane: RedisDataPlane, redis_url: str, damage: str
) -> None:
    r = redis.Redis.from_url(redis_url)
    k, src = _stored(plane)
    h = raw(r.hget(k, "h"))
    if damage == "short":
        r.hset(k, "h", h[: HEADER_SIZE - 5])
    elif damage == "long":
        r.hset(k, "h", h + b"\x00")
    elif damage == "magic":
        r.hset(k, "h", b"UMBX" + h[4:])
    elif damage == "version":
        r.hset(k, "h", h[:4] + struct.pack("<H", 99) + h[6:])
    elif damage == "checksum":
        b = bytearray(raw(r.hget(k, "b") or b""))
        b[100] ^= 0xFF
        r.hset(k, "b", bytes(b))
    elif damage == "body":
        r.hset(k, "b", (raw(r.hget(k, "b") or b""))[:-1])
    elif damage == "no_body":
        r.hdel(k, "b")
    elif damage == "other_key":  # a well-formed value of another block, checksum and all
        k_other, _ = _stored(plane, tag="other")
        r.copy(k_other, k, replace=True)
    elif damage == "no_csum":  # a writer without checksums; this reader requires them
        plain = make_plane(redis_url, checksum=False)
        assert plain.store([(k, src[0])], FP) == [StoreStatus.STORED]
        plain.close()
        assert plane.settings.checksum
    assert _load_one(plane, k) is LoadStatus.INVALID
    # The connection stays in sync: the next load on it is right.
    k2 = block_keys(1, "ok")[0]
    good = payloads(1, 65536, seed=3)
    plane.store([(k2, good[0])], FP)
    dst = np.zeros(65536, dtype=np.uint8)
    assert plane.load([(k2, dst.data)], FP) == [LoadStatus.LOADED]
    assert np.array_equal(dst, good[0])


@pytest.mark.parametrize("split", [None, PARTS], ids=["whole", "parts"])
def test_any_byte_of_a_header_changed_is_invalid_and_the_rest_still_loads(
    plane: RedisDataPlane, redis_url: str, split: tuple[int, ...] | None
) -> None:
    """Each byte of field ``h`` changed in turn (header, part table, tails): the value is
    INVALID, whole or a part at a time, and the valid value loaded with it in the same
    batch is byte-exact. A reader checks the header against its shape's in a few
    compares; this is what shows that shortcut lets nothing through."""
    r = redis.Redis.from_url(redis_url)
    size = sum(PARTS) if split else 65536
    src = payloads(2, size, seed=41)
    keys = block_keys(2, f"flip{len(split or ())}")
    stored = plane.store(list(zip(keys, src, strict=True)), FP, parts=split)
    assert stored == [StoreStatus.STORED] * 2
    h = raw(r.hget(keys[0], "h"))
    dst = np.zeros_like(src)
    items = [(k, memoryview(dst[i])) for i, k in enumerate(keys)]
    for i in range(len(h)):
        r.hset(keys[0], "h", h[:i] + bytes([h[i] ^ 0x21]) + h[i + 1 :])
        dst[:] = 0
        on_part = (lambda part, idx: None) if split and i % 2 else None
        st = plane.load(items, FP, parts=split, on_part=on_part)
        assert st == [LoadStatus.INVALID, LoadStatus.LOADED], i
        assert np.array_equal(dst[1], src[1])
    r.hset(keys[0], "h", h)
    assert plane.load(items, FP, parts=split) == [LoadStatus.LOADED] * 2
    assert np.array_equal(dst, src)


def test_a_key_of_another_type_is_an_error_not_invalid(
    plane: RedisDataPlane, redis_url: str
) -> None:
    r = redis.Redis.from_url(redis_url)
    k = block_keys(1, "str")[0]
    r.set(k, b"plain string")  # not ours: WRONGTYPE says nothing about our bytes
    assert _load_one(plane, k) is LoadStatus.ERROR
    assert r.get(k) == b"plain string"


@pytest.mark.parametrize(
    "error",
    [
        b"MOVED 3999 127.0.0.1:6381",
        b"ASK 3999 127.0.0.1:6381",
        b"CLUSTERDOWN The cluster is down",
        b"READONLY You can't write against a read only replica.",
        b"NOPERM No permissions to access a key",
        b"OOM command not allowed when used memory > 'maxmemory'.",
        b"TRYAGAIN Multiple keys request during rehashing of slot",
    ],
)
def test_error_replies_to_a_load_are_errors_never_invalid(error: bytes) -> None:
    srv = FakeServer(lambda data: b"-" + error + b"\r\n" * data.count(b"HMGET"))
    d = make_plane(srv.url, fail_fast_s=0)
    assert _load_one(d, block_keys(1)[0]) is LoadStatus.ERROR
    assert d.stats.snapshot()["load_invalid"] == 0
    d.close()
    srv.close()


@pytest.mark.parametrize(
    "reply",
    [
        b":abc\r\n",
        b"$zz\r\n",
        b"*2\r\n$99999999999999\r\n",
        b"?\r\n",
        b":-\r\n",
        # A 64 KiB value's framing with no CRLF after field h (the "$" is right after).
        b"*2\r\n$80\r\n" + b"h" * 80 + b"$65520\r\n" + b"b" * 65520 + b"\r\n",
    ],
    ids=["int", "bulk", "huge", "type", "sign", "no-crlf"],
)
def test_malformed_replies_are_misses_never_exceptions(reply: bytes) -> None:
    srv = FakeServer(lambda data: reply * 4)
    d = make_plane(srv.url, fail_fast_s=0, lookup_timeout_s=0.5)
    assert d.lookup(block_keys(3)) is None
    assert _load_one(d, block_keys(1)[0]) in (LoadStatus.ERROR, LoadStatus.INVALID)
    assert d.store([(block_keys(1)[0], payloads(1, 100)[0])], FP) == [StoreStatus.ERROR]
    d.close()
    srv.close()


def test_header_is_readable_with_redis_cli(
    plane: RedisDataPlane, redis_server: EmbeddedRedis
) -> None:
    k, _ = _stored(plane)
    out = subprocess.run(
        ["redis-cli", "-p", str(redis_server.port), "--no-raw", "HGET", k, "h"],
        capture_output=True,
        timeout=10,
    ).stdout
    assert out.startswith(b'"UMBP\\x02\\x00')  # magic then version 2, little-endian
    header = raw(redis.Redis(port=redis_server.port).hget(k, "h") or b"")
    magic, version, flags, fp, plen, blen, _, digest = HEADER.unpack_from(header)
    assert (magic, version, fp, plen, blen) == (MAGIC, 2, FP, 65536, 65520)
    assert flags == 1 and digest == key_digest(k.encode())  # checksummed, bound to its key


# --- bytes in flight -----------------------------------------------------------------


def test_in_flight_bound_keeps_within_client_output_buffer_limit(own_redis: EmbeddedRedis) -> None:
    r = redis.Redis.from_url(own_redis.url)
    r.config_set("client-output-buffer-limit", "normal 8mb 8mb 0")
    src = payloads(24, 2 << 20)
    keys = block_keys(24)
    bounded = make_plane(own_redis.url, max_inflight_bytes=4 << 20, transfer_connections=1)
    assert set(bounded.store(list(zip(keys, src, strict=True)), FP)) == {StoreStatus.STORED}
    dst = np.zeros_like(src)
    assert (
        bounded.load([(k, memoryview(dst[i])) for i, k in enumerate(keys)], FP)
        == [LoadStatus.LOADED] * 24
    )
    assert np.array_equal(dst, src)
    # Without the bound, the server drops the connection for exceeding its buffer limit.
    unbounded = make_plane(
        own_redis.url, max_inflight_bytes=1 << 30, transfer_connections=1, fail_fast_s=0
    )
    res = unbounded.load([(k, memoryview(dst[i])) for i, k in enumerate(keys)], FP)
    assert LoadStatus.ERROR in res
    bounded.close()
    unbounded.close()


def test_large_batches_use_several_connections(redis_url: str) -> None:
    d = make_plane(redis_url, transfer_connections=3)
    src = payloads(12, 2 << 20)
    d.store(list(zip(block_keys(12), src, strict=True)), FP)
    assert d.pool.connects == 3
    d.close()


# --- outages -------------------------------------------------------------------------


def test_connection_refused_is_a_miss_and_fails_fast() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    d = make_plane(url, fail_fast_s=30)
    assert d.lookup(block_keys(5)) is None
    assert d.store([(block_keys(1)[0], payloads(1, 100)[0])], FP) == [StoreStatus.ERROR]
    dst = np.zeros(100, dtype=np.uint8)
    assert d.load([(block_keys(1)[0], dst.data)], FP) == [LoadStatus.ERROR]
    assert d.store([(block_keys(1)[0], payloads(1, 100)[0])], FP) == [StoreStatus.ERROR]
    # One connection attempt, refused; the later calls failed fast, without trying.
    assert (d.pool.failures, d.pool.connects) == (1, 0)
    assert not d.pool.healthy
    d.close()


def test_timeout_is_bounded_and_a_miss(own_redis: EmbeddedRedis) -> None:
    """A server that stops answering: a lookup ends by ``lookup_timeout_s``, a load by
    ``op_timeout_s``, each a miss, with the server still frozen (so neither waited
    for it); once it answers again so do the calls, on fresh connections."""
    d = make_plane(own_redis.url, lookup_timeout_s=0.2, op_timeout_s=0.3, fail_fast_s=0)
    k, *absent = block_keys(4)
    item = [(k, payloads(1, 100)[0])]
    # Connected (a loaded machine may outlast 0.3 s once: that store then fails).
    wait_until(lambda: d.store(item, FP) == [StoreStatus.STORED], what="a store")
    warmed(d)
    before = d.counters()
    dst = np.zeros(100, dtype=np.uint8)
    with FrozenServer(own_redis) as frozen:
        assert d.lookup(absent) is None
        assert d.load([(k, dst.data)], FP) == [LoadStatus.ERROR]
        assert frozen.still_frozen  # ended by their timeouts: nothing was answered
    after = d.counters()
    assert after["lookup_timeouts"] - before["lookup_timeouts"] == 1
    assert after["load_errors"] - before["load_errors"] == 1
    # Back to normal on fresh connections (the lookup's is made off its thread).
    wait_until(lambda: d.lookup(absent) == [False] * 3, what="lookups answered again")
    wait_until(lambda: d.load([(k, dst.data)], FP) == [LoadStatus.LOADED], what="a load")
    d.close()


def test_a_load_with_a_deadline_ends_by_it(own_redis: EmbeddedRedis) -> None:
    """``deadline`` bounds the whole load, however long ``op_timeout_s`` is (an hour
    here): the load ends with the server still frozen."""
    d = make_plane(own_redis.url, op_timeout_s=3600, fail_fast_s=0)
    k = block_keys(1, "deadline")[0]
    assert d.store([(k, payloads(1, 4096)[0])], FP) == [StoreStatus.STORED]
    dst = np.zeros(4096, dtype=np.uint8)
    assert d.load([(k, dst.data)], FP, deadline=time.monotonic() + 30) == [LoadStatus.LOADED]
    with FrozenServer(own_redis) as frozen:
        assert d.load([(k, dst.data)], FP, deadline=time.monotonic() + 0.3) == [LoadStatus.ERROR]
        assert frozen.still_frozen  # ended by the deadline: nothing was answered
    assert d.pool.healthy  # a slow server is not an unreachable one: no fail-fast window
    assert d.load([(k, dst.data)], FP) == [LoadStatus.LOADED]
    d.close()


@pytest.mark.parametrize("cut_before", [b"*3\r\n$6\r\nEXPIRE", b"*1\r\n$4\r\nEXEC"])
def test_a_store_cut_before_its_exec_leaves_no_value_without_ttl(
    own_redis: EmbeddedRedis, monkeypatch: pytest.MonkeyPatch, cut_before: bytes
) -> None:
    """The connection dies after the server has the whole HSET (and maybe the EXPIRE)
    but not the EXEC: nothing may be written, or the value would never expire."""
    r = redis.Redis.from_url(own_redis.url)
    d = make_plane(own_redis.url, transfer_connections=1)
    assert d.store([(block_keys(1, "warm")[0], payloads(1, 64)[0])], FP) == [StoreStatus.STORED]
    assert r.info("clients")["connected_clients"] == 2  # the pool's connection is open

    def cut(sock: socket.socket, buffers: list, *, use_sendmsg: bool, deadline=None) -> None:  # type: ignore[no-untyped-def, type-arg]
        wire = b"".join(bytes(b) for b in buffers)
        sock.sendall(wire[: wire.rindex(cut_before)])
        sock.close()
        raise RedisUnavailableError("connection lost (test)")

    monkeypatch.setattr(dataplane, "send_buffers", cut)
    k = block_keys(1, "cut")[0]
    assert d.store([(k, payloads(1, 4096)[0])], FP) == [StoreStatus.ERROR]
    # Once the server has dropped the client it has read every byte that was sent.
    wait_until(
        lambda: r.info("clients")["connected_clients"] == 1,
        what=lambda: f"the server to drop the cut connection: {r.client_list()}",
    )
    assert not r.exists(k)

    monkeypatch.undo()
    # The cut connection opened the fail-fast window: stores fail until it closes.
    wait_until(lambda: d.pool.healthy, what="the fail-fast window to close")
    assert d.store([(k, payloads(1, 4096)[0])], FP) == [StoreStatus.STORED]
    assert 0 < r.ttl(k) <= 86400
    d.close()


def test_store_outcomes_from_transaction_replies(caplog: pytest.LogCaptureFixture) -> None:
    E = resp.ErrorReply
    ok = ("OK", "QUEUED", "QUEUED")
    assert _transaction_status(*ok, [2, 1])[0] is StoreStatus.STORED
    assert _transaction_status(*ok, [0, 1])[0] is StoreStatus.STORED  # overwritten
    assert _transaction_status(*ok, [2, 0])[0] is StoreStatus.ERROR  # no TTL set
    assert _transaction_status(*ok, [E("WRONGTYPE x"), 1])[0] is StoreStatus.ERROR
    oom = E("OOM command not allowed when used memory > 'maxmemory'.")
    abort = E("EXECABORT Transaction discarded because of previous errors.")
    assert _transaction_status("OK", oom, "QUEUED", abort)[0] is StoreStatus.OOM
    assert _transaction_status("OK", "QUEUED", "QUEUED", oom)[0] is StoreStatus.OOM
    assert _transaction_status(*ok, None)[0] is StoreStatus.ERROR
    status, err = _transaction_status(
        E("LOADING Redis is loading"), E("LOADING x"), E("LOADING x"), E("LOADING x")
    )
    assert status is StoreStatus.ERROR and isinstance(err, RedisLoadingError)
    assert not caplog.records  # LOADING is an outage, not a missing permission


def test_acl_user_without_transactions_still_stores_with_ttl(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(dataplane, "_warned_no_transactions", False)
    with EmbeddedRedis() as srv:
        admin, d = acl_user(srv, "-@transaction")
        keys = block_keys(3)
        with caplog.at_level("WARNING", logger="umbp_redis.store.plane"):
            st = d.store(list(zip(keys, payloads(3, 1000), strict=True)), FP)
        assert st == [StoreStatus.STORED] * 3
        assert all(0 < admin.ttl(k) <= 86400 for k in keys)
        warnings = [r for r in caplog.records if "refused MULTI" in r.getMessage()]
        assert len(warnings) == 1 and "@transaction" in warnings[0].getMessage()
        d.close()


def test_oom_is_reported_per_key(own_redis: EmbeddedRedis) -> None:
    r = redis.Redis.from_url(own_redis.url)
    r.config_set("maxmemory-policy", "noeviction")
    r.config_set("maxmemory", str(int(r.info("memory")["used_memory"]) + (3 << 20)))
    d = warmed(make_plane(own_redis.url, transfer_connections=1))
    st = d.store(list(zip(block_keys(16), payloads(16, 1 << 20), strict=True)), FP)
    assert StoreStatus.STORED in st and StoreStatus.OOM in st
    assert d.pool.healthy  # OOM is not an outage
    assert d.lookup(block_keys(1)) == [True]
    d.close()


def test_server_restart_reconnects_automatically(own_redis: EmbeddedRedis) -> None:
    d = make_plane(own_redis.url, fail_fast_s=0.3)
    k = block_keys(1)[0]
    d.store([(k, payloads(1, 100)[0])], FP)
    own_redis.kill()
    assert d.lookup([k]) is None
    own_redis.start()  # empty: it keeps nothing on disk
    # Past the fail-fast window, the lookup connection is made again by itself.
    wait_until(lambda: d.lookup([k]) == [False], what="a lookup answered by the new server")
    assert d.store([(k, payloads(1, 100)[0])], FP) == [StoreStatus.STORED]
    assert d.lookup([k]) == [True]
    d.close()


def test_loading_server_is_a_miss() -> None:
    srv = loading_server()
    d = make_plane(f"redis://127.0.0.1:{srv.port}/0", fail_fast_s=3600)
    assert d.lookup(block_keys(2)) is None
    assert d.store([(block_keys(1)[0], payloads(1, 100)[0])], FP) == [StoreStatus.ERROR]
    assert not d.pool.healthy
    srv.close()
    d.close()


# --- auth and TLS ----------------------------------------------------------------------


def test_password_auth(tmp_path: Path) -> None:
    with EmbeddedRedis(password="pw-123") as srv:
        good = warmed(make_plane(f"redis://:pw-123@127.0.0.1:{srv.port}/0"))
        assert good.lookup(block_keys(1)) == [False]
        assert good.store([(block_keys(1)[0], payloads(1, 64)[0])], FP) == [StoreStatus.STORED]
        bad = make_plane(f"redis://:wrong-pw@127.0.0.1:{srv.port}/0")
        assert bad.lookup(block_keys(1)) is None
        nopw = make_plane(srv.url)
        assert nopw.lookup(block_keys(1)) is None
        from umbp_redis.store.connection import RedisConnection
        from umbp_redis.store.errors import RedisAuthError

        with pytest.raises(RedisAuthError) as ei:
            RedisConnection(RedisSettings.from_url(f"redis://:wrong-pw@127.0.0.1:{srv.port}/0"))
        assert "wrong-pw" not in str(ei.value)
        for x in (good, bad, nopw):
            x.close()


def acl_user(srv: EmbeddedRedis, *rules: str) -> tuple[redis.Redis, RedisDataPlane]:
    """An admin client of ``srv`` and a data plane logged in as user ``umbp``, which may
    use ``umbp:*`` keys with every command but as ``rules`` take away."""
    admin = redis.Redis(port=srv.port)
    admin.execute_command("ACL", "SETUSER", "umbp", "on", ">acl-pw", "~umbp:*", "+@all", *rules)
    return admin, warmed(make_plane(f"redis://umbp:acl-pw@127.0.0.1:{srv.port}/0"))


def test_acl_user_limited_to_umbp_keys() -> None:
    with EmbeddedRedis() as srv:
        admin, d = acl_user(srv, "-@dangerous")
        ok = block_keys(2)
        assert (
            d.store(list(zip(ok, payloads(2, 1000), strict=True)), FP) == [StoreStatus.STORED] * 2
        )
        assert d.lookup(ok) == [True, True]
        dst = np.zeros(1000, dtype=np.uint8)
        assert d.load([(ok[0], dst.data)], FP) == [LoadStatus.LOADED]
        # Keys outside ~umbp:* are refused by the server.
        assert d.store([("other:key", payloads(1, 1000)[0])], FP) == [StoreStatus.ERROR]
        assert not admin.exists("other:key")
        d.close()


def _make_cert(tmp: Path) -> tuple[str, str, str]:
    ca_key, ca = tmp / "ca.key", tmp / "ca.pem"
    key, csr, cert = tmp / "srv.key", tmp / "srv.csr", tmp / "srv.pem"
    ext = tmp / "ext.cnf"
    ext.write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    run = lambda *a: subprocess.run(a, check=True, capture_output=True)  # noqa: E731
    run(
        "openssl",
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        str(ca_key),
        "-out",
        str(ca),
        "-days",
        "2",
        "-subj",
        "/CN=umbp-test-ca",
    )
    run(
        "openssl",
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        str(key),
        "-out",
        str(csr),
        "-subj",
        "/CN=localhost",
    )
    run(
        "openssl",
        "x509",
        "-req",
        "-in",
        str(csr),
        "-CA",
        str(ca),
        "-CAkey",
        str(ca_key),
        "-CAcreateserial",
        "-out",
        str(cert),
        "-days",
        "2",
        "-extfile",
        str(ext),
    )
    return str(cert), str(key), str(ca)


def test_tls_connection(tmp_path: Path) -> None:
    files = _make_cert(tmp_path)
    srv = EmbeddedRedis(tls_files=files)
    try:
        srv.start()
    except RuntimeError as e:
        srv.cleanup()
        if "Failed finding TLS support" in str(e):  # the server's own words
            pytest.skip("this server was built without TLS (BUILD_TLS=no)")
        raise
    try:
        d = make_plane(srv.url, tls_ca_cert=files[2])
        src = payloads(3, 65536)
        keys = block_keys(3)
        assert d.store(list(zip(keys, src, strict=True)), FP) == [StoreStatus.STORED] * 3
        dst = np.zeros_like(src)
        assert (
            d.load([(k, memoryview(dst[i])) for i, k in enumerate(keys)], FP)
            == [LoadStatus.LOADED] * 3
        )
        assert np.array_equal(src, dst)
        d.close()
        # Without the CA the certificate is not trusted: a miss, not a crash.
        untrusted = make_plane(srv.url)
        assert untrusted.lookup(keys) is None
        untrusted.close()
    finally:
        srv.cleanup()


def test_unix_socket() -> None:
    with EmbeddedRedis(unix_socket=True) as srv:
        d = warmed(make_plane(srv.url))
        k = block_keys(1)[0]
        assert d.store([(k, payloads(1, 5000)[0])], FP) == [StoreStatus.STORED]
        assert d.lookup([k]) == [True]
        d.close()


def test_reply_buffer_gives_memory_back_after_a_large_reply(plane: RedisDataPlane) -> None:
    # This payload keeps a 2 MiB tail in field h, which the reader buffers whole.
    size = (10 << 20) - 100
    assert size - body_length(size) > 4 * resp._READ_CHUNK
    k = block_keys(1, "big")[0]
    src = payloads(1, size)
    assert plane.store([(k, src[0])], FP) == [StoreStatus.STORED]
    dst = np.zeros(size, dtype=np.uint8)
    assert plane.load([(k, dst.data)], FP) == [LoadStatus.LOADED]
    assert np.array_equal(dst, src[0])
    small = block_keys(1, "small")[0]
    plane.store([(small, payloads(1, 64)[0])], FP)
    assert plane.load([(small, np.zeros(64, dtype=np.uint8).data)], FP) == [LoadStatus.LOADED]
    with plane.pool.connection() as conn:
        assert len(conn.reader.buf) <= 4 * resp._READ_CHUNK


@pytest.mark.parametrize("size", [65536, 3 * 65536 + 123, (2 << 20) - 5000])
def test_load_into_pieces_equals_load_into_one_buffer(
    plane: RedisDataPlane, redis_url: str, size: int
) -> None:
    """A destination given as consecutive pieces (a block's pages in the KV cache) gets
    the same bytes, with the header's tail (``body_length(size) < size``) and checksum
    spread over the pieces; a corrupted value is invalid either way."""
    src = payloads(3, size, seed=size)
    keys = block_keys(3, f"pc{size:x}")
    assert plane.store(list(zip(keys, src, strict=True)), FP) == [StoreStatus.STORED] * 3
    whole = np.zeros_like(src)
    parts = np.zeros_like(src)
    cuts = [0, 1, size // 3, size - 7, size]  # a 1-byte piece and one inside the tail
    pieces = [[parts[i][a:b].data for a, b in zip(cuts, cuts[1:], strict=False)] for i in range(3)]
    assert (
        plane.load([(k, whole[i].data) for i, k in enumerate(keys)], FP) == [LoadStatus.LOADED] * 3
    )
    assert plane.load(list(zip(keys, pieces, strict=True)), FP) == [LoadStatus.LOADED] * 3
    assert np.array_equal(whole, src) and np.array_equal(parts, src)
    r = redis.Redis.from_url(redis_url)
    body = bytearray(raw(r.hget(keys[1], "b")))
    body[len(body) // 2] ^= 0x01
    r.hset(keys[1], "b", bytes(body))
    st = plane.load(list(zip(keys, pieces, strict=True)), FP)
    assert st == [LoadStatus.LOADED, LoadStatus.INVALID, LoadStatus.LOADED]
    # Pieces that do not add up to the stored size are an invalid value, not an overrun.
    short = [parts[0][: size // 2].data, parts[0][size // 2 : size - 1].data]
    assert plane.load([(keys[0], short)], FP) == [LoadStatus.INVALID]


class ReaderEnd:
    """The reader's end of a socket pair, watched: each receive takes at most ``cap``
    bytes (the rest as if still on its way) and is counted in ``receives``; ``began``
    is set as each begins (a sender waits on it for the reader to be waiting). With
    ``scatter`` False it has no ``recvmsg_into``, as a TLS socket (one read per piece)."""

    def __init__(self, sock: socket.socket, cap: int = 1 << 20, scatter: bool = True) -> None:
        self.sock = sock
        self.cap = cap
        self.receives = 0
        self.began = threading.Event()
        self.settimeout = sock.settimeout
        self.setblocking = sock.setblocking
        if scatter:
            self.recvmsg_into = self._recvmsg_into

    def recv_into(self, buf: memoryview) -> int:
        self.receives += 1
        self.began.set()
        return self.sock.recv_into(memoryview(buf)[: self.cap])

    def _recvmsg_into(self, buffers: list[memoryview]) -> tuple[int, list, int, object]:  # type: ignore[type-arg]
        self.receives += 1
        self.began.set()
        capped, left = [], self.cap
        for b in buffers:
            if not left:
                break
            capped.append(memoryview(b)[:left])
            left -= capped[-1].nbytes
        return self.sock.recvmsg_into(capped)

    def send_once_waiting(self, peer: socket.socket, data: bytes) -> threading.Thread:
        """Send ``data`` from ``peer`` once the reader has begun its next receive."""
        self.began.clear()

        def send() -> None:
            assert self.began.wait(10), "the reader never waited"
            peer.sendall(data)

        t = threading.Thread(target=send)
        t.start()
        return t


@pytest.mark.parametrize("scatter_read", [True, False])
def test_reading_into_pieces_takes_buffered_then_received_bytes(scatter_read: bool) -> None:
    """``read_exact_into_pieces`` over a socket pair: bytes already buffered go first,
    the rest arrives in small receives; with ``recvmsg_into`` (scatter reads) and
    without (as over TLS: one read per piece)."""
    a, b = socket.socketpair()
    a.settimeout(10)
    data = bytes(range(256)) * 40
    end = ReaderEnd(a, cap=777, scatter=scatter_read)
    reader = resp.ReplyReader(end)  # type: ignore[arg-type]
    b.sendall(data[:100])
    reader._fill()
    assert reader.end - reader.start == 100
    b.sendall(data[100:])  # all of it fits in the socket's buffer; read 777 bytes at a time
    received = end.receives
    out = bytearray(len(data))
    view = memoryview(out)
    cuts = [0, 1, 51, 5051, len(data)]
    reader.read_exact_into_pieces([view[x:y] for x, y in zip(cuts, cuts[1:], strict=False)])
    assert bytes(out) == data
    assert end.receives - received >= -(-(len(data) - 100) // 777)  # in small receives
    a.close()
    b.close()


def test_reading_a_known_framing_takes_it_whole_or_nothing() -> None:
    """``read_expected`` takes a reply's known framing and field only when all of it is
    there; a reply of another shape, or one cut short in the buffer, is left untouched
    for the field-by-field parser, and it never waits on bytes that may not come."""
    a, b = socket.socketpair()
    a.settimeout(10)
    reader = resp.ReplyReader(a)
    frame = b"*2\r\n$4\r\n"
    # A missing key's reply: shorter than the frame promises; nothing is consumed. The
    # socket does not block: a receive with nothing there (a wait) would raise.
    b.sendall(b"*2\r\n$-1\r\n$-1\r\n")
    a.setblocking(False)
    assert reader.read_expected(frame, 4) is None
    a.settimeout(10)
    assert reader.read_reply() == [None, None]
    # The expected reply, in one send: the field comes back, the next field follows.
    b.sendall(b"*2\r\n$4\r\nhead\r\n$3\r\nabc\r\n")
    assert reader.read_expected(frame, 4) == b"head"
    assert reader.read_reply() == b"abc"
    # Cut in the middle of the field: nothing consumed, the parser reads it all.
    b.sendall(b"*2\r\n$4\r\nhe")
    reader._fill()
    assert reader.read_expected(frame, 4) is None
    b.sendall(b"ad\r\n$3\r\nxyz\r\n")
    assert reader.read_reply() == [b"head", b"xyz"]
    # Same framing, no CRLF after the field: not taken (the parser then refuses it).
    b.sendall(b"*2\r\n$4\r\nheadXX$3\r\nabc\r\n")
    assert reader.read_expected(frame, 4) is None
    with pytest.raises(resp.RedisProtocolError):
        reader.read_reply()
    a.close()
    b.close()


def test_expected_replies_are_taken_whole_and_waited_for_only_once_begun() -> None:
    """``take_expected`` takes a candidate reply only whole, waits for more only while
    nothing is buffered or what is buffered begins a candidate (the replies it begins
    must then go on), and leaves any other reply untouched for the parser."""
    a, b = socket.socketpair()
    a.settimeout(10)
    end = ReaderEnd(a)
    reader = resp.ReplyReader(end)  # type: ignore[arg-type]
    usual = (b"+OK\r\n:0\r\n", b"+OK\r\n:2\r\n")

    # Nothing buffered: it waits for the first bytes (sent only once it waits), then
    # takes the second candidate.
    t = end.send_once_waiting(b, usual[1] + b":7\r\n")
    assert reader.take_expected(usual) == 1
    t.join()
    assert reader.read_reply() == 7
    # The start of a candidate, cut mid-reply: it waits for the rest.
    b.sendall(b"+OK\r\n:")
    reader._fill()
    t = end.send_once_waiting(b, b"0\r\n")
    assert reader.take_expected(usual) == 0
    t.join()
    # A reply of another form, buffered whole: nothing consumed, no wait (the socket
    # does not block: a receive with nothing there would raise).
    b.sendall(b"-ERR no\r\n")
    reader._fill()
    a.setblocking(False)
    assert reader.take_expected(usual) is None
    a.settimeout(10)
    assert isinstance(reader.read_reply(), resp.ErrorReply)
    # Begins like a candidate, turns out another (":5"): nothing consumed.
    b.sendall(b"+OK\r\n:5\r\n")
    reader._fill()
    assert reader.take_expected(usual) is None
    assert [reader.read_reply(), reader.read_reply()] == ["OK", 5]
    a.close()
    b.close()


def test_stores_over_values_of_another_split_read_every_reply(redis_url: str) -> None:
    """A store whose replies are not the usual ones (its HSET added some fields, not
    none or all) is read reply by reply and still reported stored, in order with the
    usual ones; the values load byte-exact."""
    size = sum(PARTS)
    d = make_plane(redis_url, max_inflight_bytes=4 * size, transfer_connections=1)
    try:
        keys = block_keys(9, "resplit")
        src = payloads(9, size, seed=41)
        items = list(zip(keys, src, strict=True))
        # Keys 0-2 hold a whole value, 3-5 a value in two parts, 6-8 nothing.
        assert d.store(items[:3], FP) == [StoreStatus.STORED] * 3
        two = (PARTS[0], size - PARTS[0])
        assert d.store(items[3:6], FP, parts=two) == [StoreStatus.STORED] * 3
        assert d.store(items, FP, parts=PARTS) == [StoreStatus.STORED] * 9
        out = np.zeros_like(src)
        assert (
            d.load([(k, memoryview(out[i])) for i, k in enumerate(keys)], FP, parts=PARTS)
            == [LoadStatus.LOADED] * 9
        )
        assert np.array_equal(out, src)
        d.delete(keys)
    finally:
        d.close()


def test_on_loaded_reports_valid_keys_a_window_at_a_time(redis_url: str) -> None:
    """``on_loaded`` gets the indices of valid keys while later replies are still to be
    read (one call per window here), never a missing or invalid one."""
    size = 8192
    plane = make_plane(redis_url, max_inflight_bytes=4 * size, transfer_connections=1)
    keys = block_keys(12, "ol")
    data = payloads(12, size, seed=5)
    assert plane.store(list(zip(keys, data, strict=True)), FP) == [StoreStatus.STORED] * 12
    r = redis.Redis.from_url(redis_url)
    r.delete(keys[3])  # missing
    r.hset(keys[7], "b", b"\x00" * body_length(size))  # fails its checksum
    dest = np.zeros_like(data)
    calls: list[tuple[list[int], bool]] = []

    def on_loaded(done: list[int]) -> None:
        # Whether the last key's value is still to come when this batch is reported.
        calls.append((done, not dest[11].any()))

    st = plane.load([(k, memoryview(dest[i])) for i, k in enumerate(keys)], FP, on_loaded=on_loaded)
    loaded = [i for i, s in enumerate(st) if s is LoadStatus.LOADED]
    assert loaded == [i for i in range(12) if i not in (3, 7)]
    assert sorted(i for done, _ in calls for i in done) == loaded
    assert len(calls) >= 4 and calls[0][1]  # several windows; the first before the end
    assert np.array_equal(dest[loaded], data[loaded])
    plane.delete(keys)
    plane.close()
