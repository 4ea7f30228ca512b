"""Loopback TCP servers that speak just enough RESP to misbehave on purpose."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable

Reply = Callable[[bytes], bytes | None]


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
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.clients.append(c)
            threading.Thread(target=self._client, args=(c,), daemon=True).start()

    def _client(self, c: socket.socket) -> None:
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
                    c.sendall(b"+OK\r\n")
                    continue
                out = self.reply(data)
                if out is not None:
                    c.sendall(out)

    def close(self) -> None:
        self.sock.close()
        for c in self.clients:
            try:
                c.close()
            except OSError:
                pass


def loading_server() -> FakeServer:
    """Answers every command with ``-LOADING`` (as Redis does at startup)."""
    return FakeServer(
        lambda data: (
            b"-LOADING Redis is loading the dataset in memory\r\n" * max(1, data.count(b"*"))
        ),
        answer_handshake=False,
    )
