"""The stored value format: a Redis hash of a small header field and the payload's body fields.

A KV object of ``payload_len`` bytes is stored under one key as a hash. Version 2 (one
part) has two fields:

* ``h``: a 64-byte header followed by the payload's last ``tail_len`` bytes;
* ``b``: the payload's first ``body_len`` bytes.

Version 3 splits the payload into consecutive parts (the layers of a layout, in the
order the forward pass reads them: see ``KVLayoutDescriptor.part_lengths``), so that a
reader can fetch part ``i`` of many objects before part ``i + 1`` of any:

* ``h``: the 64-byte header, the part table (u32 count ``n``, then ``n`` u64 part
  lengths), then each part's tail, in part order;
* ``b``, ``b1`` ... ``b{n-1}``: each part's body (its first bytes).

A body's length is ``body_length(part length)``: chosen so that the body's server-side
allocation fills a jemalloc size class exactly (for a power-of-two part it is
``part - 16``). Stored as one string, a 2^n-byte payload (plus any header) lands in the
next size class and costs about 1.25x; split this way an object costs its payload plus
a few hundred bytes.

Header (little-endian)::

    offset size field
    0      4    magic  b"UMBP"
    4      2    format version (2: one part, 3: parts)
    6      2    flags (bit 0: checksum present; a reader rejects any other bit)
    8      16   layout fingerprint of the object
    24     8    payload length
    32     8    body length (all body fields together)
    40     8    xxh3-64 of the whole payload (0 without checksum)
    48     16   key digest: xxh3-128 of the full key the value was written under

The key digest binds a value to its identity (namespace, rank labels, cache group and
block hash are all in the key): a value copied or renamed to another key fails
validation there. A reader that requires checksums rejects a value without one; the
checksum covers the whole payload, so parts of two different writes of one key never
pass together.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

MAGIC = b"UMBP"
FORMAT_VERSION = 2
PARTS_FORMAT_VERSION = 3
FLAG_CHECKSUM = 1
KNOWN_FLAGS = FLAG_CHECKSUM
HEADER = struct.Struct("<4sHH16sQQQ16s")
HEADER_SIZE = HEADER.size  # 64
KEY_DIGEST_SIZE = 16
HEADER_FIELD = b"h"
BODY_FIELD = b"b"
_COUNT = struct.Struct("<I")
_LENGTH = struct.Struct("<Q")
# Parts a stored value may have (a header with more is not one of ours).
MAX_STORED_PARTS = 64
# Bytes the server adds to a string allocation (sds header and terminator), rounded up.
_SDS_SLACK = 16
_SPLIT_MIN = 4096


def part_split(parts: Sequence[int] | None) -> tuple[int, ...] | None:
    """The part lengths a value is stored in (version 3), or None for a value stored
    whole (version 2: ``parts`` None or a single part)."""
    return tuple(parts) if parts is not None and len(parts) > 1 else None


def longest_header_field(payload_len: int) -> int:
    """The most bytes field ``h`` of a value of ``payload_len`` can hold (header, the
    largest part table, every payload byte as tail)."""
    return HEADER_SIZE + _COUNT.size + _LENGTH.size * MAX_STORED_PARTS + payload_len


def body_field(part: int) -> bytes:
    """The hash field holding part ``part``'s body: ``b``, ``b1``, ``b2`` ..."""
    return BODY_FIELD if part == 0 else b"%s%d" % (BODY_FIELD, part)


class InvalidValue(ValueError):
    """A stored value whose header does not match what the reader expects."""


class KeyDigestMismatch(InvalidValue):
    """A value written under another key."""

    def __init__(self) -> None:
        super().__init__("key digest differs: the value was written under another key")


