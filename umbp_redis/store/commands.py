"""The RESP bytes of every command the data planes send, built in one place.

Commands are pre-encoded bytes: lookups per block from templates around the block
hash's position (``LookupEncoder`` on one server, ``ClusterLookupEncoder`` on a cluster;
``RequestCountEncoder`` counts a request against a block in the same round trip),
stores as ``MULTI``/``HSET``/``EXPIRE``/``EXEC`` (``hset_head`` and ``body_heads`` frame
the value's fields so the body bytes are sent from staging without a copy), loads as
``HMGET``. The hash's field names come from ``value_format``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

from umbp_redis.store.resp import bulk_prefix, encode_command
from umbp_redis.store.slots import key_slot
from umbp_redis.store.value_format import HEADER_FIELD, body_field


def _bulk(arg: bytes) -> bytes:
    """One bulk argument: its length prefix, its bytes and the CRLF that ends it."""
    return b"$%d\r\n%s\r\n" % (len(arg), arg)


_HEADER_ARG = _bulk(HEADER_FIELD)


def ttl_argument(ttl_seconds: float) -> bytes:
    """The ``ttl_seconds`` option as the TTL argument of ``EXPIRE`` and ``SET ... EX``:
    whole seconds."""
    return str(int(ttl_seconds)).encode()


def keyed_head(command: bytes, nargs: int, key_prefix: bytes, hash_len: int) -> bytes:
    """The start of ``command`` (of ``nargs`` words, itself included) up to its key's
    ``key_prefix``, for a key that ends with ``hash_len`` more bytes (the block hash)."""
    return b"*%d\r\n$%d\r\n%s\r\n$%d\r\n%s" % (
        nargs,
        len(command),
        command,
        len(key_prefix) + hash_len,
        key_prefix,
    )


def ttl_tail(ttl: bytes) -> bytes:
    """What follows an ``EXPIRE`` command's key: the TTL argument and the command's end."""
    return b"\r\n$%d\r\n%s\r\n" % (len(ttl), ttl)


def check_hash_hex(hash_hex: bytes, expected_len: int) -> None:
    """Raise ``ValueError`` unless ``hash_hex`` has the length an encoder was built for."""
    if len(hash_hex) != expected_len:
        raise ValueError(f"block hash hex of {len(hash_hex)} chars, expected {expected_len}")


def expire_command(k: bytes, ttl: bytes) -> bytes:
    """``EXPIRE k ttl``."""
    return keyed_head(b"EXPIRE", 3, k, 0) + ttl_tail(ttl)


def set_marker_command(k: bytes, ttl: bytes) -> bytes:
    """``SET k 1 EX ttl``: a block's stored marker (answers ``+OK``)."""
    return encode_command(b"SET", k, b"1", b"EX", ttl)


def touch_command(keys: Sequence[bytes]) -> bytes:
    """``TOUCH key...`` of every key of ``keys``."""
    return b"*%d\r\n$5\r\nTOUCH\r\n%s" % (len(keys) + 1, b"".join(_bulk(k) for k in keys))


class LookupEncoder:
    """Encodes one block's lookup commands from the block hash alone, fast.

    ``prefixes`` are the block's keys up to the hash (every rank and group); the
    commands of ``lookup_commands`` are precomputed around the hash's position, so a
    block costs one ``bytes.join`` with the hash's hex as the separator.
    """

    def __init__(
        self, prefixes: Sequence[bytes], *, refresh_ttl: bool, ttl: bytes, hash_hex_len: int
    ) -> None:
        self.refresh_ttl = refresh_ttl
        self.replies = len(prefixes) if refresh_ttl else 1
        self.hash_hex_len = hash_hex_len
        n = hash_hex_len
        pieces: list[bytes] = []
        if refresh_ttl:
            tail = ttl_tail(ttl)
            for i, p in enumerate(prefixes):
                head = keyed_head(b"EXPIRE", 3, p, n)
                pieces.append(head if i == 0 else tail + head)
            pieces.append(tail)
        else:
            head = b"*%d\r\n$5\r\nTOUCH\r\n" % (len(prefixes) + 1)
            for i, p in enumerate(prefixes):
                arg = b"$%d\r\n%s" % (len(p) + n, p)
                pieces.append(head + arg if i == 0 else b"\r\n" + arg)
            pieces.append(b"\r\n")
        self._pieces = pieces

    def encode(self, hash_hex: bytes) -> bytes:
        """The block's commands (``lookup_commands`` of its keys), for a hash of the
        length given at construction."""
        check_hash_hex(hash_hex, self.hash_hex_len)
        return hash_hex.join(self._pieces)


