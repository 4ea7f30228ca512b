"""Which server the operator tools see: Redis and Valkey named as themselves, and the
data-plane benchmark comparing them side by side.

The whole server test set also runs on Valkey (``scripts/test`` runs it a second time
with ``UMBP_REDIS_SERVER`` naming valkey-server); these tests run in both passes and
check what differs between the two.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import redis
from helpers import cli

from umbp_redis.store.redispy import server_name
from umbp_redis.testing.embedded_redis import EmbeddedRedis

REPO = Path(__file__).resolve().parent.parent
VALKEY = os.environ.get(
    "UMBP_VALKEY_SERVER", str(REPO.parent / "shared/servers/valkey-8.0.1/valkey-server")
)


def needs_valkey() -> str:
    if not os.access(VALKEY, os.X_OK):
        pytest.skip(f"no valkey-server at {VALKEY} (set UMBP_VALKEY_SERVER)")
    return VALKEY


def test_server_name_reads_valkey_version_before_redis_version() -> None:
    assert server_name({"redis_version": "7.0.15"}) == "Redis 7.0.15"
    # Valkey reports redis_version 7.2.4 for clients that check it, and its own version.
    valkey = {"redis_version": "7.2.4", "valkey_version": "8.0.1", "server_name": "valkey"}
    assert server_name(valkey) == "Valkey 8.0.1"


def test_doctor_and_stats_name_the_server_they_talk_to(redis_url: str) -> None:
    info = redis.Redis.from_url(redis_url).info("server")
    expected = server_name(info)
    doctor = json.loads(cli("doctor", "--redis-url", redis_url, "--json").stdout)
    checks = {c["check"]: c for c in doctor["checks"]}
    assert checks["server"] == {"level": "ok", "check": "server", "detail": expected}
    assert checks["io threads"]["detail"].startswith(f"{expected} io-threads ")
    stats = json.loads(cli("stats", "--redis-url", redis_url, "--json").stdout)
    assert stats["server"]["server"] == expected


def test_valkey_is_named_valkey_with_its_io_threads() -> None:
    binary = needs_valkey()
    with EmbeddedRedis(["--io-threads", "2"], binary=binary) as srv:
        doctor = json.loads(cli("doctor", "--redis-url", srv.url, "--json").stdout)
        checks = {c["check"]: c["detail"] for c in doctor["checks"]}
        assert checks["server"] == "Valkey 8.0.1"
        assert checks["io threads"] == "Valkey 8.0.1 io-threads 2"
        assert doctor["ok"]


def test_bench_compares_redis_and_valkey_each_against_its_own_benchmark_tool() -> None:
    binary = needs_valkey()
    out = cli(
        "bench",
        "dataplane",
        "--servers",
        "redis,valkey:1,valkey:2",
        "--valkey-server",
        binary,
        "--sizes",
        "65536",
        "--total-mib",
        "2",
        "--repeats",
        "1",
        "--json",
    )
    assert out.returncode == 0, out.stderr
    runs = json.loads(out.stdout)
    assert [r["server"] for r in runs] == [
        "redis io-threads 1",
        "valkey io-threads 1",
        "valkey io-threads 2",
    ]
    assert runs[1]["version"] == runs[2]["version"] == "8.0.1"
    for r in runs:
        (row,) = r["results"]
        for k in ("umbp_store_gbps", "umbp_load_gbps", "redis_benchmark_set_gbps"):
            assert row[k] > 0, (r["server"], k)
    missing = cli("bench", "dataplane", "--servers", "valkey", "--valkey-server", "/nonexistent")
    assert missing.returncode == 2 and "UMBP_VALKEY_SERVER" in missing.stderr
