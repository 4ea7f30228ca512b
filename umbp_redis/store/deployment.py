"""Which data plane a process uses: one standalone server or a Redis Cluster.

``open_plane`` follows the ``cluster`` option: ``false`` talks to the server of
``redis_url``, ``true`` to the cluster it belongs to, ``auto`` asks the server
(``INFO cluster``) at startup, within ``connect_timeout_s`` + ``op_timeout_s``. When
the server cannot be asked then, a ``PendingPlane`` answers misses and drops stores
while it keeps asking in the background. ``shared_plane`` keeps one plane (and one set
of connection pools) per process and settings.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any, Protocol, Unpack

from umbp_redis.store.cluster import ClusterDataPlane, read_slot_map
from umbp_redis.store.commands import LookupEncoder, RequestCountEncoder, ttl_argument
from umbp_redis.store.connection import AuthAlarm, RedisConnection
from umbp_redis.store.errors import ConfigError, RedisAuthError, RedisDataPlaneError
from umbp_redis.store.plane import (
    KeyedBuffers,
    LoadOptions,
    LoadStatus,
    RedisDataPlane,
    StoreOptions,
    StoreStatus,
)
from umbp_redis.store.resp import ErrorReply, encode_command, send_buffers
from umbp_redis.store.settings import RedisSettings
from umbp_redis.store.slots import SlotMap

log = logging.getLogger(__name__)


class DataPlane(Protocol):
    """What the scheduler and the workers use of a data plane (standalone or cluster)."""

    @property
    def lookup_mode(self) -> str:
        """``standalone``, ``cluster`` or ``pending``: which encoder ``lookup_encoder`` makes."""
        ...

    def lookup_encoder(
        self, prefixes: Sequence[bytes], *, refresh_ttl: bool, hash_hex_len: int
    ) -> Any:
        """An encoder of one block's lookup commands (``.encode(hash_hex)``, ``.replies``)."""
        ...

    def request_count_encoder(self, prefix: bytes, *, hash_hex_len: int) -> Any:
        """An encoder of one block's request count (``.encode(hash_hex)``, 2 replies:
        the count, then 1), whose blocks go to ``lookup_blocks`` after the lookup's."""
        ...

    def lookup_blocks(
        self, blocks: Sequence[Any], count: int, *, counted_from: int | None = None
    ) -> list[int] | None:
        """Replies to encoded blocks, in order (request counts from reply
        ``counted_from`` on, errors there reading 0); None when unknown."""
        ...

    def store(
        self, items: KeyedBuffers, fingerprint: bytes, **options: Unpack[StoreOptions]
    ) -> list[StoreStatus]:
        """Per-key store outcome, in order (the options: ``RedisDataPlane.store``)."""
        ...

    def load(
        self, items: KeyedBuffers, fingerprint: bytes, **options: Unpack[LoadOptions]
    ) -> list[LoadStatus]:
        """Per-key load outcome, in order (the options: ``RedisDataPlane.load``)."""
        ...

    def delete(self, keys: Sequence[str | bytes], *, deadline: float | None = None) -> int:
        """UNLINK keys; the number removed (those removed by ``deadline``, monotonic
        seconds, when given)."""
        ...

    def run_keyed(
        self, commands: Sequence[tuple[bytes, bytes]], *, timeout: float
    ) -> list[int] | None:
        """Replies to pre-encoded one-key commands (key, command), in order (``+OK`` reads
        1, an error or a failed node -1); None when unknown. Ends within ``timeout``."""
        ...

    def query_keyed(self, key: bytes, command: bytes, *, timeout: float) -> Any:
        """The reply of one pre-encoded one-key command (bytes, int, str, None or a list
        of them); None also when it failed or did not end within ``timeout`` (counted)."""
        ...

    def counters(self) -> dict[str, int]:
        """Counters since the plane was made."""
        ...

    def node_counters(self) -> dict[str, int]:
        """Failed calls per Redis Cluster master ("host:port"), since the plane was made;
        empty for one server."""
        ...

    def warm_up(self) -> None:
        """Start connecting now, off the caller's thread."""
        ...

    def close(self) -> None:
        """Stop threads and close connections."""
        ...


class ClusterProbe:
    """What ``INFO cluster`` said: ``enabled`` (None when it could not be asked) and, on a
    cluster, the slot map read from the same node."""

    def __init__(self, enabled: bool | None, slot_map: SlotMap | None, error: str = "") -> None:
        self.enabled = enabled
        self.slot_map = slot_map
        self.error = error