def lookup_commands(keys: Sequence[bytes], *, refresh_ttl: bool, ttl: bytes) -> tuple[bytes, int]:
    """Pre-encoded presence check of ``keys`` that together form one block, and its reply count.

    With ``refresh_ttl`` one ``EXPIRE`` per key (answers 1 for a hit and re-arms its TTL),
    else one multi-key ``TOUCH`` (answers how many exist). Both update the keys' LRU
    clock (``EXISTS`` would not), so a prefix every request relies on stays the most
    recently used. The block is present iff its replies add up to ``len(keys)``.
    """
    if refresh_ttl:
        return b"".join(expire_command(k, ttl) for k in keys), len(keys)
    return touch_command(keys), 1


# Commands without arguments, and the one-shot redirect of Redis Cluster.
MULTI = encode_command(b"MULTI")
ASKING = encode_command(b"ASKING")
EXEC = encode_command(b"EXEC")


@functools.lru_cache(maxsize=16)
def transaction_replies(fields: int) -> tuple[bytes, bytes]:
    """A stored object's replies (MULTI, two QUEUED, then EXEC's [fields HSET added,
    EXPIRE 1]) as they usually come: the key held a value of the same split (no field
    added) or none (all ``fields`` added)."""
    tx = b"+OK\r\n+QUEUED\r\n+QUEUED\r\n*2\r\n:%d\r\n:1\r\n"
    return tx % 0, tx % fields


@functools.cache
def _hmget_frame(parts: int) -> tuple[bytes, bytes]:
    """What comes before a key's length in an HMGET of ``parts`` body fields, and after
    the key: the header field's and every body field's names."""
    fields = b"".join(_bulk(body_field(i)) for i in range(parts))
    return b"*%d\r\n$5\r\nHMGET\r\n$" % (parts + 3), b"\r\n" + _HEADER_ARG + fields


def hmget_command(k: bytes, parts: int = 1) -> bytes:
    """HMGET of a value's header field and its ``parts`` body fields."""
    head, fields = _hmget_frame(parts)
    return b"%s%d\r\n%s%s" % (head, len(k), k, fields)


def hset_head(key: bytes, header: bytes, bodies: int) -> bytes:
    """The start of ``HSET key`` of a value with ``bodies`` body fields: its header field
    and ``header`` (its bytes from ``encode_value``), then the body fields follow
    (``body_heads``)."""
    return b"*%d\r\n$4\r\nHSET\r\n%s%s%s" % (
        2 + 2 * (1 + bodies),  # HSET, the key, a name and a value per field
        _bulk(key),
        _HEADER_ARG,
        _bulk(header),
    )


@functools.lru_cache(maxsize=64)
def body_heads(bodies: tuple[tuple[int, int], ...]) -> tuple[bytes, ...]:
    """For HSET of body fields of these (offset, length): what goes before each body's
    bytes: the CRLF ending the previous argument (but for the first), the field's name
    and the body's bulk prefix."""
    return tuple(
        (b"\r\n" if i else b"") + _bulk(f) + bulk_prefix(n)
        for i, (f, (_, n)) in enumerate((body_field(i), b) for i, b in enumerate(bodies))
    )


def hmget_part_command(k: bytes, part: int) -> bytes:
    """HMGET of body field ``part`` (>= 1) alone."""
    return encode_command(b"HMGET", k, body_field(part))


class SlottedBlock(NamedTuple):
    """One block's lookup commands, one per key, and each key's slot (computed once)."""

    cmds: tuple[bytes, ...]
    slots: tuple[int, ...]


