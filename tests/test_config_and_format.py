"""Option validation, URL parsing and the value format (no server needed)."""

from __future__ import annotations

import pytest

from umbp_redis.config import OPTIONS, RedisSettings, validate_options
from umbp_redis.errors import ConfigError
from umbp_redis.value_format import (
    HEADER_SIZE,
    InvalidValue,
    body_length,
    decode_header,
    encode_header,
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


def test_every_option_has_a_default_and_doc() -> None:
    opts = validate_options({})
    assert set(opts) == {o.name for o in OPTIONS}
    assert all(o.doc for o in OPTIONS)


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
    h, body = encode_header(fp, payload, with_checksum=True)
    assert len(h) == HEADER_SIZE + payload.nbytes - body
    hdr = decode_header(h)
    assert hdr.has_checksum and hdr.payload_len == payload.nbytes and hdr.body_len == body
    validate_header(hdr, fingerprint=fp, payload_len=payload.nbytes, body_field_len=body)
    with pytest.raises(InvalidValue, match="fingerprint"):
        validate_header(
            hdr, fingerprint=b"\x02" * 16, payload_len=payload.nbytes, body_field_len=body
        )
    with pytest.raises(InvalidValue, match="payload length"):
        validate_header(hdr, fingerprint=fp, payload_len=10, body_field_len=body)
    with pytest.raises(InvalidValue, match="body field"):
        validate_header(hdr, fingerprint=fp, payload_len=payload.nbytes, body_field_len=body - 1)
    with pytest.raises(InvalidValue, match="magic"):
        decode_header(b"XXXX" + h[4:])
    with pytest.raises(InvalidValue, match="shorter"):
        decode_header(h[:20])
    with pytest.raises(InvalidValue, match="tail bytes"):
        decode_header(h + b"extra")
