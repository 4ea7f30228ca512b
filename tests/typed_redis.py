"""Typing help for redis-py replies in tests (its stubs say ``bytes | str | None``)."""

from __future__ import annotations


def raw(value: object) -> bytes:
    """A reply that must be bytes (a client without ``decode_responses``)."""
    assert isinstance(value, bytes | bytearray), value
    return bytes(value)
