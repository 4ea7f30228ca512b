"""redis-py clients for the operator tools and the router services: a client of the
server that settings name (a cluster client where it is one), the server's name, and the
payload sizes that stored values' headers state."""

from __future__ import annotations

from typing import Any

from umbp_redis.store.settings import RedisSettings
from umbp_redis.store.value_format import HEADER_FIELD, InvalidValue, decode_header


def redispy_client(
    settings: RedisSettings, *, socket_timeout: float = 10, connect_timeout: float = 2
) -> Any:
    """A redis-py client of the server ``settings`` name: a ``RedisCluster`` where
    ``cluster`` is true, or is ``auto`` and the server says it is a cluster node."""
    import redis

    kw = settings.redispy_kwargs()
    kw["socket_connect_timeout"] = connect_timeout
    r = redis.Redis(**kw, socket_timeout=socket_timeout)
    if settings.scheme == "unix" or settings.cluster == "off":
        return r
    if settings.cluster == "auto":
        try:
            if not int(r.info("cluster").get("cluster_enabled", 0)):
                return r
        except redis.RedisError:  # unreachable or INFO refused: the caller reports it
            return r
    r.close()
    kw.pop("db", None)
    return redis.RedisCluster(**kw, socket_timeout=socket_timeout)


def server_name(info: dict[str, Any]) -> str:
    """The server of an ``INFO server`` reply: "Valkey 8.0.1" where it has
    ``valkey_version`` (Valkey also reports a ``redis_version``, 7.2.4, for clients),
    else "Redis <redis_version>"."""
    if info.get("valkey_version"):
        return f"Valkey {info['valkey_version']}"
    return f"Redis {info.get('redis_version', '?')}"


def stated_payload_len(field_h: Any) -> int | None:
    """The payload length a value's header field states, or None if it is not one."""
    if not isinstance(field_h, bytes):
        return None
    try:
        return decode_header(field_h).payload_len
    except InvalidValue:
        return None


def payload_sizes(r: Any, keys: list[bytes]) -> list[int | None]:
    """The payload bytes of each key's value, from its header field (None: no value of
    this format), in one pipeline."""
    p = r.pipeline(transaction=False)
    for k in keys:
        p.hget(k, HEADER_FIELD)
    return [stated_payload_len(h) for h in p.execute(raise_on_error=False)]