class ChecksumMismatch(InvalidValue):
    """A value whose payload is not the one its checksum was computed over."""

    def __init__(self) -> None:
        super().__init__("checksum mismatch")


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
    parts: tuple[int, ...] = ()  # each part's payload length (version 3)

    @property
    def has_checksum(self) -> bool:
        """Whether the writer stored a checksum."""
        return bool(self.flags & FLAG_CHECKSUM)

    @property
    def tail_len(self) -> int:
        """Payload bytes that follow the header (and part table) in field ``h``."""
        return self.payload_len - self.body_len

    @property
    def part_lengths(self) -> tuple[int, ...]:
        """Each part's payload length (one part for version 2)."""
        return self.parts or (self.payload_len,)

    @property
    def tails_offset(self) -> int:
        """Where the tails start in field ``h``."""
        return HEADER_SIZE + (_COUNT.size + _LENGTH.size * len(self.parts) if self.parts else 0)

    def part_layout(self) -> list[PartPlacement]:
        """Where each part's body and tail go in the payload and in field ``h``."""
        if not self.parts:
            return [PartPlacement(0, self.body_len, self.tail_len, HEADER_SIZE)]
        return part_placements(self.parts, self.tails_offset)


@dataclass(frozen=True)
class PartPlacement:
    """One part of a value: its payload offset, body length (field ``body_field``) and
    tail, which is ``h[tail_at : tail_at + tail_len]`` and lands right after the body."""

    offset: int
    body_len: int
    tail_len: int
    tail_at: int


def part_placements(lengths: Sequence[int], tails_offset: int) -> list[PartPlacement]:
    """The placements of parts of ``lengths`` whose tails start at ``tails_offset`` of h."""
    out = []
    off, at = 0, tails_offset
    for n in lengths:
        body = body_length(n)
        out.append(PartPlacement(off, body, n - body, at))
        off += n
        at += n - body
    return out


@dataclass(frozen=True)
class PartTable:
    """What every value split into parts of the same lengths shares: the part table
    (empty for one part: version 2), each part's placement, each body field's (payload
    offset, length), the body fields' and the parts' total lengths."""

    table: bytes
    places: tuple[PartPlacement, ...]
    bodies: tuple[tuple[int, int], ...]
    body_len: int
    payload_len: int


@functools.lru_cache(maxsize=64)
def part_table(lengths: tuple[int, ...]) -> PartTable:
    """The ``PartTable`` of parts of ``lengths`` (kept per lengths: an engine stores
    one or two shapes over and over)."""
    if not lengths or min(lengths) <= 0 or len(lengths) > MAX_STORED_PARTS:
        raise ValueError(f"parts {lengths} do not split a payload")
    split = len(lengths) > 1
    table = _COUNT.pack(len(lengths)) + b"".join(_LENGTH.pack(x) for x in lengths) if split else b""
    placed = tuple(part_placements(lengths, HEADER_SIZE + len(table)))
    return PartTable(
        table,
        placed,
        tuple((p.offset, p.body_len) for p in placed),
        sum(p.body_len for p in placed),
        sum(lengths),
    )


def encode_header(
    fingerprint: bytes, payload: memoryview, key: bytes, *, with_checksum: bool
) -> tuple[bytes, int]:
    """The ``h`` field for ``payload`` stored under ``key`` (header plus tail), body length."""
    field_h, bodies = encode_value(fingerprint, payload, key, with_checksum=with_checksum)
    return field_h, bodies[0][1]


def encode_value(
    fingerprint: bytes,
    payload: memoryview,
    key: bytes,
    *,
    with_checksum: bool,
    parts: Sequence[int] | None = None,
) -> tuple[bytes, tuple[tuple[int, int], ...]]:
    """The ``h`` field for ``payload`` stored under ``key``, and each body field's
    (payload offset, length) in part order. ``parts`` (lengths adding up to the
    payload's) splits it into version 3 parts; None or one part writes version 2."""
    if len(fingerprint) != 16:
        raise ValueError("layout fingerprint must be 16 bytes")
    n = payload.nbytes
    shape = part_table(part_split(parts) or (n,))  # ValueError for a malformed split
    if shape.payload_len != n:
        raise ValueError(f"parts {tuple(parts or ())} do not split a payload of {n} bytes")
    head = HEADER.pack(
        MAGIC,
        PARTS_FORMAT_VERSION if shape.table else FORMAT_VERSION,
        FLAG_CHECKSUM if with_checksum else 0,
        fingerprint,
        n,
        shape.body_len,
        checksum(payload) if with_checksum else 0,
        key_digest(key),
    )
    if len(shape.places) == 1:  # version 2: the tail is the payload's end
        tails = payload[shape.body_len :].tobytes()
    else:
        tails = b"".join(
            payload[p.offset + p.body_len : p.offset + p.body_len + p.tail_len].tobytes()
            for p in shape.places
        )
    return head + shape.table + tails, shape.bodies


