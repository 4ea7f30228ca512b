"""Lookups never wait longer than ``lookup_timeout_s``; auth problems are loud, not silent.

Real redis-server processes, plus raw sockets for servers that never answer.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import redis
from fake_servers import FakeServer
from helpers import check_stored_markers, documented_acl, wait_until_server_is_asleep
from keys import block_keys

from umbp_redis.data import BlockIdentityCodec
from umbp_redis.ops.embedded_redis import EmbeddedRedis
from umbp_redis.store import resp
from umbp_redis.store.deployment import open_plane
from umbp_redis.store.plane import LoadStatus, RedisDataPlane, StoreStatus
from umbp_redis.store.settings import RedisSettings

FP = b"\x05" * 16
TIMEOUT = 0.25
# Scheduling noise on a loaded 2-core machine; the bug this guards against cost seconds.
MARGIN = 0.2
NS = "bl"


def make_plane(url: str, **kw) -> RedisDataPlane:  # type: ignore[no-untyped-def]
    return RedisDataPlane(RedisSettings.from_url(url, lookup_timeout_s=TIMEOUT, **kw))


def timed_lookups(plane: RedisDataPlane, n: int = 8) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.monotonic()
        assert plane.lookup(block_keys(50, namespace=NS)) is None
        out.append(time.monotonic() - t0)
    return out


@pytest.fixture
def silent() -> Iterator[FakeServer]:
    s = FakeServer()  # reads, never answers
    yield s
    s.close()


def test_a_server_that_accepts_and_never_replies(silent: FakeServer) -> None:
    plane = make_plane(
        f"redis://127.0.0.1:{silent.port}/0", op_timeout_s=5.0, connect_timeout_s=5.0
    )
    times = timed_lookups(plane)
    assert max(times) < TIMEOUT + MARGIN, times
    plane.close()


def test_an_address_that_drops_syns() -> None:
    # A listener that never accepts, its backlog filled: the kernel drops further SYNs
    # and a connect hangs until its own timeout.
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
    deadline = time.monotonic() + 5
    while True:  # the setup works once a connect hangs (the fillers filled the backlog)
        probe = socket.socket()
        probe.settimeout(0.3)
        try:
            probe.connect(("127.0.0.1", port))
        except OSError:
            break
        finally:
            probe.close()
        assert time.monotonic() < deadline, "connects to a full backlog did not hang"
    plane = make_plane(f"redis://127.0.0.1:{port}/0", connect_timeout_s=5.0)
    times = timed_lookups(plane)
    assert max(times) < TIMEOUT + MARGIN, times
    plane.close()
    for s in [*fillers, lst]:
        s.close()


def test_debug_sleep_bounds_lookups_and_opens_no_fail_fast_window(
    own_redis: EmbeddedRedis,
) -> None:
    r = redis.Redis.from_url(own_redis.url)
    r.config_set("enable-debug-command", "yes") if _debug_needs_enabling(r) else None
    plane = make_plane(own_redis.url, fail_fast_s=5.0)
    k = block_keys(1, "s", NS)[0]
    assert plane.store([(k, np.ones(64, dtype=np.uint8))], FP) == [StoreStatus.STORED]
    assert plane.lookup([k]) == [True]  # the warm connection is up
    sleeper = threading.Thread(
        target=lambda: redis.Redis.from_url(own_redis.url).execute_command("DEBUG", "SLEEP", "1.2")
    )
    sleeper.start()
    wait_until_server_is_asleep(own_redis.url)
    times = timed_lookups(plane, n=3)
    assert max(times) < TIMEOUT + MARGIN, times
    sleeper.join()
    # A slow reply is not a dead server: no 5 s fail-fast window for either kind of call.
    assert plane.lookup_conn.health.healthy and plane.pool.healthy
    deadline = time.monotonic() + 1.0
    while plane.lookup([k]) != [True]:  # the lookup connection is re-made in the background
        assert time.monotonic() < deadline
        time.sleep(0.02)
    dst = np.zeros(64, dtype=np.uint8)
    assert plane.load([(k, dst.data)], FP) == [LoadStatus.LOADED]
    assert plane.stats.snapshot()["lookup_timeouts"] >= 3
    plane.close()


def _debug_needs_enabling(r: redis.Redis) -> bool:
    try:
        return r.config_get("enable-debug-command").get("enable-debug-command") == "no"
    except redis.ResponseError:
        return False


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
        time.sleep(0.06)
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
    plane = make_plane(url)
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
        assert isinstance(plane, RedisDataPlane) and not caplog.records
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
