"""Redis servers behind rate-limited links, for benchmarks and tests of remote Redis.

Each server runs in a network namespace of its own behind a veth pair whose two ends
are rate limited with ``tc`` (token bucket, the same rate each way); the host ends
sit on one bridge. ``slow_link_redis`` is one such server that also listens on a unix
socket, so one process can reach the same data over a slow link (TCP) and a fast one
(the socket). Needs root (``ip netns``); everything made is named after the process id
and removed on exit.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

from umbp_redis.testing.embedded_redis import find_redis_server

PORT = 6379
# ``slow_link_redis`` takes the first /24 under this prefix that no interface of the
# host holds (another run's bridge would otherwise catch its traffic).
SLOW_LINK_PREFIX = "10.214"


class NetworkSetupError(RuntimeError):
    """The namespaces, veth pairs or ``tc`` limits could not be made (not root?)."""


def allow_bridged_traffic(bridge: str, stack: ExitStack) -> None:
    """Let the nodes reach each other across ``bridge`` where bridged frames pass
    iptables (``br_netfilter``) and the FORWARD chain drops by default, as a Docker host
    leaves it: one ACCEPT rule for this bridge alone, removed on exit. Without an
    ``iptables`` tool there is no rule to add (nor one that drops)."""
    if shutil.which("iptables") is None:
        return
    try:
        with open("/proc/sys/net/bridge/bridge-nf-call-iptables") as f:
            if f.read().strip() != "1":
                return
    except OSError:
        return  # no br_netfilter: bridged frames never meet iptables
    rule = ["FORWARD", "-i", bridge, "-o", bridge, "-j", "ACCEPT"]
    if subprocess.run(["iptables", "-I", *rule], capture_output=True).returncode == 0:
        stack.callback(lambda: subprocess.run(["iptables", "-D", *rule], capture_output=True))


def add_bridge(bridge: str, subnet: str, stack: ExitStack) -> None:
    """A bridge named ``bridge`` holding ``<subnet>.1/24`` for the host, up, deleted when
    ``stack`` closes; bridged traffic let through (``allow_bridged_traffic``)."""
    ip_command("link", "add", bridge, "type", "bridge")
    stack.callback(lambda: subprocess.run(["ip", "link", "del", bridge], capture_output=True))
    ip_command("addr", "add", f"{subnet}.1/24", "dev", bridge)
    ip_command("link", "set", bridge, "up")
    allow_bridged_traffic(bridge, stack)


def ip_command(*args: str) -> None:
    """Run ``ip ARGS``; ``NetworkSetupError`` with its message when it fails."""
    try:
        proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    except FileNotFoundError as e:
        raise NetworkSetupError("the ip tool (iproute2) is not installed") from e
    if proc.returncode != 0:
        raise NetworkSetupError(f"ip {' '.join(args)}: {proc.stderr.strip()}")


def _tc(ns: str | None, dev: str, rate_mbit: float) -> None:
    prefix = ["ip", "netns", "exec", ns] if ns else []
    burst_kb = max(64, int(rate_mbit * 1000 // 8 // 1000))  # ~1 ms at the rate
    cmd = [
        *prefix,
        "tc",
        "qdisc",
        "add",
        "dev",
        dev,
        "root",
        "tbf",
        "rate",
        f"{int(rate_mbit * 1000)}kbit",
        "burst",
        f"{burst_kb}kb",
        "latency",
        "50ms",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise NetworkSetupError(f"{' '.join(cmd)}: {proc.stderr.strip()}")


class SlowLinkNode:
    """One redis-server in its own namespace, reachable at ``<subnet>.<index+2>``."""

    def __init__(
        self,
        tag: str,
        index: int,
        bridge: str,
        rate_mbit: float,
        args: list[str],
        *,
        subnet: str,
    ) -> None:
        self.ns = f"{tag}n{index}"
        self.host_dev, self.ns_dev = f"{tag}h{index}", f"{tag}v{index}"
        self.ip = f"{subnet}.{index + 2}"
        self.port = PORT
        self.dir = f"/tmp/{self.ns}"
        self.bridge, self.rate, self.args = bridge, rate_mbit, args
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> SlowLinkNode:
        """Make the namespace and link, start the server, wait until it answers."""
        ip_command("netns", "add", self.ns)
        ip_command("link", "add", self.host_dev, "type", "veth", "peer", "name", self.ns_dev)
        ip_command("link", "set", self.ns_dev, "netns", self.ns)
        ip_command("link", "set", self.host_dev, "master", self.bridge)
        ip_command("link", "set", self.host_dev, "up")
        ip_command("-n", self.ns, "addr", "add", f"{self.ip}/24", "dev", self.ns_dev)
        ip_command("-n", self.ns, "link", "set", self.ns_dev, "up")
        ip_command("-n", self.ns, "link", "set", "lo", "up")
        _tc(None, self.host_dev, self.rate)  # host -> node
        _tc(self.ns, self.ns_dev, self.rate)  # node -> host
        os.makedirs(self.dir, exist_ok=True)
        cmd = [
            "ip",
            "netns",
            "exec",
            self.ns,
            find_redis_server(),
            "--bind",
            self.ip,
            "--port",
            str(self.port),
            "--save",
            "",
            "--appendonly",
            "no",
            "--protected-mode",
            "no",
            "--dir",
            self.dir,
            "--logfile",
            f"{self.dir}/redis.log",
            *self.args,
        ]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection((self.ip, self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                time.sleep(0.05)
        raise NetworkSetupError(f"redis-server in {self.ns} did not answer at {self.ip}")

    def stop(self) -> None:
        """Stop the server; remove the namespace (and with it the link) and its folder."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True)
        subprocess.run(["ip", "link", "del", self.host_dev], capture_output=True)
        shutil.rmtree(self.dir, ignore_errors=True)


