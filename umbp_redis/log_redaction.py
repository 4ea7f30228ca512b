"""Keeps a Redis password given in ``kv_connector_extra_config`` out of vLLM's log.

The connector refuses such a password at startup (``refuse_secrets``), but vLLM logs its
non-default arguments, the KV transfer config included, before any connector exists:
``LLM(...)`` after building its ``EngineArgs``, the OpenAI server after parsing its
arguments. Both load this package's plugin first (``EngineArgs.__post_init__``,
``AsyncEngineArgs.add_cli_args``), and the plugin installs ``ConnectorSecretFilter`` on
the logger of that line, which rewrites the record with each such password masked.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from typing import Any
from urllib.parse import parse_qs, urlsplit

# The logger of vLLM's "non-default args" line (vllm/entrypoints/serve/utils/api_utils.py).
VLLM_ARGS_LOGGER = "vllm.entrypoints.serve.utils.api_utils"
MASK = "***"
# How deep the search for a KV transfer config goes into a record's arguments.
_MAX_DEPTH = 6


def _extra_configs(value: Any, depth: int = 0) -> Iterator[dict[Any, Any]]:
    """Every ``kv_connector_extra_config`` mapping found in ``value``: a KV transfer
    config object or a dict form of one, or containers of them."""
    if depth > _MAX_DEPTH or isinstance(value, str | bytes | int | float | type(None)):
        return
    if isinstance(value, dict):
        extra = value.get("kv_connector_extra_config")
        if isinstance(extra, dict):
            yield extra
        for item in value.values():
            yield from _extra_configs(item, depth + 1)
        return
    if isinstance(value, list | tuple | set | frozenset):
        for item in value:
            yield from _extra_configs(item, depth + 1)
        return
    extra = getattr(value, "kv_connector_extra_config", None)
    if isinstance(extra, dict):
        yield extra
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from _extra_configs(getattr(value, f.name, None), depth + 1)


def connector_secrets(value: Any) -> set[str]:
    """The Redis passwords held by the KV transfer configs in ``value``: a ``password``
    entry, and in ``redis_url`` the user-info password and a ``password`` query argument
    (each as written in the URL and as it reads decoded)."""
    out: set[str] = set()
    for extra in _extra_configs(value):
        password = extra.get("password")
        if isinstance(password, str) and password:
            out.add(password)
        url = extra.get("redis_url")
        if isinstance(url, str):
            out |= _url_passwords(url)
    return out


def _url_passwords(url: str) -> set[str]:
    try:
        parts = urlsplit(url)
        found = [parts.password or ""]
    except ValueError:  # a malformed URL: its query may still name a password
        parts, found = None, []
    query = parts.query if parts is not None else url.partition("?")[2]
    found += parse_qs(query).get("password", [])
    raw = [p.partition("=")[2] for p in query.split("&") if p.startswith("password=")]
    return {p for p in (*found, *raw) if p}


class ConnectorSecretFilter(logging.Filter):
    """A logging filter that masks the connector's Redis passwords in a record's message
    (its arguments are searched for KV transfer configs). Records without one pass
    unchanged; no record is dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        """Mask the passwords of ``record`` in place; always keep the record."""
        secrets = connector_secrets(record.args) | connector_secrets(record.msg)
        if not secrets:
            return True
        try:
            message = record.getMessage()
        except Exception:  # a malformed record: vLLM's handler reports it as it would
            return True
        for secret in sorted(secrets, key=len, reverse=True):
            message = message.replace(secret, MASK)
        record.msg, record.args = message, None
        return True


def install() -> None:
    """Add ``ConnectorSecretFilter`` to the logger of vLLM's argument line (once per
    process)."""
    logger = logging.getLogger(VLLM_ARGS_LOGGER)
    if not any(isinstance(f, ConnectorSecretFilter) for f in logger.filters):
        logger.addFilter(ConnectorSecretFilter())
