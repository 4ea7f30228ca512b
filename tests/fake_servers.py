"""Servers that misbehave on purpose: loopback TCP servers that speak just enough RESP,
and a real redis-server frozen for as long as a test needs it to stop answering."""

from __future__ import annotations

import os
import signal
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from waiting import wait_until

from umbp_redis.testing.embedded_redis import EmbeddedRedis

Reply = Callable[[bytes], bytes | None]

# How long ``FakeServer.close`` waits for its threads to end (they end once their
# sockets are shut down: a thread still running after this is a bug of the fake).
CLOSE_JOIN_S = 10.0


class FakeServer:
    """Accepts clients on a free loopback port; ``reply(data)`` answers each buffer read
    (None: no answer). Without ``reply`` it reads and never answers."""

    def __init__(self, reply: Reply | None = None, *, answer_handshake: bool = True) -> None:
        self.reply = reply
        self.answer_handshake = answer_handshake
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.clients: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False
        self._threads = [threading.Thread(target=self._serve, daemon=True)]
        self._threads[0].start()

    def _serve(self) -> None:
        # Ends when ``close`` shuts the listening socket down (accept then fails).
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            with self._lock:
                if self._closed:  # accepted as close ran: never served
                    c.close()
                    return
                self.clients.append(c)
                t = threading.Thread(target=self._client, args=(c,), daemon=True)
                self._threads.append(t)
            t.start()

    def _client(self, c: socket.socket) -> None:
        # Ends at the client's EOF, or when ``close`` shuts its socket down.
        with c:
            while True:
                try:
                    data = c.recv(1 << 20)
                except OSError:
                    return
                if not data:
                    return
                if self.reply is None:
                    continue
                if self.answer_handshake and data.startswith(b"*3\r\n$6\r\nCLIENT"):
                    out: bytes | None = b"+OK\r\n"
                else:
                    out = self.reply(data)
                if out is not None:
                    try:
                        c.sendall(out)
                    except OSError:
                        return

    def close(self) -> None:
        """Stop serving: wake the accepting thread and every client's (a plain close
        would leave them blocked in ``accept``/``recv``), and wait for them to end."""
        with self._lock:
            self._closed = True
            socks = [self.sock, *self.clients]
            threads = list(self._threads)
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # not connected, or already closed by the client
            s.close()
        for t in threads:
            t.join(CLOSE_JOIN_S)
            assert not t.is_alive(), f"a FakeServer thread outlived close by {CLOSE_JOIN_S} s"


def loading_server() -> FakeServer:
    """Answers every command with ``-LOADING`` (as Redis does at startup)."""
    return FakeServer(
        lambda data: (
            b"-LOADING Redis is loading the dataset in memory\r\n" * max(1, data.count(b"*"))
        ),
        answer_handshake=False,
    )


# The longest a ``FrozenServer`` stays frozen: far beyond any timeout a test under it
# relies on, far below the option it proves unused (tests set those to an hour).
FREEZE_LIMIT_S = 30.0


def _process_state(pid: int) -> str:
    """The state letter of process ``pid`` (``T``: stopped by a signal)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2]  # the command name in parentheses may hold spaces


class FrozenServer:
    """A real redis-server (``EmbeddedRedis``) that stops answering for as long as a
    test needs: ``freeze`` stops its process (SIGSTOP), ``thaw`` lets it go on
    (SIGCONT). Clients still connect (the kernel completes TCP handshakes into the listen
    queue) but nothing is answered until the thaw: unlike ``DEBUG SLEEP`` or ``CLIENT
    PAUSE`` (whose ``UNPAUSE`` waits out the pause too), no stall of a fixed length that
    a slow test might outlive, and no wait for one to end.

    A call that returns with the server ``still_frozen`` was bounded by its own timeout
    or deadline, never by the server: with the options it must not depend on set far
    longer than ``limit_s``, that proves which bound ended it without timing it. A
    watchdog thaws the server after ``limit_s``, so that a call the freeze holds up
    (a timeout not applied) fails the test (``still_frozen`` is then False) instead of
    hanging it. As a context manager: frozen inside the block, thawed at its end."""

    def __init__(self, server: EmbeddedRedis, limit_s: float = FREEZE_LIMIT_S) -> None:
        assert server.proc is not None, "the server is not running"
        self.pid = server.proc.pid
        self.limit_s = limit_s
        self.expired = False  # the watchdog thawed it
        self._lock = threading.Lock()
        self._frozen = False
        self._watchdog: threading.Timer | None = None

    def freeze(self) -> None:
        """Stop the server; returns once its process is stopped."""
        with self._lock:
            assert not self._frozen, "already frozen"
            self._frozen = True
            self.expired = False
            os.kill(self.pid, signal.SIGSTOP)
            self._watchdog = threading.Timer(self.limit_s, self._expire)
            self._watchdog.daemon = True
            self._watchdog.start()
        wait_until(
            lambda: _process_state(self.pid) == "T",
            10.0,
            what=lambda: f"redis-server {self.pid} to stop (state {_process_state(self.pid)})",
        )

    def _expire(self) -> None:
        with self._lock:
            if self._frozen:
                self.expired = True
                self._thaw_locked()

    def thaw(self) -> None:
        """Let the server go on (idempotent)."""
        with self._lock:
            self._thaw_locked()

    def _thaw_locked(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        if self._frozen:
            self._frozen = False
            os.kill(self.pid, signal.SIGCONT)

    @property
    def still_frozen(self) -> bool:
        """Whether the server is frozen now (never thawed since ``freeze``, neither by
        the test nor by the watchdog): it has answered nothing since."""
        with self._lock:
            return self._frozen and _process_state(self.pid) == "T"

    def __enter__(self) -> FrozenServer:
        self.freeze()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.thaw()