class ClusterLookupEncoder:
    """Encodes one block's per-key lookup commands from the block hash, with slots.

    On a cluster every key is its own command (a multi-key ``TOUCH`` of keys in
    different slots is refused): ``EXPIRE key ttl`` with ``refresh_ttl``, else
    ``TOUCH key``; each answers 1 for a present key.
    """

    def __init__(
        self, prefixes: Sequence[bytes], *, refresh_ttl: bool, ttl: bytes, hash_hex_len: int
    ) -> None:
        self.prefixes = tuple(prefixes)
        self.replies = len(self.prefixes)
        self.hash_hex_len = hash_hex_len
        n = hash_hex_len
        if refresh_ttl:
            tail = ttl_tail(ttl)
            self._heads = tuple(keyed_head(b"EXPIRE", 3, p, n) for p in self.prefixes)
        else:
            tail = b"\r\n"
            self._heads = tuple(keyed_head(b"TOUCH", 2, p, n) for p in self.prefixes)
        self._tail = tail

    def encode(self, hash_hex: bytes) -> SlottedBlock:
        """The block's commands and slots, for a hash of the length given at construction."""
        check_hash_hex(hash_hex, self.hash_hex_len)
        tail = hash_hex + self._tail
        return SlottedBlock(
            tuple(h + tail for h in self._heads),
            tuple(key_slot(p + hash_hex) for p in self.prefixes),
        )


class RequestCountEncoder:
    """Encodes one block's request count for one server's ``lookup_blocks``: ``INCR
    key`` (answers the count after this request) and ``EXPIRE key ttl`` (answers 1),
    ``key`` being ``prefix`` + the block hash's hex."""

    replies = 2

    def __init__(self, prefix: bytes, *, ttl: bytes, hash_hex_len: int) -> None:
        self.prefix = prefix
        self.hash_hex_len = hash_hex_len
        self._incr = keyed_head(b"INCR", 2, prefix, hash_hex_len)
        self._expire = keyed_head(b"EXPIRE", 3, prefix, hash_hex_len)
        self._expire_tail = ttl_tail(ttl)

    def commands(self, hash_hex: bytes) -> tuple[bytes, bytes]:
        """The block's two commands, for a hash of the length given at construction."""
        check_hash_hex(hash_hex, self.hash_hex_len)
        return self._incr + hash_hex + b"\r\n", self._expire + hash_hex + self._expire_tail

    def encode(self, hash_hex: bytes) -> bytes:
        """The block's two commands in one buffer."""
        return b"".join(self.commands(hash_hex))


class ClusterRequestCountEncoder:
    """``RequestCountEncoder``'s commands for a cluster's ``lookup_blocks``: both in
    the counter key's slot."""

    replies = 2

    def __init__(self, prefix: bytes, *, ttl: bytes, hash_hex_len: int) -> None:
        self._commands = RequestCountEncoder(prefix, ttl=ttl, hash_hex_len=hash_hex_len)

    def encode(self, hash_hex: bytes) -> SlottedBlock:
        """The block's two commands and their slot."""
        slot = key_slot(self._commands.prefix + hash_hex)
        return SlottedBlock(self._commands.commands(hash_hex), (slot, slot))


def xadd_command(k: bytes, max_len: int, fields: Sequence[bytes]) -> bytes:
    """``XADD k MAXLEN ~ max_len * field value ...``: one stream entry, the stream trimmed
    to about ``max_len`` entries (answers the new entry's id)."""
    return encode_command(b"XADD", k, b"MAXLEN", b"~", max_len, b"*", *fields)


def xrange_after_command(k: bytes, after: bytes, count: int) -> bytes:
    """``XRANGE k (after + COUNT count``: at most ``count`` entries newer than the id
    ``after`` (``-`` for the first ones)."""
    start = after if after == b"-" else b"(" + after
    return encode_command(b"XRANGE", k, start, b"+", b"COUNT", count)


def exists_command(k: bytes) -> bytes:
    """``EXISTS k`` (answers 1 or 0)."""
    return encode_command(b"EXISTS", k)
