"""Option validation, URL parsing and the value format (no server needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from keys import block_keys

from umbp_redis.engine.options import (
    CONNECTOR_OPTIONS,
    ENGINE_OPTIONS,
    REMOVED_OPTIONS,
    EngineOptions,
    parse_connector_options,
)
from umbp_redis.store.errors import ConfigError
from umbp_redis.store.settings import (
    RedisSettings,
    transfer_connection_count,
    validate_options,
)
from umbp_redis.store.value_format import (
    HEADER_SIZE,
    InvalidValue,
    body_length,
    checksum,
    decode_header,
    encode_header,
    encode_value,
    expected_header,
    key_digest,
    validate_header,
)


def test_url_forms() -> None:
    s = RedisSettings.from_url("redis://alice:s3cret@cache.example:6380/2")
    assert (s.scheme, s.host, s.port, s.db, s.username, s.password) == (
        "redis",
        "cache.example",
        6380,
        2,
        "alice",
        "s3cret",
    )
    s = RedisSettings.from_url("redis://:pw@localhost:6379/0")
    assert s.username is None and s.password == "pw"
    s = RedisSettings.from_url("rediss://h:1/0", tls_ca_cert="/ca.pem")
    assert s.tls and s.tls_ca_cert == "/ca.pem"
    s = RedisSettings.from_url("unix:///run/redis.sock?db=3")
    assert (s.scheme, s.path, s.db) == ("unix", "/run/redis.sock", 3)


def test_url_semantics_match_redis_py() -> None:
    import redis.connection

    for url in (
        "redis://secret@h:1/0",
        "redis://:secret@h:1/0",
        "redis://u:p%40ss@h:1/4",
        "redis://h:1/0?db=5",
        "redis://h:1?password=qp&username=qu",
        "rediss://u:p@h:2/1",
        "unix:///tmp/r.sock?db=2",
    ):
        kw = redis.connection.parse_url(url)
        s = RedisSettings.from_url(url)
        assert (s.username, s.password) == (kw.get("username"), kw.get("password")), url
        assert s.db == kw.get("db", 0), url
        if not url.startswith("unix"):
            assert (s.host, s.port) == (kw["host"], kw["port"]), url


def test_redis_url_falls_back_to_the_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("UMBP_REDIS_URL", "redis://envhost:7000/3")
    # The connector validates options first (filling defaults); the URL still comes
    # from the environment when the operator did not set one.
    s = RedisSettings.from_options(validate_options({}))
    assert (s.host, s.port, s.db) == ("envhost", 7000, 3)
    s = RedisSettings.from_options(validate_options({"redis_url": "redis://given:1/0"}))
    assert s.host == "given"
    monkeypatch.delenv("UMBP_REDIS_URL")
    assert RedisSettings.from_options({}).host == "localhost"
    # Passwords: URL > password_file > $UMBP_REDIS_PASSWORD (a tool's override first).
    secret = tmp_path / "pw"
    secret.write_text("from-file\n")
    monkeypatch.setenv("UMBP_REDIS_PASSWORD", "from-env")
    opts = {"redis_url": "redis://h:1/0", "password_file": str(secret)}
    assert RedisSettings.from_options(opts).password == "from-file"
    assert RedisSettings.from_options({"redis_url": "redis://h:1/0"}).password == "from-env"
    url_pw = {**opts, "redis_url": "redis://:from-url@h:1/0"}
    assert RedisSettings.from_options(url_pw).password == "from-url"
    assert RedisSettings.from_url("redis://:u@h:1/0", password="given").password == "given"
    with pytest.raises(ConfigError, match=r"\['password_file'\].*cannot be read"):
        RedisSettings.from_options({"password_file": str(tmp_path / "missing")})
    (tmp_path / "empty").write_text("")
    with pytest.raises(ConfigError, match=r"\['password_file'\].*empty"):
        RedisSettings.from_options({"password_file": str(tmp_path / "empty")})


@pytest.mark.parametrize(
    "extra",
    [
        {"redis_url": "redis://:hunter2-secret@h:1/0"},
        {"redis_url": "redis://alice:hunter2-secret@h:1/0"},
        {"redis_url": "rediss://h:1/0?password=hunter2-secret"},
        {"redis_url": "redis://h:1/0", "password": "hunter2-secret"},
        {"password": None},
    ],
)
def test_the_connector_refuses_a_password_in_its_config(extra: dict[str, Any]) -> None:
    with pytest.raises(ConfigError) as ei:
        parse_connector_options(extra)
    text = str(ei.value)
    assert "password_file" in text and "UMBP_REDIS_PASSWORD" in text
    assert "hunter2" not in text and "kv_connector_extra_config[" in text


def test_the_connector_takes_a_user_in_its_url_and_the_password_elsewhere(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    secret = tmp_path / "pw"
    secret.write_text("from-file\n")
    settings, _ = parse_connector_options(
        {"redis_url": "redis://alice@h:1/0", "password_file": str(secret)}
    )
    assert (settings.username, settings.password) == ("alice", "from-file")
    monkeypatch.setenv("UMBP_REDIS_PASSWORD", "from-env")
    settings, _ = parse_connector_options({"redis_url": "redis://alice@h:1/0"})
    assert (settings.username, settings.password) == ("alice", "from-env")
    # Outside vLLM's config (the CLI's --redis-url, $UMBP_REDIS_URL) a URL may hold one.
    monkeypatch.setenv("UMBP_REDIS_URL", "redis://:env-url-pw@h:1/0")
    assert parse_connector_options({})[0].password == "env-url-pw"


def test_password_never_in_repr_or_redacted_url() -> None:
    s = RedisSettings.from_url("redis://alice:s3cret@h:1/0")
    assert "s3cret" not in repr(s) and "s3cret" not in s.redacted_url
    assert s.redacted_url == "redis://alice:***@h:1/0"


def test_bad_options_name_the_key() -> None:
    with pytest.raises(ConfigError, match=r"unknown .*\['ttl'\].*valid keys are"):
        validate_options({"ttl": 5})
    with pytest.raises(ConfigError, match=r"\['ttl_seconds'\] must be int, got str"):
        validate_options({"ttl_seconds": "5"})
    with pytest.raises(ConfigError, match=r"\['checksum'\] must be bool"):
        validate_options({"checksum": 1})
    with pytest.raises(ConfigError, match=r"\['ttl_seconds'\] must be >= 1"):
        validate_options({"ttl_seconds": 0})
    with pytest.raises(ConfigError, match="redis_url"):
        RedisSettings.from_url("http://h:1")
    with pytest.raises(ConfigError, match="malformed"):
        RedisSettings.from_url("redis://h:1/notanumber")


def test_transfer_connections_auto_takes_one_below_four_cpus() -> None:
    """``auto`` (the default) is 1 connection on machines of 1-3 CPUs, 2 from 4 on; an
    int is taken as given; anything else names the option."""
    assert [transfer_connection_count("auto", cpus=n) for n in (1, 2, 3, 4, 64)] == [1, 1, 1, 2, 2]
    assert transfer_connection_count(5, cpus=2) == 5
    expected = transfer_connection_count("auto")
    assert RedisSettings.from_url("redis://h:1").transfer_connections == expected
    assert RedisSettings.from_url("redis://h:1", transfer_connections=3).transfer_connections == 3
    with pytest.raises(
        ConfigError, match=r"\['transfer_connections'\] must be an int >= 1 or 'auto'"
    ):
        RedisSettings.from_url("redis://h:1", transfer_connections="many")
    with pytest.raises(ConfigError, match=r"\['transfer_connections'\] must be >= 1"):
        validate_options({"transfer_connections": 0})
    with pytest.raises(ConfigError, match=r"\['transfer_connections'\] must be int or str"):
        validate_options({"transfer_connections": 1.5})


def test_every_option_has_a_default_and_doc() -> None:
    opts = validate_options({}, allowed=CONNECTOR_OPTIONS)
    assert set(opts) == {o.name for o in CONNECTOR_OPTIONS}
    assert all(o.doc for o in CONNECTOR_OPTIONS)
    assert set(EngineOptions.__dataclass_fields__) == {o.name for o in ENGINE_OPTIONS}


def test_options_take_true_and_false_as_words_and_both_halves_parse_once() -> None:
    settings, engine = parse_connector_options(
        {"checksum": "false", "cluster": "False", "load_async": "true", "lookup_async": "TRUE"}
    )
    assert settings.checksum is False and settings.cluster == "off"
    assert engine.load_async is True and engine.lookup_async is True
    assert parse_connector_options({"cluster": True})[0].cluster == "on"
    with pytest.raises(ConfigError, match=r"\['cluster'\] must be one of"):
        parse_connector_options({"cluster": "on"})
    with pytest.raises(ConfigError, match=r"\['checksum'\] must be bool"):
        parse_connector_options({"checksum": "yes"})
    # Options taken off the surface are refused with what replaced them.
    for name in REMOVED_OPTIONS:
        with pytest.raises(ConfigError, match=rf"\['{name}'\] is no longer an option: use"):
            parse_connector_options({name: 1})
    # Unknown keys are refused by name, whichever half they look like.
    with pytest.raises(ConfigError, match=r"unknown .*\['sync_load_max_byte'\]"):
        parse_connector_options({"sync_load_max_byte": 1})


@pytest.mark.parametrize("n", [64 << 10, 512 << 10, 2 << 20, 1 << 30])
def test_power_of_two_payloads_leave_16_bytes_for_the_header_field(n: int) -> None:
    assert body_length(n) == n - 16


@pytest.mark.parametrize("n", [1, 100, 4000, 5000, 65536 + 300, 3 << 20, (5 << 20) + 7])
def test_body_length_is_a_size_class_less_16(n: int) -> None:
    b = body_length(n)
    assert 0 < b <= n
    if n >= 4096:
        x = b + 16
        k = x.bit_length() - 1
        assert x % (1 << (k - 2)) == 0  # a jemalloc size class
        assert n - b <= (n + 16) // 4


def test_header_round_trip_and_validation() -> None:
    payload = memoryview(bytes(range(256)) * 300)
    fp = b"\x01" * 16
    key = block_keys(1, "aa", "ns")[0].encode()
    h, body = encode_header(fp, payload, key, with_checksum=True)
    assert len(h) == HEADER_SIZE + payload.nbytes - body
    hdr = decode_header(h)
    assert hdr.has_checksum and hdr.payload_len == payload.nbytes and hdr.body_len == body
    ok: dict[str, Any] = {"payload_len": payload.nbytes, "body_field_len": body, "key": key}
    validate_header(hdr, fingerprint=fp, require_checksum=True, **ok)
    with pytest.raises(InvalidValue, match="fingerprint"):
        validate_header(hdr, fingerprint=b"\x02" * 16, require_checksum=True, **ok)
    with pytest.raises(InvalidValue, match="payload length"):
        validate_header(hdr, fingerprint=fp, require_checksum=True, **{**ok, "payload_len": 10})
    with pytest.raises(InvalidValue, match="body field"):
        validate_header(
            hdr, fingerprint=fp, require_checksum=True, **{**ok, "body_field_len": body - 1}
        )
    # Bound to its key: the same value read under another key is invalid.
    with pytest.raises(InvalidValue, match="key digest"):
        validate_header(hdr, fingerprint=fp, require_checksum=True, **{**ok, "key": key + b"b"})
    # A reader that requires checksums rejects a value written without one.
    bare = decode_header(encode_header(fp, payload, key, with_checksum=False)[0])
    assert not bare.has_checksum
    with pytest.raises(InvalidValue, match="no checksum"):
        validate_header(bare, fingerprint=fp, require_checksum=True, **ok)
    validate_header(bare, fingerprint=fp, require_checksum=False, **ok)
    with pytest.raises(InvalidValue, match="magic"):
        decode_header(b"XXXX" + h[4:])
    with pytest.raises(InvalidValue, match="version 1"):
        decode_header(h[:4] + b"\x01\x00" + h[6:])  # the format before key digests
    with pytest.raises(InvalidValue, match="unknown flags"):  # a later writer's meaning
        decode_header(h[:6] + b"\x03\x00" + h[8:])
    with pytest.raises(InvalidValue, match="shorter"):
        decode_header(h[:20])
    with pytest.raises(InvalidValue, match="tail bytes"):
        decode_header(h + b"extra")


@pytest.mark.parametrize("parts", [None, (16 << 10, 16 << 10, 32 << 10)])
def test_the_expected_header_accepts_exactly_what_decoding_accepts(
    parts: tuple[int, ...] | None,
) -> None:
    """A reader compares a checksummed header with the one its shape must have instead
    of decoding it. That shortcut accepts the writer's header, and no header with any
    one byte changed, or written without a checksum, or of another shape or key."""
    payload = memoryview(bytes(range(256)) * 256)  # 64 KiB
    fp, key = b"\x05" * 16, block_keys(1, "cc", "ns")[0].encode()
    h, bodies = encode_value(fp, payload, key, with_checksum=True, parts=parts)
    exp = expected_header(fp, payload.nbytes, parts)
    first = bodies[0][1]
    assert exp.matches(h, key_digest(key), first)
    assert exp.checksum_of(h) == checksum(payload)
    assert list(exp.places) == decode_header(h).part_layout()
    tails_at = exp.field_len - (payload.nbytes - sum(n for _, n in bodies))
    for i in range(len(h)):
        changed = h[:i] + bytes([h[i] ^ 0x5A]) + h[i + 1 :]
        # The checksum and the payload's tails are not part of the shape: the payload's
        # checksum catches those bytes once every body has arrived.
        per_value = 40 <= i < 48 or i >= tails_at
        assert exp.matches(changed, key_digest(key), first) is per_value, i
    assert not exp.matches(h + b"x", key_digest(key), first)
    assert not exp.matches(h[:-1], key_digest(key), first)
    assert not exp.matches(h, key_digest(key + b"d"), first)
    assert not exp.matches(h, key_digest(key), first - 1)
    unsummed = encode_value(fp, payload, key, with_checksum=False, parts=parts)[0]
    assert not exp.matches(unsummed, key_digest(key), first)
    assert not expected_header(b"\x06" * 16, payload.nbytes, parts).matches(
        h, key_digest(key), first
    )
    other_split = (32 << 10, 32 << 10) if parts else (16 << 10, 48 << 10)
    assert not expected_header(fp, payload.nbytes, other_split).matches(h, key_digest(key), first)


def test_a_value_in_parts_round_trips_and_is_bound_to_its_split() -> None:
    """Version 3: each part's body (jemalloc-sized) and its tail in h put the payload
    back together; a reader expecting another split, or a damaged part table, rejects it."""
    payload = memoryview(bytes(range(256)) * 1024)  # 256 KiB
    fp, key = b"\x03" * 16, block_keys(1, "bb", "ns")[0].encode()
    parts = (64 << 10, 64 << 10, 128 << 10)
    h, bodies = encode_value(fp, payload, key, with_checksum=True, parts=parts)
    hdr = decode_header(h)
    assert hdr.version == 3 and hdr.part_lengths == parts and hdr.checksum == checksum(payload)
    assert [n for _, n in bodies] == [body_length(n) for n in parts]
    rebuilt = bytearray(payload.nbytes)
    for place, (offset, n) in zip(hdr.part_layout(), bodies, strict=True):
        assert place.offset == offset and place.body_len == n
        rebuilt[offset : offset + n] = payload[offset : offset + n]
        tail = h[place.tail_at : place.tail_at + place.tail_len]
        rebuilt[offset + n : offset + n + place.tail_len] = tail
    assert bytes(rebuilt) == payload.tobytes()
    ok: dict[str, Any] = {"payload_len": payload.nbytes, "body_field_len": bodies[0][1], "key": key}
    validate_header(hdr, fingerprint=fp, require_checksum=True, parts=parts, **ok)
    with pytest.raises(InvalidValue, match="parts"):
        validate_header(hdr, fingerprint=fp, require_checksum=True, parts=parts[::-1], **ok)
    with pytest.raises(InvalidValue, match="parts"):  # a reader that expects one part
        validate_header(hdr, fingerprint=fp, require_checksum=True, **ok)
    with pytest.raises(InvalidValue, match="part table"):
        decode_header(h[:HEADER_SIZE] + (99).to_bytes(4, "little") + h[HEADER_SIZE + 4 :])
    with pytest.raises(InvalidValue, match="add up"):
        bad = h[: HEADER_SIZE + 4] + (1).to_bytes(8, "little") + h[HEADER_SIZE + 12 :]
        decode_header(bad)
    # One part (or none given) is the two-field version 2, as before.
    one, bodies1 = encode_value(fp, payload, key, with_checksum=True, parts=(payload.nbytes,))
    assert decode_header(one).version == 2
    assert one == encode_header(fp, payload, key, with_checksum=True)[0]
    assert bodies1 == ((0, body_length(payload.nbytes)),)
    with pytest.raises(ValueError, match="do not split"):
        encode_value(fp, payload, key, with_checksum=True, parts=(1, 2))


@pytest.mark.parametrize("parts", [None, (40_000, 30_000)])
def test_a_value_read_back_whole_is_checked_on_its_own_terms(
    parts: tuple[int, ...] | None,
) -> None:
    from umbp_redis.store.value_format import (
        ChecksumMismatch,
        InvalidValue,
        KeyDigestMismatch,
        check_stored_value,
    )

    fp, key = b"\x07" * 16, block_keys(1, "rb", "ns")[0].encode()
    payload = memoryview(bytes(range(256)) * 273 + bytes(112))  # 70,000 bytes
    h, bodies = encode_value(fp, payload, key, with_checksum=True, parts=parts)
    fields = [payload[o : o + n].tobytes() for o, n in bodies]
    hdr, got = check_stored_value(key, h, fields)
    assert got == payload.tobytes() and hdr.fingerprint == fp
    with pytest.raises(KeyDigestMismatch):
        check_stored_value(key + b"x", h, fields)
    flipped = [bytes([fields[0][0] ^ 1]) + fields[0][1:], *fields[1:]]
    with pytest.raises(ChecksumMismatch):
        check_stored_value(key, h, flipped)
    with pytest.raises(InvalidValue, match="missing"):
        check_stored_value(key, h, [None, *fields[1:]])
    with pytest.raises(InvalidValue, match="bytes, expected"):
        check_stored_value(key, h, [fields[0][:-1], *fields[1:]])
    # Without a checksum only the binding to the key is checked.
    bare, _ = encode_value(fp, payload, key, with_checksum=False, parts=parts)
    assert check_stored_value(key, bare, flipped)[0].has_checksum is False
