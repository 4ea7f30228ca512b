"""Start a private, throwaway Redis Cluster (for the tests and ``bench cluster``).

``EmbeddedCluster(masters=3, replicas_per_master=1)`` starts the nodes from the same
``redis-server`` binary as ``EmbeddedRedis`` (nothing on disk, loopback, free ports with
a free bus port at +10000, both below the kernel's ephemeral range; a node whose port
was taken before it started moves to another pair), assigns the 16384 slots evenly,
makes the replicas and waits until every node reports ``cluster_state:ok``. No
``redis-cli`` is needed.
"""

from __future__ import annotations

import random
import socket
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import redis

from umbp_redis.testing.embedded_redis import EmbeddedRedis

SLOTS = 16384


def _port_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _node_port_range() -> tuple[int, int]:
    """Ports ``p`` for which ``p`` and its bus port ``p + 10000`` both lie below the
    kernel's ephemeral range: outgoing connections take their local ports from that
    range, so a port there that was free a moment ago can be taken before the node
    binds it. 20000-55000 where the range is unknown or leaves too little room below."""
    try:
        text = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text()
        first_ephemeral = int(text.split()[0])
    except (OSError, ValueError, IndexError):
        return 20000, 55000
    top = first_ephemeral - 1 - 10000
    bottom = max(1024, top - 12000)
    return (bottom, top) if top - bottom >= 1000 else (20000, 55000)


def free_cluster_port(taken: set[int], host: str = "127.0.0.1") -> int:
    """A port whose cluster bus port (+10000) is free too (see ``_node_port_range``)."""
    bottom, top = _node_port_range()
    for _ in range(1000):
        port = random.randint(bottom, top)
        if port in taken or port + 10000 in taken:
            continue
        if _port_free(port, host) and _port_free(port + 10000, host):
            taken.update((port, port + 10000))
            return port
    raise RuntimeError("no free port pair for a cluster node")


def cluster_node_args(node_timeout_ms: int, full_coverage: bool) -> list[str]:
    """redis-server arguments of a cluster node (its config file lives in its folder)."""
    return [
        "--cluster-enabled",
        "yes",
        "--cluster-config-file",
        "nodes.conf",
        "--cluster-node-timeout",
        str(node_timeout_ms),
        "--cluster-require-full-coverage",
        "yes" if full_coverage else "no",
        "--cluster-replica-validity-factor",
        "0",
        "--maxmemory-policy",
        "allkeys-lru",
    ]


def slot_ranges(masters: int) -> list[tuple[int, int]]:
    """The 16384 slots split into ``masters`` even, consecutive ranges."""
    step = SLOTS // masters
    return [
        (i * step, SLOTS - 1 if i == masters - 1 else (i + 1) * step - 1) for i in range(masters)
    ]


def _replicate(client: redis.Redis, master_id: str) -> Callable[[], bool]:
    def attempt() -> bool:
        client.execute_command("CLUSTER", "REPLICATE", master_id)
        return True

    return attempt


def _wait(what: str, check: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except redis.RedisError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"cluster set-up: {what} not reached within {timeout}s")


