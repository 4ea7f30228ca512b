"""Connections to Redis: one socket each, a bounded pool, a warm lookup connection.

A connection that saw any I/O error or timeout is closed, never reused: its stream
may hold half a reply. Two kinds of holders share nothing but the settings:

* ``ConnectionPool`` for bulk transfers (stores, loads): at most ``max_connections``
  sockets, made on demand on the transfer threads.
* ``WarmConnection`` for lookups: one socket made and re-made on a background thread,
  so a caller on the scheduler thread never waits for DNS, connect, TLS or the
  handshake; it waits at most until its own deadline for the connection to be ready.

Each has its own health: a fail-fast window (``fail_fast_s``) is opened only by
connection-level failures (refused, reset, closed, a connect that timed out, a
refused login), never by a slow reply, and while it is open calls fail at once
instead of piling up behind a dead server.
"""

from __future__ import annotations

import logging
import select
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from umbp_redis.store.errors import (
    RedisAuthError,
    RedisDataPlaneError,
    RedisLoadingError,
    RedisTimeoutError,
    RedisUnavailableError,
)
from umbp_redis.store.resp import ErrorReply, ReplyReader, encode_command, remaining, send_buffers
from umbp_redis.store.settings import RedisSettings

log = logging.getLogger(__name__)

AUTH_LOG_INTERVAL_S = 60.0


class AuthAlarm:
    """Counts refused logins and commands; logs one ERROR per failure window.

    A window starts with the first refusal and ends with a successful login or after
    ``AUTH_LOG_INTERVAL_S``. The message names the server, the user and the refused
    command, never the password.
    """

    def __init__(self, settings: RedisSettings) -> None:
        self.settings = settings
        self.count = 0
        self._logged_at: float | None = None
        self._login_refused = False
        self._lock = threading.Lock()

    def report(self, command: str, message: str) -> None:
        """Count one refusal of ``command`` with the server's ``message``."""
        now = time.monotonic()
        with self._lock:
            self.count += 1
            self._login_refused = command in ("AUTH", "SELECT")
            quiet = self._logged_at is not None and now - self._logged_at < AUTH_LOG_INTERVAL_S
            if not quiet:
                self._logged_at = now
        if not quiet:
            s = self.settings
            log.error(
                "umbp-redis: Redis at %s refused %s for user %r: %s (check the password, "
                "the user's ACL rights on umbp:* keys and commands; see docs/operations.md)",
                s.redacted_url,
                command,
                s.username or "default",
                message,
            )

    def clear(self) -> None:
        """A login succeeded: after a refused login, the next refusal opens a new window.

        (A refused command is not cured by a login: its window runs its course.)
        """
        if self._login_refused:
            self._login_refused = False
            self._logged_at = None


def refused_command(message: str, default: str) -> str:
    """The command a NOPERM message names (``... run the 'expire' command``), else default."""
    parts = message.split("'")
    if "command" in message and len(parts) >= 3:
        return parts[1].upper()
    return default