def probe_cluster(settings: RedisSettings, alarm: AuthAlarm | None = None) -> ClusterProbe:
    """Ask the server of ``settings`` whether it is a cluster node (never raises; a
    refused login is reported to ``alarm``, which logs it at ERROR)."""
    if settings.scheme == "unix":
        return ClusterProbe(False, None)
    try:
        conn = RedisConnection(
            settings.for_node(settings.host, settings.port),
            alarm=alarm or AuthAlarm(settings),
        )
    except RedisAuthError as e:
        return ClusterProbe(None, None, f"login refused: {e}")
    except RedisDataPlaneError as e:
        return ClusterProbe(None, None, str(e))
    try:
        conn.reader.deadline = time.monotonic() + settings.op_timeout_s
        send_buffers(conn.sock, [encode_command("INFO", "cluster")], use_sendmsg=False)
        reply = conn.reader.read_reply()
        if isinstance(reply, ErrorReply):
            return ClusterProbe(False, None, f"INFO refused: {reply.message}")
        text = reply.decode(errors="replace") if isinstance(reply, bytes) else str(reply)
        if "cluster_enabled:1" not in text:
            return ClusterProbe(False, None)
        try:
            return ClusterProbe(True, read_slot_map(conn, settings.host))
        except (RedisDataPlaneError, ValueError, TypeError, IndexError) as e:
            return ClusterProbe(True, None, f"cannot read the slot map: {e}")
    except RedisDataPlaneError as e:
        return ClusterProbe(None, None, str(e))
    finally:
        conn.close()


def _cluster_plane(settings: RedisSettings, slot_map: SlotMap | None) -> ClusterDataPlane:
    if settings.db != 0:
        raise ConfigError(
            f"kv_connector_extra_config['redis_url'] selects database {settings.db}, but "
            f"{settings.redacted_url} is a Redis Cluster node and a cluster has only "
            "database 0: use .../0"
        )
    return ClusterDataPlane(settings, slot_map)


def open_plane(settings: RedisSettings) -> DataPlane:
    """The data plane for ``settings``: standalone, cluster, or pending when ``cluster``
    is ``auto`` and the server cannot be asked now. Raises ``ConfigError`` for a
    database other than 0 on a cluster."""
    if settings.cluster == "off":
        return RedisDataPlane(settings)
    if settings.cluster == "on":
        return _cluster_plane(settings, None)
    probe = probe_cluster(settings)
    if probe.enabled is None:
        log.warning(
            "umbp-redis: cannot ask %s whether it is a Redis Cluster node (%s); lookups miss "
            "and stores are dropped until it answers. Set the option cluster to true or "
            "false to skip this check",
            settings.redacted_url,
            probe.error,
        )
        return PendingPlane(settings)
    if probe.error and not probe.enabled:
        log.warning(
            "umbp-redis: %s (%s); using it as a standalone server. Set the option cluster "
            "to true if it is a cluster node",
            settings.redacted_url,
            probe.error,
        )
    if probe.enabled:
        log.info("umbp-redis: %s is a Redis Cluster node", settings.redacted_url)
        return _cluster_plane(settings, probe.slot_map)
    return RedisDataPlane(settings)


