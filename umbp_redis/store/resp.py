"""RESP2 encoding and a reply reader that can receive bulk payloads into caller buffers.

Commands are encoded as lists of buffers: small pre-encoded pieces plus the caller's
memoryviews for large arguments, which go to the socket untouched (``sendmsg``).
``ReplyReader.read_bulk_into`` parses a bulk header and receives the payload straight
into a destination buffer with ``recv_into``.
"""

from __future__ import annotations

import socket
import ssl
import time
from collections.abc import Callable, Sequence
from typing import Any

from umbp_redis.store.errors import (
    RedisDataPlaneError,
    RedisProtocolError,
    RedisTimeoutError,
    RedisUnavailableError,
    classify_error_reply,
)

Buffer = Any  # any object with the buffer protocol (bytes, memoryview, numpy array)
CRLF = b"\r\n"
_READ_CHUNK = 256 * 1024
# Pieces one scatter read fills at most (below every platform's IOV_MAX).
_MAX_IOV = 64
# A reply field this client buffers whole (lines, small bulks) is never larger than this;
# larger lengths are a malformed or hostile reply, not something to allocate for.
MAX_BUFFERED_REPLY = 64 << 20


def parse_int(text: bytes | bytearray) -> int:
    """A RESP integer or length; a malformed one is a ``RedisProtocolError``."""
    try:
        return int(text)
    except ValueError:
        raise RedisProtocolError(f"malformed integer in reply: {bytes(text[:20])!r}") from None


