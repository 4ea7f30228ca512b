"""The umbp-redis CLI verbs against real redis-server processes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import redis
from helpers import FP, cli, fill
from keys import block_keys
from typed_redis import raw

from umbp_redis.data import KEY_PREFIX, BlockIdentityCodec, namespace_pattern, parse_key
from umbp_redis.data.announcements import announcement_key
from umbp_redis.data.keys import OLD_KEY_PREFIXES
from umbp_redis.store.settings import RedisSettings
from umbp_redis.testing.embedded_redis import EmbeddedRedis, free_port


def test_version_and_help() -> None:
    out = cli("--version")
    assert out.returncode == 0 and out.stdout.startswith("umbp-redis ")
    out = cli("--help")
    for verb in ("ls", "inspect", "stats", "purge", "doctor", "demo", "bench"):
        assert verb in out.stdout


def test_ls_lists_namespaces_and_decoded_keys(redis_url: str) -> None:
    fill(redis_url, "nsa", 5)
    fill(redis_url, "nsb", 3)
    out = cli("ls", "--redis-url", redis_url, "--json", "--limit", "4")
    data = json.loads(out.stdout)
    assert data["namespaces"] == {"nsa": 5, "nsb": 3}
    assert len(data["keys"]) == 4
    k = data["keys"][0]
    assert k["rank"] == "tp0:pcp0:dcp0:pp0" and k["group"] == 0 and k["value_bytes"] == 4096
    assert 0 < k["ttl_s"] <= 86400
    human = cli("ls", "--redis-url", redis_url, "--namespace", "nsb")
    assert "namespace nsb: 3 keys" in human.stdout and "nsa" not in human.stdout


def test_inspect_valid_and_invalid(redis_url: str) -> None:
    keys = fill(redis_url, "nsi", 2)
    out = cli("inspect", keys[0], "--redis-url", redis_url, "--json")
    info = json.loads(out.stdout)
    assert out.returncode == 0 and info["valid"] and info["checksum"] == "ok"
    assert info["format_version"] == 2 and info["payload_len"] == 4096
    assert info["layout_fingerprint"] == FP.hex() and info["key_digest"] == "ok"
    r = redis.Redis.from_url(redis_url)
    decoded = parse_key(keys[0])
    moved = BlockIdentityCodec("nsi").key(decoded.block_hash[:-1] + b"\xff", decoded.group_id)
    r.copy(keys[0], moved)  # a valid value, but of another key
    other = cli("inspect", moved, "--redis-url", redis_url, "--json")
    assert other.returncode == 1 and "key digest" in json.loads(other.stdout)["error"]
    h = raw(r.hget(keys[1], "h") or b"")
    r.hset(keys[1], "h", b"XXXX" + h[4:])
    bad = cli("inspect", keys[1], "--redis-url", redis_url, "--json")
    assert bad.returncode == 1 and json.loads(bad.stdout)["valid"] is False
    assert "magic" in json.loads(bad.stdout)["error"]
    missing = cli("inspect", block_keys(1, namespace="x")[0], "--redis-url", redis_url)
    assert missing.returncode == 1


def test_inspect_and_ls_read_values_stored_in_parts(redis_url: str) -> None:
    """A value in parts (version 3) is put back together from every body field: valid
    when whole, a damaged or missing part named; ls reports its payload size."""
    keys = fill(redis_url, "nsp", 2, size=12288, parts=(4096, 4096, 4096))
    info = json.loads(cli("inspect", keys[0], "--redis-url", redis_url, "--json").stdout)
    assert info["valid"] and info["format_version"] == 3 and info["parts"] == 3
    assert info["checksum"] == "ok" and info["payload_len"] == 12288
    ls = json.loads(cli("ls", "--redis-url", redis_url, "--namespace", "nsp", "--json").stdout)
    assert {k["value_bytes"] for k in ls["keys"]} == {12288}
    r = redis.Redis.from_url(redis_url)
    body = bytearray(raw(r.hget(keys[0], "b2") or b""))
    body[0] ^= 1
    r.hset(keys[0], "b2", bytes(body))
    bad = cli("inspect", keys[0], "--redis-url", redis_url, "--json")
    assert bad.returncode == 1 and json.loads(bad.stdout)["checksum"] == "MISMATCH"
    r.hdel(keys[1], "b1")
    gone = cli("inspect", keys[1], "--redis-url", redis_url, "--json")
    assert gone.returncode == 1 and json.loads(gone.stdout)["error"] == "field b1 missing"


def test_stats(redis_url: str) -> None:
    fill(redis_url, "nss", 4, size=8192)
    out = cli("stats", "--redis-url", redis_url, "--json")
    data = json.loads(out.stdout)
    assert data["namespaces"]["nss"]["keys"] == 4
    assert data["namespaces"]["nss"]["bytes"] == 4 * 8192
    assert data["namespaces"]["nss"]["ttl_max_s"] <= 86400
    for field in ("used_memory", "maxmemory", "maxmemory_policy", "evicted_keys", "hit_rate"):
        assert field in data["server"]


def test_purge_leaves_other_namespaces(redis_url: str) -> None:
    gone = fill(redis_url, "gone", 1200)
    fill(redis_url, "kept", 7)
    r = redis.Redis.from_url(redis_url)
    r.set("unrelated", b"x")
    for ns in ("gone", "kept"):  # each namespace's fleet announcements
        r.xadd(announcement_key(ns), {"o": "s"})
    refused = cli("purge", "--namespace", "gone", "--redis-url", redis_url, input_text="")
    assert refused.returncode != 0 and r.exists(gone[0])
    ls = json.loads(cli("ls", "--redis-url", redis_url, "--json").stdout)
    assert ls["namespaces"] == {"gone": 1200, "kept": 7}  # the streams are no block keys
    out = cli("purge", "--namespace", "gone", "--yes", "--redis-url", redis_url, "--json")
    assert json.loads(out.stdout)["deleted"] == 1201
    assert len(list(r.scan_iter(match=namespace_pattern("gone")))) == 0
    assert len(list(r.scan_iter(match=namespace_pattern("kept")))) == 8
    assert r.exists("unrelated")


def test_markers_are_counted_and_old_schema_keys_purged_alone(redis_url: str) -> None:
    keys = fill(redis_url, "nsm", 3)
    r = redis.Redis.from_url(redis_url)
    marker = BlockIdentityCodec("nsm").marker_key(parse_key(keys[0]).block_hash, 0).decode()
    r.set(marker, b"1", ex=100)
    # Keys of the earlier schema version, shaped like today's.
    old = [OLD_KEY_PREFIXES[0] + k.removeprefix(KEY_PREFIX) for k in block_keys(4, "old", "nsm")]
    for k in old:
        r.hset(k, "h", b"x")
    name, version = KEY_PREFIX.rsplit(":v", 1)
    future = f"{name}:v{int(version) + 1}:future:key"
    r.set(future, b"x")  # not an earlier schema: never touched
    ls = json.loads(cli("ls", "--redis-url", redis_url, "--json").stdout)
    assert ls["namespaces"] == {"nsm": 3} and ls["stored_markers"] == {"nsm": 1}
    assert ls["old_schema_keys"] == 4
    human = cli("ls", "--redis-url", redis_url).stdout
    assert "namespace nsm: 3 keys, 1 stored markers" in human and "--old-schemas" in human
    info = json.loads(cli("inspect", marker, "--redis-url", redis_url, "--json").stdout)
    assert info["stored_marker"] and info["valid"] and 0 < info["ttl_s"] <= 100
    refused = cli("purge", "--old-schemas", "--redis-url", redis_url, input_text="")
    assert refused.returncode == 2 and all(r.exists(k) for k in old)
    out = cli("purge", "--old-schemas", "--yes", "--redis-url", redis_url, "--json")
    assert json.loads(out.stdout)["deleted"] == 4 and not any(r.exists(k) for k in old)
    assert r.exists(marker) and all(r.exists(k) for k in keys)
    assert r.exists(future)


@pytest.mark.parametrize("namespace", ["", "*", "ke*", "k?pt", "[gk]*", "a:b"])
def test_purge_refuses_empty_and_glob_namespaces(redis_url: str, namespace: str) -> None:
    fill(redis_url, "kept", 3)
    fill(redis_url, "keep2", 2)
    out = cli("purge", "--namespace", namespace, "--yes", "--redis-url", redis_url)
    assert out.returncode == 2 and "exact namespace" in out.stderr
    r = redis.Redis.from_url(redis_url)
    assert len(list(r.scan_iter(match=namespace_pattern()))) == 5


def test_purge_all_needs_all_and_a_confirmation(redis_url: str) -> None:
    fill(redis_url, "one", 3)
    fill(redis_url, "two", 2)
    r = redis.Redis.from_url(redis_url)
    r.set("unrelated", b"x")
    assert cli("purge", "--redis-url", redis_url, "--yes").returncode == 2  # neither flag
    no_tty = cli("purge", "--all", "--redis-url", redis_url, input_text="all\n")
    assert no_tty.returncode == 2 and len(list(r.scan_iter(match=namespace_pattern()))) == 5
    out = cli("purge", "--all", "--yes", "--redis-url", redis_url, "--json")
    assert out.returncode == 0 and json.loads(out.stdout)["deleted"] == 5
    assert not list(r.scan_iter(match=namespace_pattern())) and r.exists("unrelated")


def test_cli_reads_urls_as_the_connector_does(monkeypatch: pytest.MonkeyPatch) -> None:
    with EmbeddedRedis(["--requirepass", "s3cret"]) as srv:
        url = f"redis://:s3cret@127.0.0.1:{srv.port}/0"
        assert cli("doctor", "--redis-url", url, "--json").returncode == 0
        # redis-py reads "name@host" as a user without a password: refused in both.
        as_user = f"redis://s3cret@127.0.0.1:{srv.port}/0"
        assert cli("doctor", "--redis-url", as_user, "--json").returncode == 2
        settings = RedisSettings.from_url(as_user)
        assert (settings.username, settings.password) == ("s3cret", None)
        import redis.connection

        kw = redis.connection.parse_url(as_user)
        assert (kw.get("username"), kw.get("password")) == ("s3cret", None)
        # The password from the environment, the server from $UMBP_REDIS_URL.
        env = {"UMBP_REDIS_URL": f"redis://127.0.0.1:{srv.port}/0", "UMBP_REDIS_PASSWORD": "s3cret"}
        out = subprocess.run(
            [sys.executable, "-m", "umbp_redis.cli", "doctor", "--json"],
            capture_output=True,
            text=True,
            timeout=60,
            env={**__import__("os").environ, **env},
        )
        assert out.returncode == 0, out.stdout + out.stderr
    bad = cli("ls", "--redis-url", "http://nowhere")
    assert bad.returncode == 2 and "redis_url" in bad.stderr


def test_doctor_fails_on_unreachable_server() -> None:
    out = cli("doctor", "--redis-url", f"redis://127.0.0.1:{free_port()}/0", "--json")
    assert out.returncode == 2
    data = json.loads(out.stdout)
    assert not data["ok"] and data["checks"][0]["level"] == "fail"


def test_doctor_warns_on_noeviction_and_passes_a_cache() -> None:
    with EmbeddedRedis(["--maxmemory", "64mb", "--maxmemory-policy", "noeviction"]) as srv:
        out = cli("doctor", "--redis-url", srv.url, "--json")
        data = json.loads(out.stdout)
        assert out.returncode == 0
        levels = {c["check"]: c["level"] for c in data["checks"]}
        assert levels["eviction"] == "warn" and levels["maxmemory"] == "ok"
        assert levels["persistence"] == "ok"
        redis.Redis.from_url(srv.url).config_set("maxmemory-policy", "allkeys-lru")
        data = json.loads(cli("doctor", "--redis-url", srv.url, "--json").stdout)
        assert {c["check"]: c["level"] for c in data["checks"]}["eviction"] == "ok"


@pytest.mark.parametrize("verb", ["ls", "stats"])
def test_url_from_environment(redis_url: str, verb: str, monkeypatch: pytest.MonkeyPatch) -> None:
    fill(redis_url, "envns", 1)
    import os

    env = {**os.environ, "UMBP_REDIS_URL": redis_url}
    out = subprocess.run(
        [sys.executable, "-m", "umbp_redis.cli", verb, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert "envns" in out.stdout


def test_bench_touches_only_its_own_keys(redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)
    r.set("precious", b"x")
    # redis-benchmark's own default key: its SET would overwrite a user's value there.
    r.set("key:__rand_int__", b"mine")
    users = fill(redis_url, "users", 3)
    env = {**__import__("os").environ, "UMBP_REDIS_URL": redis_url}
    args = ["bench", "dataplane", "--sizes", "65536", "--total-mib", "2", "--repeats", "1"]
    # $UMBP_REDIS_URL is not a target: without --redis-url a private server is used.
    out = subprocess.run(
        [sys.executable, "-m", "umbp_redis.cli", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    assert r.dbsize() == 5
    # Aimed at a server with other data, it deletes only what it wrote.
    out = cli(*args, "--redis-url", redis_url)
    assert out.returncode == 0, out.stderr
    assert "checksum cost" in out.stdout
    assert r.get("precious") == b"x" and r.get("key:__rand_int__") == b"mine"
    assert sorted(k.decode() for k in r.scan_iter()) == sorted(
        ["precious", "key:__rand_int__", *users]
    )