def form_cluster(
    masters: Sequence[tuple[str, int]],
    replicas: Sequence[tuple[str, int]],
    *,
    timeout: float = 30.0,
) -> None:
    """Join running cluster-enabled nodes into one cluster: slots split evenly over
    ``masters``, ``replicas[i]`` replicating ``masters[i % len(masters)]``."""
    nodes = [*masters, *replicas]
    clients = [redis.Redis(host=h, port=p, socket_timeout=5) for h, p in nodes]
    try:
        for c, (lo, hi) in zip(clients, slot_ranges(len(masters)), strict=False):
            c.execute_command("CLUSTER", "ADDSLOTSRANGE", lo, hi)
        first_host, first_port = nodes[0]
        for c in clients[1:]:
            c.execute_command("CLUSTER", "MEET", first_host, first_port)

        def all_known() -> bool:
            return all(
                len(c.execute_command("CLUSTER", "NODES").decode().strip().splitlines())
                == len(nodes)
                for c in clients
            )

        _wait("every node knowing every other", all_known, timeout)
        ids = [c.execute_command("CLUSTER", "MYID").decode() for c in clients[: len(masters)]]
        for i, c in enumerate(clients[len(masters) :]):
            _wait("a replica accepting its master", _replicate(c, ids[i % len(masters)]), timeout)

        def healthy() -> bool:
            for c in clients:
                info = c.execute_command("CLUSTER", "INFO").decode()
                if "cluster_state:ok" not in info:
                    return False
            for c in clients[len(masters) :]:
                if c.info("replication").get("master_link_status") != "up":
                    return False
            return True

        _wait("cluster_state:ok with replicas in sync", healthy, timeout)
    finally:
        for c in clients:
            c.close()


class EmbeddedCluster:
    """A private Redis Cluster on loopback: ``masters`` masters with
    ``replicas_per_master`` replicas each. Use as a context manager."""

    def __init__(
        self,
        masters: int = 3,
        replicas_per_master: int = 1,
        *,
        node_timeout_ms: int = 1000,
        full_coverage: bool = False,
        extra_args: Sequence[str] = (),
    ) -> None:
        taken: set[int] = set()
        args = [*cluster_node_args(node_timeout_ms, full_coverage), *extra_args]

        def node() -> EmbeddedRedis:
            return EmbeddedRedis(args, choose_port=lambda: free_cluster_port(taken))

        self.masters = [node() for _ in range(masters)]
        self.replicas = [node() for _ in range(masters * replicas_per_master)]

    @property
    def nodes(self) -> list[EmbeddedRedis]:
        """Every node, masters first (as started; roles change on failover)."""
        return [*self.masters, *self.replicas]

    @property
    def url(self) -> str:
        """A URL naming the first node."""
        return self.masters[0].url

    def start(self) -> EmbeddedCluster:
        """Start the nodes and form the cluster."""
        try:
            for n in self.nodes:
                n.start()
            form_cluster(
                [("127.0.0.1", n.port) for n in self.masters],
                [("127.0.0.1", n.port) for n in self.replicas],
            )
        except BaseException:
            self.cleanup()
            raise
        return self

    def client(self, node: EmbeddedRedis) -> redis.Redis:
        """A redis-py client of one node."""
        return redis.Redis(host="127.0.0.1", port=node.port, socket_timeout=5)

    def cluster_client(self) -> redis.RedisCluster:
        """A redis-py cluster client."""
        return redis.RedisCluster(host="127.0.0.1", port=self.masters[0].port)

    def role_of(self, node: EmbeddedRedis) -> str:
        """``master`` or ``slave`` as the node reports itself now."""
        c = self.client(node)
        try:
            return str(c.info("replication")["role"])
        finally:
            c.close()

    def current_masters(self) -> list[EmbeddedRedis]:
        """Live nodes that are masters serving slots now."""
        out = []
        for n in self.nodes:
            if n.proc is None or n.proc.poll() is not None:
                continue
            try:
                if self.role_of(n) == "master":
                    out.append(n)
            except redis.RedisError:
                continue
        return out

    def wait_healthy(self, timeout: float = 30.0) -> None:
        """Wait until every live node reports ``cluster_state:ok``."""

        def ok() -> bool:
            for n in self.nodes:
                if n.proc is None or n.proc.poll() is not None:
                    continue
                c = self.client(n)
                try:
                    if "cluster_state:ok" not in c.execute_command("CLUSTER", "INFO").decode():
                        return False
                finally:
                    c.close()
            return True

        _wait("cluster_state:ok", ok, timeout)

    def cleanup(self) -> None:
        """Stop every node and remove their folders."""
        for n in self.nodes:
            n.cleanup()

    def __enter__(self) -> EmbeddedCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()
