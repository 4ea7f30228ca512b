"""Waiting for a condition in tests: the one polling helper, always with a deadline."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

POLL_S = 0.01


def wait_until(
    predicate: Callable[[], T],
    timeout_s: float = 10.0,
    *,
    what: str | Callable[[], str] = "the condition",
    poll_s: float = POLL_S,
) -> T:
    """Call ``predicate`` until it returns a truthy value and return that value; raise
    ``AssertionError`` naming ``what`` (a string, or a callable giving one, e.g. the
    state seen last) once ``timeout_s`` has passed without one. Between calls it waits
    ``poll_s``: a poll of a condition, never a fixed delay standing in for it."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            described = what() if callable(what) else what
            raise AssertionError(f"timed out after {timeout_s} s waiting for {described}")
        time.sleep(poll_s)