def remaining(deadline: float) -> float:
    """Seconds left until ``deadline`` (monotonic); ``RedisTimeoutError`` once it passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise RedisTimeoutError("deadline passed")
    return left


def encode_command(*args: bytes | str | int) -> bytes:
    """One command with small arguments as one RESP array."""
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        b = a if isinstance(a, bytes) else str(a).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(out)


def bulk_prefix(n: int) -> bytes:
    """The ``$<n>\\r\\n`` that precedes a bulk argument of ``n`` bytes."""
    return b"$%d\r\n" % n


class ErrorReply:
    """An error reply inside a pipeline; ``exc`` is the typed exception it maps to."""

    __slots__ = ("exc", "message")

    def __init__(self, message: str) -> None:
        self.message = message
        self.exc = classify_error_reply(message)

    def __repr__(self) -> str:
        return f"ErrorReply({self.message!r})"


class ReplyReader:
    """Buffered RESP2 reader over one socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray(_READ_CHUNK)
        self.view = memoryview(self.buf)
        self.start = 0
        self.end = 0
        # When set (monotonic seconds), every receive waits at most until then: one
        # deadline covers a whole exchange, however many reads it takes.
        self.deadline: float | None = None

    # -- low level -------------------------------------------------------------------

    def _recv_into(self, mv: memoryview) -> int:
        return self._receive(lambda: self.sock.recv_into(mv))

    def _receive(self, call: Callable[[], int]) -> int:
        """Run one receive ``call`` within the deadline; the bytes it got (never 0)."""
        try:
            if self.deadline is not None:
                self.sock.settimeout(remaining(self.deadline))
            n = call()
        except TimeoutError:
            raise RedisTimeoutError("timed out waiting for Redis") from None
        except OSError as e:
            raise RedisUnavailableError(f"connection to Redis failed: {e}") from None
        if n == 0:
            raise RedisUnavailableError("Redis closed the connection")
        return n

    def _fill(self) -> None:
        """Read more bytes into the buffer, compacting or growing it when full."""
        if self.start == self.end:
            self.start = self.end = 0
            if len(self.buf) > 4 * _READ_CHUNK:  # a large reply grew it: give memory back
                self.buf = bytearray(_READ_CHUNK)
                self.view = memoryview(self.buf)
        elif self.end == len(self.buf):
            if self.start > 0:
                n = self.end - self.start
                self.buf[:n] = self.buf[self.start : self.end]
                self.start, self.end = 0, n
            else:  # a new, larger buffer: the old one has a live memoryview
                grown = bytearray(2 * len(self.buf))
                grown[: self.end] = self.view[: self.end]
                self.buf, self.view = grown, memoryview(grown)
        self.end += self._recv_into(self.view[self.end :])

    def read_line(self) -> bytes:
        """One line without its CRLF."""
        while True:
            i = self.buf.find(CRLF, self.start, self.end)
            if i >= 0:
                line = bytes(self.buf[self.start : i])
                self.start = i + 2
                return line
            if self.end - self.start > 65536:
                raise RedisProtocolError("reply line longer than 64 KiB")
            self._fill()

    def read_exact_into(self, dest: memoryview) -> None:
        """Fill ``dest`` from the stream: buffered bytes first, then ``recv_into`` directly."""
        n = dest.nbytes
        have = self.end - self.start
        take = min(have, n)
        if take:
            dest[:take] = self.view[self.start : self.start + take]
            self.start += take
        got = take
        while got < n:
            got += self._recv_into(dest[got:])

    def read_exact_into_pieces(self, pieces: Sequence[memoryview]) -> None:
        """Fill ``pieces`` in order from the stream: buffered bytes first, then one
        ``recvmsg_into`` per receive over every piece still open (a scatter read: as
        few system calls, and hand-overs of the GIL, as one buffer would take). Falls
        back to a read per piece where the socket has no ``recvmsg_into`` (TLS)."""
        open_pieces = [p for p in pieces if p.nbytes]
        while open_pieces and self.end > self.start:
            p = open_pieces[0]
            take = min(self.end - self.start, p.nbytes)
            p[:take] = self.view[self.start : self.start + take]
            self.start += take
            open_pieces[0] = p[take:]
            if take == p.nbytes:
                open_pieces.pop(0)
        if not open_pieces:
            return
        if isinstance(self.sock, ssl.SSLSocket) or not hasattr(self.sock, "recvmsg_into"):
            for p in open_pieces:
                self.read_exact_into(p)
            return
        while open_pieces:
            n = self._recvmsg_into(open_pieces[:_MAX_IOV])
            while n:
                p = open_pieces[0]
                if n >= p.nbytes:
                    n -= p.nbytes
                    open_pieces.pop(0)
                else:
                    open_pieces[0] = p[n:]
                    n = 0

    def _recvmsg_into(self, pieces: list[memoryview]) -> int:
        return self._receive(lambda: int(self.sock.recvmsg_into(pieces)[0]))

    def read_expected(self, frame: bytes, n: int) -> bytes | None:
        """If the stream goes on with ``frame`` (framing known in advance, e.g. an array
        header and a bulk header), ``n`` bytes and a CRLF, all of it buffered (or
        arrived in one receive into an empty buffer): consume it and return the ``n``
        bytes. Otherwise consume nothing and return None: the caller reads the reply
        piece by piece. Waits only while nothing at all is buffered, which a caller
        expecting a reply would do anyway."""
        if self.start == self.end:
            self._fill()
        at = self.start + len(frame)
        end = at + n + 2
        if end > self.end or not self.buf.startswith(frame, self.start):
            return None
        if not self.buf.startswith(CRLF, end - 2):
            return None
        self.start = end
        return bytes(self.view[at : end - 2])

    def read_exact(self, n: int) -> bytes:
        """``n`` bytes from the stream."""
        if n > MAX_BUFFERED_REPLY:
            raise RedisProtocolError(f"reply field of {n} bytes is larger than expected")
        while self.end - self.start < n:
            self._fill()
        out = bytes(self.buf[self.start : self.start + n])
        self.start += n
        return out

    def read_bulk_payload(self, n: int) -> bytes:
        """The ``n`` bytes of a bulk string (its header already read) and its CRLF."""
        data = self.read_exact(n)
        self.expect_crlf()
        return data

    def take_expected(self, candidates: Sequence[bytes]) -> int | None:
        """If the stream goes on with one of ``candidates`` (complete replies of a form
        known in advance): consume it and return its index. Otherwise consume nothing
        and return None: the caller reads the replies piece by piece. Receives more only
        while nothing is buffered or what is buffered is the start of a candidate: then
        the replies it begins are incomplete, so more bytes come whatever they are (a
        caller expecting them would wait for them anyway)."""
        while True:
            start, end = self.start, self.end
            for i, c in enumerate(candidates):
                if self.buf.startswith(c, start, end):
                    self.start += len(c)
                    return i
            if end > start and not any(
                end - start < len(c) and c.startswith(self.view[start:end]) for c in candidates
            ):
                return None
            self._fill()

    def skip(self, n: int) -> None:
        """Discard ``n`` bytes of the stream."""
        while n > 0:
            if self.start == self.end:
                self._fill()
            take = min(n, self.end - self.start)
            self.start += take
            n -= take

    def expect_crlf(self) -> None:
        """Consume the CRLF that ends a bulk payload."""
        while self.end - self.start < 2:
            self._fill()
        if self.buf.startswith(CRLF, self.start):
            self.start += 2
        else:
            raise RedisProtocolError("bulk payload not followed by CRLF")

    # -- replies ---------------------------------------------------------------------

    def read_reply(self) -> Any:
        """One reply: bytes, int, str (status), None, list, or an ``ErrorReply``."""
        line = self.read_line()
        if not line:
            raise RedisProtocolError("empty reply line")
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest.decode()
        if kind == b"-":
            return ErrorReply(rest.decode(errors="replace"))
        if kind == b":":
            return parse_int(rest)
        if kind == b"$":
            n = parse_int(rest)
            if n < 0:
                return None
            return self.read_bulk_payload(n)
        if kind == b"*":
            n = parse_int(rest)
            if n < 0:
                return None
            return [self.read_reply() for _ in range(n)]
        raise RedisProtocolError(f"unexpected reply type {line[:20]!r}")

    def read_array_header(self) -> int | ErrorReply:
        """An array header's length (-1 for a null array), or the error reply instead."""
        line = self.read_line()
        if line[:1] == b"*":
            return parse_int(line[1:])
        if line[:1] == b"-":
            return ErrorReply(line[1:].decode(errors="replace"))
        raise RedisProtocolError(f"expected an array, got {line[:20]!r}")

    def read_bulk_header(self) -> int | ErrorReply:
        """A bulk string's length (-1 for null), or the error reply instead."""
        line = self.read_line()
        if line[:1] == b"$":
            return parse_int(line[1:])
        if line[:1] == b"-":
            return ErrorReply(line[1:].decode(errors="replace"))
        raise RedisProtocolError(f"expected a bulk string, got {line[:20]!r}")

    def read_int_replies(self, count: int) -> list[int | ErrorReply]:
        """``count`` integer replies; fast path for the 4-byte ``:0``/``:1`` replies."""
        out: list[int | ErrorReply] = []
        while len(out) < count:
            while self.end - self.start < 4:
                self._fill()
            avail = (self.end - self.start) // 4
            k = min(avail, count - len(out))
            chunk = self.buf[self.start : self.start + 4 * k]
            if (
                chunk[0::4] == b":" * k
                and chunk[2::4] == b"\r" * k
                and chunk[3::4] == b"\n" * k
                and chunk[1::4].isdigit()
            ):
                out.extend(c - 48 for c in chunk[1::4])
                self.start += 4 * k
                continue
            reply = self.read_reply()  # a multi-digit integer or an error reply
            if not isinstance(reply, int | ErrorReply):
                raise RedisProtocolError(f"expected an integer reply, got {reply!r}")
            out.append(reply)
        return out


