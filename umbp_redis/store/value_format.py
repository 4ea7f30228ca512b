"""The stored value format: a Redis hash of a small header field and a large body field.

A KV object of ``payload_len`` bytes is stored under one key as a hash with two fields:

* ``h``: a 48-byte header followed by the payload's last ``tail_len`` bytes;
* ``b``: the payload's first ``body_len`` bytes.

``body_len`` is chosen so that the body's server-side allocation fills a jemalloc size
class exactly: for a power-of-two payload it is ``payload_len - 16``. Stored as one
string, a 2^n-byte payload (plus any header) lands in the next size class and costs
about 1.25x; split this way the object costs its payload plus a few hundred bytes.

Header (little-endian)::

    offset size field
    0      4    magic  b"UMBP"
    4      2    format version (2)
    6      2    flags (bit 0: checksum present)
    8      16   layout fingerprint of the object
    24     8    payload length
    32     8    body length (length of field b)
    40     8    xxh3-64 of the payload (0 without checksum)
    48     16   key digest: xxh3-128 of the full key the value was written under

The key digest binds a value to its identity (namespace, rank labels, cache group and
block hash are all in the key): a value copied or renamed to another key fails
validation there. A reader that requires checksums rejects a value without one.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

MAGIC = b"UMBP"
FORMAT_VERSION = 2
FLAG_CHECKSUM = 1
HEADER = struct.Struct("<4sHH16sQQQ16s")
HEADER_SIZE = HEADER.size  # 64
KEY_DIGEST_SIZE = 16
HEADER_FIELD = b"h"
BODY_FIELD = b"b"
# Bytes the server adds to a string allocation (sds header and terminator), rounded up.
_SDS_SLACK = 16
_SPLIT_MIN = 4096


class InvalidValue(ValueError):
    """A stored value whose header does not match what the reader expects."""


def body_length(payload_len: int) -> int:
    """Bytes of the payload stored in the body field (the rest goes after the header).

    The body plus the server's string overhead fits the largest jemalloc size class not
    above ``payload_len + 16`` (classes are 4 per power of two above 4 KiB).
    """
    if payload_len < _SPLIT_MIN:
        return payload_len
    x = payload_len + _SDS_SLACK
    spacing = 1 << (x.bit_length() - 3)  # 2^(k-2) for 2^k <= x < 2^(k+1)
    return (x // spacing) * spacing - _SDS_SLACK


def checksum(payload: memoryview | bytes | bytearray) -> int:
    """The payload checksum (xxh3-64)."""
    return int(xxhash.xxh3_64_intdigest(payload))


def checksum_of_pieces(pieces: Sequence[memoryview]) -> int:
    """``checksum`` of the payload made of ``pieces`` in order (no copy)."""
    if len(pieces) == 1:
        return checksum(pieces[0])
    h = xxhash.xxh3_64()
    for p in pieces:
        h.update(p)
    return int(h.intdigest())


def key_digest(key: bytes) -> bytes:
    """The 16-byte digest of a full key that a value's header carries (xxh3-128)."""
    return xxhash.xxh3_128_digest(key)


@dataclass(frozen=True)
class ValueHeader:
    """The decoded header of one stored value."""

    version: int
    flags: int
    fingerprint: bytes
    payload_len: int
    body_len: int
    checksum: int
    key_digest: bytes = b""

    @property
    def has_checksum(self) -> bool:
        """Whether the writer stored a checksum."""
        return bool(self.flags & FLAG_CHECKSUM)

    @property
    def tail_len(self) -> int:
        """Payload bytes that follow the header in field ``h``."""
        return self.payload_len - self.body_len


def encode_header(
    fingerprint: bytes, payload: memoryview, key: bytes, *, with_checksum: bool
) -> tuple[bytes, int]:
    """The ``h`` field for ``payload`` stored under ``key`` (header plus tail), body length."""
    if len(fingerprint) != 16:
        raise ValueError("layout fingerprint must be 16 bytes")
    n = payload.nbytes
    body = body_length(n)
    csum = checksum(payload) if with_checksum else 0
    head = HEADER.pack(
        MAGIC,
        FORMAT_VERSION,
        FLAG_CHECKSUM if with_checksum else 0,
        fingerprint,
        n,
        body,
        csum,
        key_digest(key),
    )
    return head + payload[body:].tobytes(), body


def decode_header(field_h: bytes | bytearray | memoryview) -> ValueHeader:
    """Parse field ``h``; raises ``InvalidValue`` if it is not a header of this format."""
    if len(field_h) < HEADER_SIZE:
        raise InvalidValue(f"header field is {len(field_h)} bytes, shorter than {HEADER_SIZE}")
    if bytes(field_h[:4]) != MAGIC:
        raise InvalidValue(f"bad magic {bytes(field_h[:4])!r}")
    version = int.from_bytes(field_h[4:6], "little")
    if version != FORMAT_VERSION:
        raise InvalidValue(f"unsupported format version {version}")
    magic, version, flags, fp, plen, blen, csum, kd = HEADER.unpack_from(field_h, 0)
    if blen > plen:
        raise InvalidValue(f"body length {blen} exceeds payload length {plen}")
    hdr = ValueHeader(version, flags, bytes(fp), plen, blen, csum, bytes(kd))
    if len(field_h) != HEADER_SIZE + hdr.tail_len:
        raise InvalidValue(
            f"header field holds {len(field_h) - HEADER_SIZE} tail bytes, expected {hdr.tail_len}"
        )
    return hdr


def validate_header(
    hdr: ValueHeader,
    *,
    fingerprint: bytes,
    payload_len: int,
    body_field_len: int,
    key: bytes,
    require_checksum: bool,
) -> None:
    """Raise ``InvalidValue`` unless ``hdr`` describes this key's object of this layout and size.

    With ``require_checksum`` a value written without a checksum is invalid too.
    """
    if hdr.key_digest != key_digest(key):
        raise InvalidValue("key digest differs: the value was written under another key")
    if require_checksum and not hdr.has_checksum:
        raise InvalidValue("value has no checksum and this reader requires one")
    if hdr.fingerprint != fingerprint:
        raise InvalidValue(
            f"layout fingerprint {hdr.fingerprint.hex()} differs from {fingerprint.hex()}"
        )
    if hdr.payload_len != payload_len:
        raise InvalidValue(f"payload length {hdr.payload_len}, expected {payload_len}")
    if hdr.body_len != body_field_len:
        raise InvalidValue(f"body field is {body_field_len} bytes, header says {hdr.body_len}")
