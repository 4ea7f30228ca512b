"""Start a private, throwaway ``redis-server`` (for the CPU demo and the tests).

The server keeps nothing on disk, listens on 127.0.0.1 on a free port (or a unix
socket), and is stopped when the context exits.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path


class RedisServerNotFound(RuntimeError):
    """No ``redis-server`` binary could be found."""


def find_redis_server() -> str:
    """Path of a ``redis-server`` binary: ``$UMBP_REDIS_SERVER``, then ``PATH``, then the
    usual system locations. Raises ``RedisServerNotFound`` with what to install."""
    candidates = [os.environ.get("UMBP_REDIS_SERVER"), shutil.which("redis-server")]
    candidates += ["/usr/bin/redis-server", "/usr/local/bin/redis-server", "/usr/sbin/redis-server"]
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    raise RedisServerNotFound(
        "redis-server not found: install it (Debian/Ubuntu: apt-get install redis-server) "
        "or set UMBP_REDIS_SERVER to its path"
    )


# Listening ports are drawn from here, below Linux's default ephemeral range (32768 on),
# so that no outgoing connection takes one between the choice and the server's bind.
_LISTEN_PORTS = range(20000, 32768)
_PICK = random.SystemRandom()  # never the seeded global generator: no two processes agree


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, outside the kernel's
    ephemeral range where it can tell (else one the kernel picks)."""
    low = _ephemeral_low()
    ports = range(_LISTEN_PORTS.start, min(_LISTEN_PORTS.stop, low))
    for _ in range(64):
        port = _PICK.choice(ports) if ports else 0
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return int(s.getsockname()[1])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (32768 where it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


class EmbeddedRedis:
    """A private redis-server process; use as a context manager or call start()/stop().

    ``extra_args`` are passed to the server (e.g. ``["--requirepass", "pw"]``).
    ``url`` is ready once ``start()`` returns. Without ``port``, ``choose_port`` finds
    one (and another if it is taken before the first start binds it).
    """

    def __init__(
        self,
        extra_args: Sequence[str] = (),
        *,
        port: int | None = None,
        unix_socket: bool = False,
        binary: str | None = None,
        password: str | None = None,
        tls_files: tuple[str, str, str] | None = None,
        start_timeout: float = 10.0,
        choose_port: Callable[[], int] = free_port,
    ) -> None:
        self.binary = binary or find_redis_server()
        self._choose_port = choose_port  # without ``port``: how a free one is found
        self.port = port or choose_port()
        self._port_chosen_here = port is None  # may move if taken before the first start
        self.extra_args = list(extra_args)
        self.password = password
        self.tls_files = tls_files  # (cert, key, CA) to serve TLS only
        self.start_timeout = start_timeout
        self._dir = Path(tempfile.mkdtemp(prefix="umbp-redis-"))
        self.socket_path = str(self._dir / "redis.sock") if unix_socket else None
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """A ``redis://`` (or ``unix://``) URL for this server, without the password."""
        if self.socket_path:
            return f"unix://{self.socket_path}"
        if self.tls_files:
            return f"rediss://localhost:{self.port}/0"
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def log_path(self) -> Path:
        """The server's log file."""
        return self._dir / "redis.log"

    def start(self) -> EmbeddedRedis:
        """Start the server and wait until it answers PING. On the first start, a port
        this object chose (no ``port`` given) that was taken before the server bound it
        is replaced by another free one, a few times at most; later starts (``restart``)
        keep the port."""
        for attempt in range(5):
            try:
                self._start_once()
                self._port_chosen_here = False  # clients know this port now
                return self
            except RuntimeError as e:
                taken = "Address already in use" in str(e)
                if not (taken and self._port_chosen_here) or attempt == 4:
                    raise
                self.port = self._choose_port()
                for f in self._dir.iterdir():  # what the failed start wrote names its port
                    if f != self.log_path:
                        f.unlink(missing_ok=True)
        raise AssertionError("unreachable")

    def _start_once(self) -> EmbeddedRedis:
        port_args = ["--port", str(self.port)]
        if self.tls_files:
            cert, key, ca = self.tls_files
            port_args = [
                "--port",
                "0",
                "--tls-port",
                str(self.port),
                "--tls-cert-file",
                cert,
                "--tls-key-file",
                key,
                "--tls-ca-cert-file",
                ca,
                "--tls-auth-clients",
                "no",
            ]
        args = [
            self.binary,
            *port_args,
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self._dir),
            "--logfile",
            str(self.log_path),
            "--protected-mode",
            "no",
            "--enable-debug-command",
            "local",
        ]
        if self.socket_path:
            args += ["--unixsocket", self.socket_path, "--unixsocketperm", "700"]
        if self.password:
            args += ["--requirepass", self.password]
        args += self.extra_args
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                log = self.log_path.read_text() if self.log_path.exists() else ""
                raise RuntimeError(f"redis-server exited at start: {err}{log[-2000:]}")
            if self._ping():
                return self
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server did not answer within {self.start_timeout}s")

    def _ping(self) -> bool:
        try:
            if self.socket_path:
                s = socket.socket(socket.AF_UNIX)
                s.settimeout(0.5)
                s.connect(self.socket_path)
            else:
                s = socket.create_connection(("127.0.0.1", self.port), timeout=0.5)
        except OSError:
            return False
        if self.tls_files:
            import ssl

            ctx = ssl.create_default_context(cafile=self.tls_files[2])
            try:
                s = ctx.wrap_socket(s, server_hostname="localhost")
            except (OSError, ssl.SSLError):
                s.close()
                return False
        with s:
            try:
                s.sendall(b"PING\r\n")
                reply = s.recv(64)
            except OSError:
                return False
        return reply.startswith(b"+PONG") or reply.startswith(b"-NOAUTH")

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 5 s)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stderr:
            self.proc.stderr.close()
        self.proc = None

    def kill(self) -> None:
        """Kill the server at once (SIGKILL), as a crash would."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def restart(self) -> EmbeddedRedis:
        """Start again on the same port (after ``stop`` or ``kill``)."""
        self.stop()
        return self.start()

    def cleanup(self) -> None:
        """Stop and remove the server's folder."""
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()
