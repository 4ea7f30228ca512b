"""Exception types of the Redis data plane.

Every failure talking to Redis is a ``RedisDataPlaneError``; callers on the engine's
path catch that one type and turn it into a cache miss (loads, lookups) or a dropped
store. ``ConfigError`` is raised at startup for a bad ``kv_connector_extra_config``.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration option is unknown, of the wrong type or out of range."""


class RedisDataPlaneError(Exception):
    """Base of every error raised while talking to Redis."""


class RedisUnavailableError(RedisDataPlaneError):
    """The server cannot be reached (refused, reset, closed) or is in its fail-fast window."""


class RedisTimeoutError(RedisDataPlaneError):
    """An operation did not finish within its timeout."""


class RedisLoadingError(RedisDataPlaneError):
    """The server answered ``LOADING``: it is loading its dataset and serves nothing yet."""


class RedisOOMError(RedisDataPlaneError):
    """The server refused a write: ``OOM command not allowed`` (maxmemory reached)."""


class RedisAuthError(RedisDataPlaneError):
    """Authentication failed or is required (``NOAUTH``, ``WRONGPASS``, ``NOPERM``)."""


class RedisProtocolError(RedisDataPlaneError):
    """The server sent a reply this client cannot parse."""


class RedisCommandError(RedisDataPlaneError):
    """The server answered a command with an error reply (other than the above)."""


class RedisRedirectError(RedisDataPlaneError):
    """A cluster node answered ``MOVED`` or ``ASK``: the key's slot is served elsewhere.

    ``kind`` is ``"MOVED"`` (the slot moved for good: refresh the slot map) or ``"ASK"``
    (the slot is migrating: ask ``host:port`` once, after ``ASKING``).
    """

    def __init__(self, message: str, kind: str, slot: int, host: str, port: int) -> None:
        super().__init__(message)
        self.kind = kind
        self.slot = slot
        self.host = host
        self.port = port


def _redirect(message: str) -> RedisRedirectError | None:
    """``MOVED 3999 10.0.0.1:6381`` (or ``ASK``...) parsed; None when malformed."""
    parts = message.split(" ")
    if len(parts) != 3:
        return None
    host, sep, port = parts[2].rpartition(":")
    if not sep or not parts[1].isdigit() or not port.isdigit():
        return None
    return RedisRedirectError(message, parts[0], int(parts[1]), host.strip("[]"), int(port))


def classify_error_reply(message: str) -> RedisDataPlaneError:
    """The exception type for a RESP error reply, by its leading code."""
    code = message.split(" ", 1)[0]
    if code in ("MOVED", "ASK"):
        redirect = _redirect(message)
        if redirect is not None:
            return redirect
    if code == "LOADING":
        return RedisLoadingError(message)
    if code == "OOM":
        return RedisOOMError(message)
    if code in ("NOAUTH", "WRONGPASS", "NOPERM"):
        return RedisAuthError(message)
    if code in ("MASTERDOWN", "BUSY", "TRYAGAIN", "CLUSTERDOWN"):
        return RedisUnavailableError(message)
    return RedisCommandError(message)