@dataclass(frozen=True)
class SlowLinkRedis:
    """One server's two ways in: ``slow_url`` over the rate-limited link, ``fast_url``
    over a unix socket (no network at all)."""

    slow_url: str
    fast_url: str
    rate_mbit: float


def free_subnet(prefix: str = SLOW_LINK_PREFIX) -> str:
    """The first ``<prefix>.N`` (a /24) that no address of this host is in."""
    out = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True).stdout
    for n in range(256):
        subnet = f"{prefix}.{n}"
        if f" {subnet}." not in out:
            return subnet
    raise NetworkSetupError(f"every {prefix}.N/24 is taken on this host")


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


@contextmanager
def slow_link_redis(rate_mbit: float, args: tuple[str, ...] = ()) -> Iterator[SlowLinkRedis]:
    """A redis-server behind a ``rate_mbit`` link (each way), also on a unix socket;
    removed on exit. ``NetworkSetupError`` where namespaces cannot be made."""
    if os.geteuid() != 0:
        raise NetworkSetupError("a server behind a slow link needs root (network namespaces)")
    tag = f"us{os.getpid() % 100000}"
    bridge = f"{tag}br"
    sock = f"/tmp/{tag}n0/redis.sock"
    with ExitStack() as stack:
        if threading.current_thread() is threading.main_thread():
            # A terminated run still removes its namespace, link and server.
            previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
            stack.callback(signal.signal, signal.SIGTERM, previous)
        subnet = free_subnet()
        add_bridge(bridge, subnet, stack)
        node = SlowLinkNode(
            tag,
            0,
            bridge,
            rate_mbit,
            ["--unixsocket", sock, "--unixsocketperm", "777", *args],
            subnet=subnet,
        )
        stack.callback(node.stop)
        node.start()
        yield SlowLinkRedis(f"redis://{node.ip}:{node.port}/0", f"unix://{sock}", rate_mbit)