def decode_header(field_h: bytes | bytearray | memoryview) -> ValueHeader:
    """Parse field ``h``; raises ``InvalidValue`` if it is not a header of this format."""
    if len(field_h) < HEADER_SIZE:
        raise InvalidValue(f"header field is {len(field_h)} bytes, shorter than {HEADER_SIZE}")
    if bytes(field_h[:4]) != MAGIC:
        raise InvalidValue(f"bad magic {bytes(field_h[:4])!r}")
    version = int.from_bytes(field_h[4:6], "little")
    if version not in (FORMAT_VERSION, PARTS_FORMAT_VERSION):
        raise InvalidValue(f"unsupported format version {version}")
    magic, version, flags, fp, plen, blen, csum, kd = HEADER.unpack_from(field_h, 0)
    if flags & ~KNOWN_FLAGS:  # a later writer's flag may change how to read the payload
        raise InvalidValue(f"unknown flags {flags:#x}")
    if blen > plen:
        raise InvalidValue(f"body length {blen} exceeds payload length {plen}")
    parts: tuple[int, ...] = ()
    if version == PARTS_FORMAT_VERSION:
        if len(field_h) < HEADER_SIZE + _COUNT.size:
            raise InvalidValue("header field ends before its part table")
        (count,) = _COUNT.unpack_from(field_h, HEADER_SIZE)
        end = HEADER_SIZE + _COUNT.size + _LENGTH.size * count
        if not 2 <= count <= MAX_STORED_PARTS or len(field_h) < end:
            raise InvalidValue(f"bad part table of {count} parts")
        parts = struct.unpack_from(f"<{count}Q", field_h, HEADER_SIZE + _COUNT.size)
        if sum(parts) != plen or min(parts) <= 0:
            raise InvalidValue(f"parts {parts} do not add up to the payload length {plen}")
        if sum(body_length(n) for n in parts) != blen:
            raise InvalidValue(f"body length {blen} does not match the parts {parts}")
    hdr = ValueHeader(version, flags, bytes(fp), plen, blen, csum, bytes(kd), tuple(parts))
    if len(field_h) != hdr.tails_offset + hdr.tail_len:
        raise InvalidValue(
            f"header field holds {len(field_h) - hdr.tails_offset} tail bytes, "
            f"expected {hdr.tail_len}"
        )
    return hdr


@dataclass(frozen=True)
class ExpectedHeader:
    """Every byte a valid ``h`` field of one object shape must hold, but the checksum
    and key digest, which differ per value: a reader compares a field against this in a
    few slice compares instead of decoding it (``matches``). Only a value written with
    a checksum has this shape; one without goes through ``decode_header``."""

    fixed: bytes  # h[0:40]: magic, version, flags, fingerprint, payload and body lengths
    table: bytes  # h[64:tails_offset]: the part table (empty for version 2)
    field_len: int  # len(h): header, part table and every part's tail
    first_body_len: int  # bytes of field ``b``
    places: tuple[PartPlacement, ...]

    def matches(self, field_h: bytes, key_digest_: bytes, first_body_len: int) -> bool:
        """Whether ``field_h`` (with a first body field of ``first_body_len`` bytes) is a
        valid header of this shape under the key of digest ``key_digest_``."""
        return (
            len(field_h) == self.field_len
            and first_body_len == self.first_body_len
            and field_h.startswith(self.fixed)
            and field_h[_DIGEST_AT:HEADER_SIZE] == key_digest_
            and field_h[HEADER_SIZE : HEADER_SIZE + len(self.table)] == self.table
        )

    @staticmethod
    def checksum_of(field_h: bytes) -> int:
        """The payload checksum a field that ``matches`` carries."""
        return int.from_bytes(field_h[_CHECKSUM_AT:_DIGEST_AT], "little")


