"""Lookups never wait longer than ``lookup_timeout_s``; auth problems are loud, not silent.

Real redis-server processes (one frozen for as long as a test needs it silent), plus
raw sockets for servers that never answer. A lookup bounded by ``lookup_timeout_s`` is
proven so by returning at all while every other option it could wait on
(``connect_timeout_s``, ``op_timeout_s``) is an hour: no call is timed. A lookup that
hung instead would be stopped by pytest-timeout (or, frozen, by the freeze's watchdog).
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator

import numpy as np
import pytest
import redis
from fake_servers import FakeServer, FrozenServer
from helpers import check_stored_markers, documented_acl
from keys import block_keys
from waiting import wait_until

from umbp_redis.data import BlockIdentityCodec
from umbp_redis.store import resp
from umbp_redis.store.deployment import open_plane
from umbp_redis.store.plane import LoadStatus, RedisDataPlane, StoreStatus
from umbp_redis.store.settings import RedisSettings
from umbp_redis.testing.embedded_redis import EmbeddedRedis

FP = b"\x05" * 16
TIMEOUT = 0.25
# What a lookup must not depend on: far beyond anything a test waits for.
HOUR = 3600.0
NS = "bl"


def make_plane(url: str, **kw) -> RedisDataPlane:  # type: ignore[no-untyped-def]
    return RedisDataPlane(RedisSettings.from_url(url, lookup_timeout_s=TIMEOUT, **kw))


def unbounded_but_for_lookups(url: str, **kw) -> RedisDataPlane:  # type: ignore[no-untyped-def]
    """A plane whose connects and operations may take an hour: a lookup that returns
    was ended by ``lookup_timeout_s``."""
    return make_plane(url, connect_timeout_s=HOUR, op_timeout_s=HOUR, **kw)


def warmed(plane: RedisDataPlane) -> RedisDataPlane:
    """``plane`` once its lookup connection is made (off the caller's thread: on a
    loaded machine a new plane's first lookup can read as unknown)."""
    plane.warm_up()
    wait_until(lambda: plane.lookup_conn.connects, what="the lookup connection")
    return plane


def unanswered_lookups(plane: RedisDataPlane, n: int = 8) -> None:
    """``n`` lookups that each end as unknown (None) and count as timeouts."""
    before = plane.stats.snapshot()["lookup_timeouts"]
    for _ in range(n):
        assert plane.lookup(block_keys(50, namespace=NS)) is None
    assert plane.stats.snapshot()["lookup_timeouts"] - before == n


@pytest.fixture
def silent() -> Iterator[FakeServer]:
    s = FakeServer()  # reads, never answers
    yield s
    s.close()


def test_a_server_that_accepts_and_never_replies(silent: FakeServer) -> None:
    # The lookup connection's handshake is never answered: every lookup waits for it
    # until its own timeout, never for connect_timeout_s or op_timeout_s.
    plane = unbounded_but_for_lookups(f"redis://127.0.0.1:{silent.port}/0")
    unanswered_lookups(plane)
    assert plane.lookup_conn.connects == 0  # the handshake is still pending
    assert plane.lookup_conn.health.healthy  # waiting is not failing: no fail-fast window
    plane.close()


def _connects_hang(port: int) -> bool:
    """Whether a connect to ``port`` is left unanswered (its SYN dropped)."""
    probe = socket.socket()
    probe.settimeout(0.3)  # a probe's patience, not a bound on the code under test
    try:
        probe.connect(("127.0.0.1", port))
    except OSError:
        return True
    finally:
        probe.close()
    return False


def test_an_address_that_drops_syns() -> None:
    # A listener that never accepts, its backlog filled: the kernel drops further SYNs
    # and a connect hangs until its own timeout (an hour here).
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(0)
    port = lst.getsockname()[1]
    fillers = []
    for _ in range(8):
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(("127.0.0.1", port))
        fillers.append(s)
    # The setup works once a connect hangs (the fillers filled the backlog).
    wait_until(lambda: _connects_hang(port), 5, what="connects to a full backlog to hang")
    plane = unbounded_but_for_lookups(f"redis://127.0.0.1:{port}/0")
    unanswered_lookups(plane)
    assert plane.lookup_conn.connects == 0  # the connect is still pending
    assert plane.lookup_conn.health.healthy
    plane.close()
    for s in [*fillers, lst]:
        s.close()


def test_a_frozen_server_bounds_lookups_and_opens_no_fail_fast_window(
    own_redis: EmbeddedRedis,
) -> None:
    # A fail-fast window would last an hour: any opened would fail every later call.
    plane = warmed(unbounded_but_for_lookups(own_redis.url, fail_fast_s=HOUR))
    k = block_keys(1, "s", NS)[0]
    assert plane.store([(k, np.ones(64, dtype=np.uint8))], FP) == [StoreStatus.STORED]
    assert plane.lookup([k]) == [True]  # the warm connection is up
    with FrozenServer(own_redis) as frozen:
        # On the warm connection: ended by lookup_timeout_s, nothing was answered.
        unanswered_lookups(plane, n=1)
        assert frozen.still_frozen
        # Its replacement's handshake is unanswered: until it is ready, a lookup is a
        # miss at once, not a wait. Given an hour, these return with the server frozen.
        before = plane.stats.snapshot()
        for _ in range(3):
            assert plane.lookup(block_keys(50, namespace=NS), timeout=HOUR) is None
        assert frozen.still_frozen and plane.lookup_conn.reconnecting
        after = plane.stats.snapshot()
        assert after["lookup_errors"] - before["lookup_errors"] == 3
        assert after["lookup_timeouts"] == before["lookup_timeouts"]
    # A slow reply is not a dead server: no fail-fast window for either kind of call.
    assert plane.lookup_conn.health.healthy and plane.pool.healthy
    # The lookup connection is re-made in the background once the server answers.
    wait_until(lambda: plane.lookup([k]) == [True], what="a lookup answered again")
    assert not plane.lookup_conn.reconnecting
    dst = np.zeros(64, dtype=np.uint8)
    assert plane.load([(k, dst.data)], FP) == [LoadStatus.LOADED]
    assert np.array_equal(dst, np.ones(64, dtype=np.uint8))
    plane.close()


def test_lookups_and_stores_keep_separate_health(own_redis: EmbeddedRedis) -> None:
    plane = make_plane(own_redis.url, fail_fast_s=30.0)
    k = block_keys(1, "h", NS)[0]
    assert plane.lookup([k]) == [False]
    plane.pool.note_failure(RuntimeError("a failed transfer"))  # transfers fail fast now
    assert plane.store([(k, np.ones(8, dtype=np.uint8))], FP) == [StoreStatus.ERROR]
    assert plane.lookup([k]) == [False]  # lookups are unaffected
    plane.close()


@pytest.fixture
def secured() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis(["--requirepass", "right-pass"]) as srv:
        r = redis.Redis(port=srv.port, password="right-pass")
        r.acl_setuser(
            "umbp", enabled=True, passwords=["+umbp-pass"], keys=["umbp:*"], commands=["+@all"]
        )
        r.acl_setuser(
            "outsider", enabled=True, passwords=["+out-pass"], keys=["other:*"], commands=["+@all"]
        )
        r.acl_setuser(
            "lean",
            enabled=True,
            passwords=["+lean-pass"],
            keys=["umbp:*"],
            commands=["+@all", "-client"],
        )
        yield srv


@pytest.mark.parametrize(
    "user, password, command",
    [
        (None, "wrong-pass", "AUTH"),
        (None, None, "AUTH"),  # no password at all: NOAUTH on the first command
        ("outsider", "out-pass", "EXPIRE"),  # logged in, no rights on umbp:* keys
    ],
)
def test_auth_failures_are_logged_once_at_error_and_counted(
    secured: EmbeddedRedis,
    caplog: pytest.LogCaptureFixture,
    user: str | None,
    password: str | None,
    command: str,
) -> None:
    settings = RedisSettings.from_url(
        f"redis://127.0.0.1:{secured.port}/0",
        username=user,
        password=password,
        lookup_timeout_s=1.0,
        fail_fast_s=0.05,
    )
    plane = RedisDataPlane(settings)
    caplog.set_level(logging.DEBUG)
    for _ in range(4):
        assert plane.lookup(block_keys(3, namespace=NS)) is None
        # Past the fail-fast window the next lookup tries (and is refused) again.
        wait_until(lambda: plane.lookup_conn.health.healthy, what="the fail-fast window to close")
    dst = np.zeros(8, dtype=np.uint8)
    assert plane.load([(block_keys(1, namespace=NS)[0], dst.data)], FP) in (
        [LoadStatus.ERROR],
        [LoadStatus.MISSING],  # NOPERM users may not read the key either: never a hit
    )
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1, [r.getMessage() for r in errors]
    msg = errors[0].getMessage()
    assert f"127.0.0.1:{secured.port}" in msg and command in msg
    assert repr(user or "default") in msg
    for text in (r.getMessage() for r in caplog.records):
        assert "right-pass" not in text and "out-pass" not in text
        if password:
            assert password not in text
    assert plane.counters()["auth_failures"] >= 2
    plane.close()


def test_client_setname_is_best_effort(secured: EmbeddedRedis) -> None:
    url = f"redis://lean:lean-pass@127.0.0.1:{secured.port}/0"
    plane = warmed(make_plane(url))
    k = block_keys(1, "lean", NS)[0]
    assert plane.store([(k, np.ones(64, dtype=np.uint8))], FP) == [StoreStatus.STORED]
    assert plane.lookup([k]) == [True]
    assert plane.counters()["auth_failures"] == 0
    plane.close()


def test_the_documented_minimal_acl_is_enough(
    own_redis: EmbeddedRedis, caplog: pytest.LogCaptureFixture
) -> None:
    r = redis.Redis.from_url(own_redis.url)
    r.execute_command(*documented_acl())
    for refresh in (True, False):
        url = f"redis://umbp:acl-pass@127.0.0.1:{own_redis.port}/1"  # SELECT is allowed
        # cluster: auto asks the server (INFO) and finds a standalone one, quietly.
        with caplog.at_level(logging.WARNING):
            plane = open_plane(RedisSettings.from_url(url, refresh_ttl_on_lookup=refresh))
        # Only this server's records: an earlier test's plane may still log about its own.
        own = [rec for rec in caplog.records if f":{own_redis.port}/" in rec.getMessage()]
        assert isinstance(plane, RedisDataPlane) and not own
        k, bad = block_keys(2, f"acl{int(refresh)}", NS)
        payload = np.arange(4096, dtype=np.uint8)
        assert plane.store([(k, payload)], FP) == [StoreStatus.STORED]
        assert plane.lookup([k, bad]) == [True, False]
        dst = np.zeros(4096, dtype=np.uint8)
        assert plane.load([(k, dst.data)], FP) == [LoadStatus.LOADED]
        assert np.array_equal(dst, payload)
        assert plane.delete([k]) == 1
        counter = (BlockIdentityCodec("acl").request_count_prefix + "00" * 32).encode()
        assert plane.run_keyed([(counter, resp.encode_command(b"INCR", counter))], timeout=2) == [1]
        admin = redis.Redis(host="127.0.0.1", port=own_redis.port, db=1)
        check_stored_markers(plane, admin)  # SET, EXPIRE, UNLINK of markers and values
        admin.flushdb()
        assert plane.counters()["auth_failures"] == 0
        plane.close()
    # Outside umbp:* the user can do nothing.
    plane = make_plane(f"redis://umbp:acl-pass@127.0.0.1:{own_redis.port}/0")
    assert plane.lookup(["other:key"]) is None
    assert plane.counters()["auth_failures"] == 1
    plane.close()