class PendingPlane:
    """A plane for ``cluster: auto`` whose server could not be asked yet.

    It asks again in the background (at most every ``fail_fast_s``, at least every
    second), then hands every call to the plane that fits. Until then lookups are
    unknown (misses), stores and loads fail (counted by the caller), nothing waits.
    """

    def __init__(self, settings: RedisSettings) -> None:
        self.settings = settings
        self._inner: DataPlane | None = None
        self._closed = False
        self._lock = threading.Lock()
        self._asking = False
        self._alarm = AuthAlarm(settings)
        self._ask()

    @property
    def inner(self) -> DataPlane | None:
        """The plane in use once the server answered."""
        return self._inner

    @property
    def lookup_mode(self) -> str:
        """The inner plane's, or ``pending``."""
        return self._inner.lookup_mode if self._inner is not None else "pending"

    def _ask(self) -> None:
        with self._lock:
            if self._asking or self._inner is not None or self._closed:
                return
            self._asking = True
        threading.Thread(target=self._run, name="umbp-redis-probe", daemon=True).start()

    def _run(self) -> None:
        gap = min(1.0, max(0.1, self.settings.fail_fast_s))
        while not self._closed:
            probe = probe_cluster(self.settings, self._alarm)
            if probe.enabled is not None:
                try:
                    inner: DataPlane = (
                        _cluster_plane(self.settings, probe.slot_map)
                        if probe.enabled
                        else RedisDataPlane(self.settings)
                    )
                except ConfigError as e:
                    log.error("umbp-redis: %s; the connector stays disabled", e)
                    break
                log.info(
                    "umbp-redis: %s answered: %s",
                    self.settings.redacted_url,
                    "a Redis Cluster node" if probe.enabled else "a standalone server",
                )
                with self._lock:
                    if self._closed:
                        inner.close()
                    else:
                        self._inner = inner
                break
            time.sleep(gap)
        with self._lock:
            self._asking = False

    def lookup_encoder(
        self, prefixes: Sequence[bytes], *, refresh_ttl: bool, hash_hex_len: int
    ) -> Any:
        """The inner plane's encoder (a standalone one while pending: its blocks miss)."""
        inner = self._inner
        if inner is not None:
            return inner.lookup_encoder(
                prefixes, refresh_ttl=refresh_ttl, hash_hex_len=hash_hex_len
            )
        return LookupEncoder(
            prefixes,
            refresh_ttl=refresh_ttl,
            ttl=ttl_argument(self.settings.ttl_seconds),
            hash_hex_len=hash_hex_len,
        )

    def request_count_encoder(self, prefix: bytes, *, hash_hex_len: int) -> Any:
        """The inner plane's encoder (a standalone one while pending)."""
        inner = self._inner
        if inner is not None:
            return inner.request_count_encoder(prefix, hash_hex_len=hash_hex_len)
        ttl = ttl_argument(self.settings.ttl_seconds)
        return RequestCountEncoder(prefix, ttl=ttl, hash_hex_len=hash_hex_len)

    def lookup_blocks(
        self, blocks: Sequence[Any], count: int, *, counted_from: int | None = None
    ) -> list[int] | None:
        """The inner plane's answer; None while pending or for blocks encoded before."""
        inner = self._inner
        if inner is None or (
            blocks and isinstance(blocks[0], bytes) != (inner.lookup_mode == "standalone")
        ):
            return None
        return inner.lookup_blocks(blocks, count, counted_from=counted_from)

    def store(
        self, items: KeyedBuffers, fingerprint: bytes, **options: Unpack[StoreOptions]
    ) -> list[StoreStatus]:
        """The inner plane's stores; all ``ERROR`` while pending."""
        inner = self._inner
        if inner is None:
            return [StoreStatus.ERROR] * len(items)
        return inner.store(items, fingerprint, **options)

    def load(
        self, items: KeyedBuffers, fingerprint: bytes, **options: Unpack[LoadOptions]
    ) -> list[LoadStatus]:
        """The inner plane's loads; all ``ERROR`` while pending."""
        inner = self._inner
        if inner is None:
            return [LoadStatus.ERROR] * len(items)
        return inner.load(items, fingerprint, **options)

    def delete(self, keys: Sequence[str | bytes], *, deadline: float | None = None) -> int:
        """The inner plane's delete; 0 while pending."""
        inner = self._inner
        return 0 if inner is None else inner.delete(keys, deadline=deadline)

    def run_keyed(
        self, commands: Sequence[tuple[bytes, bytes]], *, timeout: float
    ) -> list[int] | None:
        """The inner plane's replies; None while pending."""
        inner = self._inner
        return None if inner is None else inner.run_keyed(commands, timeout=timeout)

    def query_keyed(self, key: bytes, command: bytes, *, timeout: float) -> Any:
        """The inner plane's reply; None while pending."""
        inner = self._inner
        return None if inner is None else inner.query_keyed(key, command, timeout=timeout)

    def counters(self) -> dict[str, int]:
        """The inner plane's counters; none while pending."""
        inner = self._inner
        return {} if inner is None else inner.counters()

    def node_counters(self) -> dict[str, int]:
        """The inner plane's per-master counters; none while pending."""
        inner = self._inner
        return {} if inner is None else inner.node_counters()

    def warm_up(self) -> None:
        """The inner plane's warm-up."""
        inner = self._inner
        if inner is not None:
            inner.warm_up()

    def close(self) -> None:
        """Stop asking; close the inner plane."""
        with self._lock:
            self._closed = True
            inner = self._inner
        if inner is not None:
            inner.close()


_shared: dict[RedisSettings, DataPlane] = {}
_shared_lock = threading.Lock()


def shared_plane(settings: RedisSettings) -> DataPlane:
    """The process's one data plane (and connection pools) for ``settings``."""
    with _shared_lock:
        plane = _shared.get(settings)
        if plane is None:
            plane = _shared[settings] = open_plane(settings)
        return plane
