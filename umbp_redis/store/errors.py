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


def classify_error_reply(message: str) -> RedisDataPlaneError:
    """The exception type for a RESP error reply, by its leading code."""
    code = message.split(" ", 1)[0]
    if code == "LOADING":
        return RedisLoadingError(message)
    if code == "OOM":
        return RedisOOMError(message)
    if code in ("NOAUTH", "WRONGPASS", "NOPERM"):
        return RedisAuthError(message)
    if code in ("MASTERDOWN", "BUSY", "TRYAGAIN", "CLUSTERDOWN"):
        return RedisUnavailableError(message)
    return RedisCommandError(message)