_CHECKSUM_AT = 40
_DIGEST_AT = 48


def expected_header(
    fingerprint: bytes, payload_len: int, parts: Sequence[int] | None = None
) -> ExpectedHeader:
    """The ``ExpectedHeader`` of objects of ``payload_len`` bytes in this layout, stored
    with a checksum in ``parts`` (None: whole, version 2) as ``encode_value`` writes them."""
    shape = part_table(part_split(parts) or (payload_len,))
    head = HEADER.pack(
        MAGIC,
        PARTS_FORMAT_VERSION if shape.table else FORMAT_VERSION,
        FLAG_CHECKSUM,
        fingerprint,
        payload_len,
        shape.body_len,
        0,
        bytes(KEY_DIGEST_SIZE),
    )
    return ExpectedHeader(
        fixed=head[:_CHECKSUM_AT],
        table=shape.table,
        field_len=HEADER_SIZE + len(shape.table) + payload_len - shape.body_len,
        first_body_len=shape.places[0].body_len,
        places=shape.places,
    )


def validate_header(
    hdr: ValueHeader,
    *,
    fingerprint: bytes,
    payload_len: int,
    body_field_len: int,
    key: bytes,
    require_checksum: bool,
    parts: Sequence[int] | None = None,
) -> None:
    """Raise ``InvalidValue`` unless ``hdr`` describes this key's object of this layout,
    size and split into ``parts`` (None: one part), its first body field being
    ``body_field_len`` bytes. With ``require_checksum`` a value written without a
    checksum is invalid too.
    """
    if hdr.key_digest != key_digest(key):
        raise KeyDigestMismatch()
    if require_checksum and not hdr.has_checksum:
        raise InvalidValue("value has no checksum and this reader requires one")
    if hdr.fingerprint != fingerprint:
        raise InvalidValue(
            f"layout fingerprint {hdr.fingerprint.hex()} differs from {fingerprint.hex()}"
        )
    if hdr.payload_len != payload_len:
        raise InvalidValue(f"payload length {hdr.payload_len}, expected {payload_len}")
    want = part_split(parts) or (payload_len,)
    if hdr.part_lengths != want:
        raise InvalidValue(f"parts {hdr.part_lengths}, expected {want}")
    first = body_length(want[0]) if hdr.parts else hdr.body_len
    if body_field_len != first:
        raise InvalidValue(f"body field is {body_field_len} bytes, header says {first}")


def check_stored_value(
    key: bytes, field_h: bytes, bodies: Sequence[bytes | None]
) -> tuple[ValueHeader, bytes]:
    """A stored value read back whole (its ``h`` field and its body fields, in order),
    checked on its own terms: a header that decodes, every body field present with the
    length the header gives, bound to ``key``, and its checksum, where it has one,
    matching. Returns the header and the payload; raises ``InvalidValue`` (or its
    ``KeyDigestMismatch`` / ``ChecksumMismatch``) naming what is wrong. A reader that
    knows the layout it expects also checks the header against it (``validate_header``)."""
    hdr = decode_header(field_h)
    places = hdr.part_layout()
    if len(bodies) != len(places):
        raise InvalidValue(f"{len(bodies)} body fields read, the header has {len(places)}")
    payload = bytearray()
    for i, (place, body) in enumerate(zip(places, bodies, strict=True)):
        name = body_field(i).decode()
        if body is None:
            raise InvalidValue(f"field {name} missing")
        if len(body) != place.body_len:
            raise InvalidValue(f"field {name} is {len(body)} bytes, expected {place.body_len}")
        payload += body + field_h[place.tail_at : place.tail_at + place.tail_len]
    if hdr.key_digest != key_digest(key):
        raise KeyDigestMismatch()
    if hdr.has_checksum and checksum(payload) != hdr.checksum:
        raise ChecksumMismatch()
    return hdr, bytes(payload)