class RedisConnection:
    """One connected, authenticated socket with a RESP reader.

    With ``deadline`` (monotonic seconds) connect, TLS and the handshake all finish by
    then; otherwise they are bounded by ``connect_timeout_s`` and ``op_timeout_s``.
    Name resolution is not bounded by a socket timeout: latency-critical callers take
    connections made off their thread (``WarmConnection``).
    """

    def __init__(
        self,
        settings: RedisSettings,
        *,
        deadline: float | None = None,
        alarm: AuthAlarm | None = None,
    ) -> None:
        self.settings = settings
        self.alarm = alarm
        self.sock = self._connect(deadline)
        self.reader = ReplyReader(self.sock)
        self.use_sendmsg = not settings.tls
        self.closed = False
        try:
            hs_deadline = time.monotonic() + settings.op_timeout_s
            self.reader.deadline = hs_deadline if deadline is None else min(deadline, hs_deadline)
            self._handshake()
        except BaseException:
            self.close()
            raise
        finally:
            self.reader.deadline = None

    def _connect(self, deadline: float | None) -> socket.socket:
        s = self.settings
        timeout = s.connect_timeout_s
        try:
            if deadline is not None:
                timeout = min(timeout, remaining(deadline))
            if s.scheme == "unix":
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(timeout)
                try:
                    sock.connect(s.path or "")
                except BaseException:
                    sock.close()
                    raise
            else:
                sock = socket.create_connection((s.host, s.port), timeout=timeout)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if s.tls:
                ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=s.tls_ca_cert)
                ctx.check_hostname = s.tls_check_hostname
                if s.tls_cert:
                    ctx.load_cert_chain(s.tls_cert, s.tls_key)
                if deadline is not None:
                    sock.settimeout(min(timeout, remaining(deadline)))
                sock = ctx.wrap_socket(sock, server_hostname=s.host)
        except (TimeoutError, RedisTimeoutError):
            raise RedisTimeoutError(
                f"connecting to {s.redacted_url} timed out after {timeout:.3g}s"
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
        cmds: list[tuple[str, bytes]] = []
        if s.username:  # as redis-py: a user without a password logs in with ""
            cmds.append(("AUTH", encode_command("AUTH", s.username, s.password or "")))
        elif s.password is not None:
            cmds.append(("AUTH", encode_command("AUTH", s.password)))
        if s.db:
            cmds.append(("SELECT", encode_command("SELECT", s.db)))
        # Best effort: a least-privilege user or a proxy may refuse it.
        cmds.append(("CLIENT SETNAME", encode_command("CLIENT", "SETNAME", "umbp-redis")))
        send_buffers(
            self.sock,
            [b"".join(c for _, c in cmds)],
            use_sendmsg=False,
            deadline=self.reader.deadline,
        )
        failure: RedisDataPlaneError | None = None
        for name, _ in cmds:
            reply = self.reader.read_reply()
            if not isinstance(reply, ErrorReply) or failure is not None:
                continue
            if name == "CLIENT SETNAME":
                if isinstance(reply.exc, RedisAuthError) and reply.message.startswith("NOAUTH"):
                    failure = self._refused("AUTH", reply.message)
                else:
                    log.debug("CLIENT SETNAME refused (%s); continuing", reply.message)
                continue
            if isinstance(reply.exc, RedisAuthError) or name == "AUTH":
                failure = self._refused(name, reply.message)
            else:
                failure = reply.exc
        if failure is not None:
            raise failure
        if self.alarm is not None:
            self.alarm.clear()

    def _refused(self, command: str, message: str) -> RedisAuthError:
        if self.alarm is not None:
            self.alarm.report(command, message)
        # The server's message never contains the password; ours neither.
        return RedisAuthError(
            f"Redis at {self.settings.redacted_url} refused {command} for user "
            f"{self.settings.username or 'default'!r}: {message}"
        )

    def is_stale(self) -> bool:
        """Whether an idle connection was closed by the server (or holds stray bytes).

        Between exchanges nothing should be readable; anything that is (EOF after a
        server restart, a stray reply) makes the connection unusable.
        """
        if self.closed:
            return True
        try:
            readable, _, _ = select.select([self.sock], [], [], 0)
        except (OSError, ValueError):
            return True
        return bool(readable) or self.reader.end != self.reader.start

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


def is_connection_failure(exc: BaseException) -> bool:
    """Whether ``exc`` says the server is unreachable (opens a fail-fast window).

    Refused, reset or closed connections, refused logins and a loading server are;
    a reply that was merely slow (a timeout on an established connection) is not.
    """
    return isinstance(exc, RedisUnavailableError | RedisAuthError | RedisLoadingError)


class Health:
    """A fail-fast window opened by connection-level failures of one kind of caller."""

    def __init__(self, settings: RedisSettings, what: str) -> None:
        self.settings = settings
        self.what = what
        self.failed_at: float | None = None
        self.failures = 0
        self._lock = threading.Lock()

    def note_failure(self, exc: BaseException) -> None:
        """Open the window after a connection-level failure (logged once per outage)."""
        with self._lock:
            first = self.failed_at is None
            self.failed_at = time.monotonic()
            self.failures += 1
        if first and not isinstance(exc, RedisAuthError):  # the alarm logs those
            log.warning(
                "umbp-redis: Redis at %s failed for %s (%s); they count as misses for %.1fs, "
                "then it is tried again",
                self.settings.redacted_url,
                self.what,
                exc,
                self.settings.fail_fast_s,
            )

    def note_success(self) -> None:
        """Close the window (a connection was made)."""
        if self.failed_at is not None:
            self.failed_at = None
            log.info("umbp-redis: Redis at %s is reachable again", self.settings.redacted_url)

    def check(self) -> None:
        """Raise ``RedisUnavailableError`` inside the window."""
        failed_at = self.failed_at
        if failed_at is not None:
            ago = time.monotonic() - failed_at
            if ago < self.settings.fail_fast_s:
                raise RedisUnavailableError(
                    f"Redis at {self.settings.redacted_url} failed {ago:.2f}s ago; failing fast"
                )

    @property
    def healthy(self) -> bool:
        """False inside the window."""
        try:
            self.check()
            return True
        except RedisUnavailableError:
            return False


@contextmanager
def _lease(conn: RedisConnection, deadline: float | None, health: Health) -> Iterator[None]:
    """One exchange on ``conn``, its reader bound to ``deadline``. On any error ``conn``
    is closed (its stream may hold half a reply), a connection-level failure opens
    ``health``'s fail-fast window, and the error goes on."""
    conn.reader.deadline = deadline
    try:
        yield
    except BaseException as e:
        conn.close()
        if is_connection_failure(e):
            health.note_failure(e)
        raise
    conn.reader.deadline = None


class ConnectionPool:
    """At most ``max_connections`` connections per process; LIFO reuse; fail-fast window."""

    def __init__(self, settings: RedisSettings, alarm: AuthAlarm | None = None) -> None:
        self.settings = settings
        self.alarm = alarm or AuthAlarm(settings)
        self.health = Health(settings, "stores and loads")
        self._idle: list[RedisConnection] = []
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(settings.max_connections)
        self.connects = 0

    @property
    def failures(self) -> int:
        """Connection-level failures seen so far."""
        return self.health.failures

    def note_failure(self, exc: BaseException) -> None:
        """Open the fail-fast window (for failures seen outside ``connection``)."""
        self.health.note_failure(exc)

    @property
    def healthy(self) -> bool:
        """False inside the fail-fast window."""
        return self.health.healthy

    @contextmanager
    def connection(
        self, timeout: float | None = None, *, deadline: float | None = None
    ) -> Iterator[RedisConnection]:
        """A connection for one exchange; it is closed instead of reused after an error.

        ``timeout`` bounds each socket operation (default ``op_timeout_s``); ``deadline``
        (monotonic) bounds the wait for a free slot, connecting and the handshake.
        """
        self.health.check()
        wait = self.settings.op_timeout_s if timeout is None else timeout
        if deadline is not None:
            wait = min(wait, remaining(deadline))
        if not self._slots.acquire(timeout=wait):
            raise RedisTimeoutError(
                f"all {self.settings.max_connections} Redis connections busy for {wait:.3g}s"
            )
        conn: RedisConnection | None = None
        try:
            with self._lock:
                conn = self._idle.pop() if self._idle else None
            if conn is not None and conn.is_stale():
                conn.close()
                conn = None
            if conn is None:
                try:
                    conn = RedisConnection(self.settings, deadline=deadline, alarm=self.alarm)
                except RedisDataPlaneError as e:
                    # A connect that timed out on its own timeout means unreachable; one
                    # cut short by the caller's deadline says nothing about the server.
                    if is_connection_failure(e) or (
                        isinstance(e, RedisTimeoutError) and deadline is None
                    ):
                        self.health.note_failure(e)
                    raise
                self.connects += 1
                self.health.note_success()
            conn.settimeout(self.settings.op_timeout_s if timeout is None else timeout)
            with _lease(conn, deadline, self.health):
                yield conn
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


class WarmConnection:
    """One connection for latency-bound calls, made and re-made on a background thread.

    ``connection(deadline)`` hands out the ready socket or waits for it until the
    deadline, never longer; a broken socket is closed and a new one is started at once
    off the caller's thread. Until that one is ready (``reconnecting``), calls fail at
    once instead of waiting: a server that just failed one call, slow or gone, costs one
    call its deadline, not every call until it answers again. Concurrent callers take
    turns.
    """

    def __init__(self, settings: RedisSettings, alarm: AuthAlarm, what: str = "lookups") -> None:
        self.settings = settings
        self.alarm = alarm
        self.health = Health(settings, what)
        self._cv = threading.Condition()
        self._ready: RedisConnection | None = None
        self._lent = False
        self._connecting = False
        self._closed = False
        self._lost = False  # a lent socket failed and no new one is ready yet
        self.connects = 0

    def start(self) -> None:
        """Begin connecting now (idempotent), so the first call finds a warm socket."""
        with self._cv:
            self._kick()

    def _kick(self) -> None:
        """Start a connect in the background unless one is running or a socket is ready."""
        if self._closed or self._connecting or self._ready is not None or self._lent:
            return
        if not self.health.healthy:
            return
        self._connecting = True
        threading.Thread(target=self._connect, name="umbp-redis-connect", daemon=True).start()

    def _connect(self) -> None:
        conn: RedisConnection | None = None
        try:
            conn = RedisConnection(self.settings, alarm=self.alarm)
        except RedisDataPlaneError as e:
            self.health.note_failure(e)
            log.debug("lookup connection to %s failed: %s", self.settings.redacted_url, e)
        except Exception as e:  # never let the thread die silently
            self.health.note_failure(RedisUnavailableError(repr(e)))
            log.warning("umbp-redis: lookup connection failed unexpectedly: %r", e)
        with self._cv:
            self._connecting = False
            if conn is not None:
                if self._closed:
                    conn.close()
                else:
                    self.connects += 1
                    self.health.note_success()
                    self._ready = conn
                    self._lost = False
            self._cv.notify_all()

    @contextmanager
    def connection(self, deadline: float) -> Iterator[RedisConnection]:
        """The warm socket with its reader bound to ``deadline``; waits until then at most."""
        with self._cv:
            while True:
                self.health.check()
                if self._closed:
                    raise RedisUnavailableError("the data plane is closed")
                if self._ready is not None and not self._lent and self._ready.is_stale():
                    self._ready.close()
                    self._ready = None
                if self._ready is not None and not self._lent:
                    conn = self._ready
                    self._lent = True
                    break
                self._kick()
                if self._lost and not self._lent:
                    raise RedisUnavailableError(
                        f"the connection to {self.settings.redacted_url} is being re-made "
                        "after a failed call"
                    )
                left = deadline - time.monotonic()
                if left <= 0 or not self._cv.wait(left):
                    if time.monotonic() >= deadline:
                        raise RedisTimeoutError(
                            f"no connection to {self.settings.redacted_url} ready in time"
                        )
        ok = False
        try:
            with _lease(conn, deadline, self.health):
                yield conn
            ok = True
        finally:
            with self._cv:
                self._lent = False
                if not ok:  # the lease closed it
                    if self._ready is conn:
                        self._ready = None
                        self._lost = True
                    self._kick()
                self._cv.notify_all()

    @property
    def reconnecting(self) -> bool:
        """Whether a socket failed and its replacement is not ready yet (calls fail at
        once meanwhile)."""
        return self._lost

    def close(self) -> None:
        """Close the socket; later calls fail at once."""
        with self._cv:
            self._closed = True
            conn, self._ready = self._ready, None
            self._cv.notify_all()
        if conn is not None:
            conn.close()