def send_buffers(
    sock: socket.socket,
    buffers: Sequence[Buffer],
    *,
    use_sendmsg: bool,
    deadline: float | None = None,
) -> None:
    """Send every buffer in order without joining them (scatter-gather when possible).

    With ``deadline`` (monotonic seconds) the whole send finishes by then or raises
    ``RedisTimeoutError``.
    """
    try:
        if not use_sendmsg:
            for b in buffers:
                if deadline is not None:
                    sock.settimeout(remaining(deadline))
                sock.sendall(b)
            return
        pending = [memoryview(b).cast("B") for b in buffers if len(b)]
        i = 0
        while i < len(pending):
            batch = pending[i : i + 512]
            if deadline is not None:
                sock.settimeout(remaining(deadline))
            sent = sock.sendmsg(batch)
            # Advance past fully sent buffers and trim a partly sent one.
            while sent > 0:
                n = pending[i].nbytes
                if sent >= n:
                    sent -= n
                    i += 1
                else:
                    pending[i] = pending[i][sent:]
                    sent = 0
    except TimeoutError:
        raise RedisTimeoutError("timed out sending to Redis") from None
    except RedisDataPlaneError:
        raise
    except OSError as e:
        raise RedisUnavailableError(f"connection to Redis failed: {e}") from None
