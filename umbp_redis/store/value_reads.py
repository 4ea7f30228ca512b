"""Reading stored values out of ``HMGET`` replies, straight into the caller's buffers.

A load asks for a value's header field and body fields (``value_format``) with one
``HMGET`` (or its later parts with one each) and reads the reply here: the header is
validated against the key, layout fingerprint, size and split before any body byte is
received, each body lands in its place in the destination, each part's tail after it,
and the checksum over the whole payload decides the final status. Only bytes that fail
validation make a value ``INVALID``; an error reply is ``ERROR`` (or the redirect, for
the cluster client) and a missing key ``MISSING``.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from umbp_redis.store.errors import RedisDataPlaneError, RedisLoadingError, RedisRedirectError
from umbp_redis.store.resp import Buffer, ErrorReply, ReplyReader
from umbp_redis.store.value_format import (
    ExpectedHeader,
    InvalidValue,
    PartPlacement,
    checksum_of_pieces,
    decode_header,
    expected_header,
    key_digest,
    longest_header_field,
    validate_header,
)

log = logging.getLogger(__name__)
# Object shapes (layout, size, split) a reader keeps the expected header of; an engine
# has one or two, so more means a caller cycling through sizes: start over.
_MAX_SHAPES = 64
_Shape = tuple[bytes, int, tuple[int, ...] | None, int]  # layout, size, split, reply fields


class LoadStatus(enum.Enum):
    """Outcome of loading one key."""

    LOADED = "loaded"
    MISSING = "missing"
    INVALID = "invalid"
    ERROR = "error"


def target_views(target: Buffer | list[Buffer]) -> list[memoryview]:
    """A load destination as byte views in payload order: one buffer, or a list of
    buffers that receive consecutive pieces of the payload (e.g. a block's pages in the
    engine's KV cache)."""
    if isinstance(target, list):
        return [memoryview(p).cast("B") for p in target]
    return [memoryview(target).cast("B")]


def views_nbytes(views: Sequence[memoryview]) -> int:
    """Bytes of a destination given as views (``target_views``)."""
    return views[0].nbytes if len(views) == 1 else sum(v.nbytes for v in views)


def target_nbytes(target: Buffer | list[Buffer]) -> int:
    """Bytes of a load destination (a buffer, or a list of buffers)."""
    if isinstance(target, list):
        return sum(memoryview(p).nbytes for p in target)
    return memoryview(target).nbytes


def _read_into_pieces(reader: ReplyReader, pieces: Sequence[memoryview]) -> None:
    """Fill ``pieces`` (in order) from the stream."""
    if len(pieces) == 1:
        reader.read_exact_into(pieces[0])
    else:
        reader.read_exact_into_pieces(pieces)


def _span(pieces: Sequence[memoryview], offset: int, n: int) -> list[memoryview]:
    """Views of payload bytes ``offset .. offset + n`` across ``pieces``."""
    if len(pieces) == 1:
        return [pieces[0][offset : offset + n]]
    out = []
    pos = 0
    for p in pieces:
        end = pos + p.nbytes
        if n > 0 and end > offset:
            start = offset - pos
            take = min(p.nbytes - start, n)
            out.append(p[start : start + take])
            offset, n = offset + take, n - take
        pos = end
    return out


def _write_at(pieces: Sequence[memoryview], offset: int, data: bytes) -> None:
    """Write ``data`` at payload offset ``offset`` across ``pieces``."""
    pos = 0
    for p in pieces:
        end = pos + p.nbytes
        if data and end > offset:
            start = offset - pos
            take = min(p.nbytes - start, len(data))
            p[start : start + take] = data[:take]
            data, offset = data[take:], offset + take
        pos = end


@dataclass(slots=True)
class ValueRead:
    """One value a load reads: its key and destination (byte views in payload order:
    ``target_views``), and what is known while its fields arrive: from its header (once
    read) where each part goes and the checksum to verify (None: written without one),
    and its final status (None while it may still load)."""

    key: bytes
    dest: list[memoryview]
    field_h: bytes = b""
    places: Sequence[PartPlacement] = ()
    checksum: int | None = None
    status: LoadStatus | RedisRedirectError | None = None


class ValueReader:
    """Reads one stored value's ``HMGET`` reply (or one part's) into its destination.

    ``require_checksum`` rejects values written without one; ``note_refusal`` is told
    of an error reply in place of a value (a permission refusal is an operator's
    matter: the data plane reports it)."""

    def __init__(self, require_checksum: bool, note_refusal: Callable[[ErrorReply], None]) -> None:
        self._require_checksum = require_checksum
        self._note_refusal = note_refusal
        self._shapes: dict[_Shape, tuple[ExpectedHeader, bytes]] = {}

    def _expected(
        self, fingerprint: bytes, size: int, parts: tuple[int, ...] | None, fields: int
    ) -> tuple[ExpectedHeader, bytes]:
        """The header every checksummed value of this shape carries, and the framing
        that precedes it in a reply of ``fields`` fields (kept per shape)."""
        shape = (fingerprint, size, parts, fields)
        known = self._shapes.get(shape)
        if known is None:
            if len(self._shapes) >= _MAX_SHAPES:
                self._shapes.clear()
            exp = expected_header(fingerprint, size, parts)
            known = self._shapes[shape] = (exp, b"*%d\r\n$%d\r\n" % (fields, exp.field_len))
        return known

    def read_fields(
        self,
        r: ReplyReader,
        v: ValueRead,
        fingerprint: bytes,
        parts: tuple[int, ...] | None,
        first: int,
        count: int,
        asking: bool = False,
    ) -> bool:
        """Read one HMGET reply holding body fields ``first .. first + count - 1`` of
        value ``v`` of this layout and split (and, when ``first`` is 0, its header field
        before them) into ``v.dest``; whatever is wrong is recorded in ``v.status``.
        True while the value may load. ``asking``: the reply follows ``ASKING``'s, which
        is read first."""
        if asking:
            r.read_reply()  # ASKING's +OK
        if first == 0:
            exp, frame = self._expected(fingerprint, views_nbytes(v.dest), parts, count + 1)
            # The usual reply: its framing is known, taken in one step when buffered.
            field_h = None if asking else r.read_expected(frame, exp.field_len)
            if field_h is not None:
                self._check_header(r, v, fingerprint, parts, field_h, exp)
                return self._read_bodies(r, v, 1, count - 1)
        n = r.read_array_header()
        if isinstance(n, ErrorReply):
            # MOVED, ASK, READONLY, NOPERM, WRONGTYPE...: the server did not hand over
            # bytes, so nothing is known about the value: an error, never "invalid".
            if isinstance(n.exc, RedisLoadingError):
                raise n.exc
            if v.status is None:
                if isinstance(n.exc, RedisRedirectError):
                    v.status = n.exc
                else:
                    self._note_refusal(n)
                    v.status = LoadStatus.ERROR
            return False
        if n != count + (first == 0):
            raise RedisDataPlaneError(f"HMGET returned {n} fields")
        if first == 0:
            self._read_header(r, v, fingerprint, parts, exp)
            return self._read_bodies(r, v, 1, count - 1)
        return self._read_bodies(r, v, first, count)

    def _read_bodies(self, r: ReplyReader, v: ValueRead, first: int, count: int) -> bool:
        """Read body fields ``first .. first + count - 1`` of a reply into ``v.dest``."""
        for i in range(first, first + count):
            blen = r.read_bulk_header()
            if isinstance(blen, ErrorReply):
                raise RedisDataPlaneError(blen.message)
            if v.status is not None:
                if blen >= 0:
                    r.skip(blen + 2)
                continue
            if blen < 0:  # gone since its header was read: nothing known of a new one
                v.status = LoadStatus.ERROR
                continue
            place = v.places[i]
            if blen != place.body_len:
                log.debug(
                    "invalid value: body field %d is %d bytes, not %d", i, blen, place.body_len
                )
                r.skip(blen + 2)
                v.status = LoadStatus.INVALID
                continue
            self.receive_part(r, v, place)
        return v.status is None

    def _read_header(
        self,
        r: ReplyReader,
        v: ValueRead,
        fingerprint: bytes,
        parts: tuple[int, ...] | None,
        exp: ExpectedHeader,
    ) -> None:
        """Read a value's header field and first body field into ``v`` (its array header
        already read); ``exp``: the header of its shape."""
        hlen = r.read_bulk_header()
        if isinstance(hlen, ErrorReply):
            raise RedisDataPlaneError(hlen.message)
        too_long = hlen > longest_header_field(views_nbytes(v.dest))
        field_h = None if hlen < 0 or too_long else r.read_bulk_payload(hlen)
        if too_long:
            r.skip(hlen + 2)
        if field_h is None:
            blen = r.read_bulk_header()
            if isinstance(blen, ErrorReply):
                raise RedisDataPlaneError(blen.message)
            if blen >= 0:
                r.skip(blen + 2)
                v.status = LoadStatus.INVALID
            else:
                v.status = LoadStatus.INVALID if too_long else LoadStatus.MISSING
            return
        self._check_header(r, v, fingerprint, parts, field_h, exp)

    def _check_header(
        self,
        r: ReplyReader,
        v: ValueRead,
        fingerprint: bytes,
        parts: tuple[int, ...] | None,
        field_h: bytes,
        exp: ExpectedHeader,
    ) -> None:
        """Validate a value's header field (already read) against the first body field's
        length (read here) and receive that body into ``v.dest``; or record why not."""
        blen = r.read_bulk_header()
        if isinstance(blen, ErrorReply):
            raise RedisDataPlaneError(blen.message)
        if exp.matches(field_h, key_digest(v.key), blen):  # the usual case, a few compares
            v.field_h, v.places, v.checksum = field_h, exp.places, exp.checksum_of(field_h)
            self.receive_part(r, v, exp.places[0])
            return
        try:
            if blen < 0:
                raise InvalidValue("body field missing")
            hdr = decode_header(field_h)
            validate_header(
                hdr,
                fingerprint=fingerprint,
                payload_len=views_nbytes(v.dest),
                body_field_len=blen,
                key=v.key,
                require_checksum=self._require_checksum,
                parts=parts,
            )
        except InvalidValue as e:
            log.debug("invalid value: %s", e)
            if blen >= 0:
                r.skip(blen + 2)
            v.status = LoadStatus.INVALID
            return
        v.field_h, v.places = bytes(field_h), hdr.part_layout()
        v.checksum = hdr.checksum if hdr.has_checksum else None
        self.receive_part(r, v, v.places[0])

    @staticmethod
    def receive_part(r: ReplyReader, v: ValueRead, place: PartPlacement) -> None:
        """Receive one body field (its length already read and checked) into its place
        in ``v.dest``, and put the part's tail after it."""
        dest = v.dest
        if len(dest) == 1:  # one destination buffer: no pieces to walk
            whole, start = dest[0], place.offset
            body_end = start + place.body_len
            r.read_exact_into(whole[start:body_end])
            r.expect_crlf()
            if place.tail_len:
                whole[body_end : body_end + place.tail_len] = v.field_h[
                    place.tail_at : place.tail_at + place.tail_len
                ]
            return
        _read_into_pieces(r, _span(dest, place.offset, place.body_len))
        r.expect_crlf()
        if place.tail_len:
            tail = v.field_h[place.tail_at : place.tail_at + place.tail_len]
            _write_at(dest, place.offset + place.body_len, tail)

    @staticmethod
    def finish_value(v: ValueRead) -> None:
        """Final status of a value whose every field was received: its checksum decides."""
        assert v.places, "finish_value before the header was read"
        if v.checksum is not None and checksum_of_pieces(v.dest) != v.checksum:
            log.debug("checksum mismatch")
            v.status = LoadStatus.INVALID
        else:
            v.status = LoadStatus.LOADED
