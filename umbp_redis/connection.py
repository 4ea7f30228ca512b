"""Connections to Redis: one socket each, a bounded pool, and a fail-fast window.

A connection that saw any I/O error or timeout is closed, never reused: its stream
may hold half a reply. The pool makes a new one on the next call (automatic
reconnect), unless a failure happened less than ``fail_fast_s`` ago, in which case
the call fails at once with ``RedisUnavailableError``.
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from umbp_redis.config import RedisSettings
from umbp_redis.errors import (
    RedisAuthError,
    RedisDataPlaneError,
    RedisLoadingError,
    RedisTimeoutError,
    RedisUnavailableError,
)
from umbp_redis.resp import ErrorReply, ReplyReader, encode_command, send_buffers

log = logging.getLogger(__name__)


class RedisConnection:
    """One connected, authenticated socket with a RESP reader."""

    def __init__(self, settings: RedisSettings) -> None:
        self.settings = settings
        self.sock = self._connect()
        self.reader = ReplyReader(self.sock)
        self.use_sendmsg = not settings.tls
        self.closed = False
        try:
            self._handshake()
        except BaseException:
            self.close()
            raise

    def _connect(self) -> socket.socket:
        s = self.settings
        try:
            if s.scheme == "unix":
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(s.connect_timeout_s)
                sock.connect(s.path or "")
            else:
                sock = socket.create_connection((s.host, s.port), timeout=s.connect_timeout_s)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if s.tls:
                ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=s.tls_ca_cert)
                ctx.check_hostname = s.tls_check_hostname
                if s.tls_cert:
                    ctx.load_cert_chain(s.tls_cert, s.tls_key)
                sock = ctx.wrap_socket(sock, server_hostname=s.host)
        except TimeoutError:
            raise RedisTimeoutError(
                f"connecting to {s.redacted_url} timed out after {s.connect_timeout_s}s"
            ) from None
        except ssl.SSLError as e:
            raise RedisUnavailableError(
                f"TLS handshake with {s.redacted_url} failed: {e}"
            ) from None
        except OSError as e:
            raise RedisUnavailableError(f"cannot connect to {s.redacted_url}: {e}") from None
        sock.settimeout(s.op_timeout_s)
        return sock

    def _handshake(self) -> None:
        s = self.settings
        cmds = []
        if s.password is not None:
            cmds.append(
                encode_command("AUTH", s.username, s.password)
                if s.username
                else encode_command("AUTH", s.password)
            )
        if s.db:
            cmds.append(encode_command("SELECT", s.db))
        cmds.append(encode_command("CLIENT", "SETNAME", "umbp-redis"))
        send_buffers(self.sock, [b"".join(cmds)], use_sendmsg=False)
        for _ in cmds:
            reply = self.reader.read_reply()
            if isinstance(reply, ErrorReply):
                if isinstance(reply.exc, RedisAuthError) or "AUTH" in reply.message.upper():
                    # The server's message never contains the password; ours neither.
                    raise RedisAuthError(
                        f"authentication to {s.redacted_url} failed: {reply.message}"
                    )
                raise reply.exc

    def settimeout(self, seconds: float) -> None:
        """Timeout of each socket operation from now on."""
        self.sock.settimeout(seconds)

    def close(self) -> None:
        """Close the socket (idempotent)."""
        if not self.closed:
            self.closed = True
            try:
                self.sock.close()
            except OSError:
                pass


class ConnectionPool:
    """At most ``max_connections`` connections per process; LIFO reuse; fail-fast window."""

    def __init__(self, settings: RedisSettings) -> None:
        self.settings = settings
        self._idle: list[RedisConnection] = []
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(settings.max_connections)
        self._failed_at: float | None = None
        self.failures = 0
        self.connects = 0

    def note_failure(self, exc: BaseException) -> None:
        """Open the fail-fast window after a connection-level failure."""
        with self._lock:
            first = self._failed_at is None
            self._failed_at = time.monotonic()
            self.failures += 1
        if first:
            log.warning(
                "Redis at %s failed (%s); treating it as a miss for %.1fs",
                self.settings.redacted_url,
                exc,
                self.settings.fail_fast_s,
            )

    def _check_window(self) -> None:
        failed_at = self._failed_at
        if failed_at is not None:
            if time.monotonic() - failed_at < self.settings.fail_fast_s:
                raise RedisUnavailableError(
                    f"Redis at {self.settings.redacted_url} failed "
                    f"{time.monotonic() - failed_at:.2f}s ago; failing fast"
                )

    @property
    def healthy(self) -> bool:
        """False inside the fail-fast window."""
        try:
            self._check_window()
            return True
        except RedisUnavailableError:
            return False

    @contextmanager
    def connection(self, timeout: float | None = None) -> Iterator[RedisConnection]:
        """A connection for one exchange; it is closed instead of reused after an error."""
        self._check_window()
        wait = self.settings.op_timeout_s if timeout is None else timeout
        if not self._slots.acquire(timeout=wait):
            raise RedisTimeoutError(
                f"all {self.settings.max_connections} Redis connections busy for {wait}s"
            )
        conn: RedisConnection | None = None
        try:
            with self._lock:
                conn = self._idle.pop() if self._idle else None
            if conn is None:
                try:
                    conn = RedisConnection(self.settings)
                except RedisDataPlaneError as e:
                    if not isinstance(e, RedisAuthError):
                        self.note_failure(e)
                    raise
                self.connects += 1
                if self._failed_at is not None:
                    log.info("Redis at %s is reachable again", self.settings.redacted_url)
                    self._failed_at = None
            conn.settimeout(self.settings.op_timeout_s if timeout is None else timeout)
            try:
                yield conn
            except BaseException as e:
                conn.close()
                if isinstance(e, RedisUnavailableError | RedisTimeoutError | RedisLoadingError):
                    self.note_failure(e)
                raise
            else:
                with self._lock:
                    self._idle.append(conn)
        finally:
            self._slots.release()

    def close(self) -> None:
        """Close every idle connection."""
        with self._lock:
            idle, self._idle = self._idle, []
        for c in idle:
            c.close()
