"""Blocks whose load failed, kept from being offered as hits for a while."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

log = logging.getLogger(__name__)

# Blocks the quarantine remembers at most (the oldest are forgotten).
QUARANTINE_MAX_BLOCKS = 65536


class LoadQuarantine:
    """Block hashes not offered as hits until their quarantine ends.

    A value that failed to load (invalid, evicted meanwhile, an error) would most
    likely fail again: for ``seconds`` lookups treat its block as absent, so the
    engine recomputes it and stores it afresh. A block stored again and valid
    (``release``) is offered at once. ``seconds`` 0 turns the quarantine off.
    """

    def __init__(
        self,
        seconds: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        max_blocks: int = QUARANTINE_MAX_BLOCKS,
    ) -> None:
        self.seconds = seconds
        self.max_blocks = max_blocks
        self.clock = clock
        self._until: OrderedDict[bytes, float] = OrderedDict()
        self.skips = 0  # lookups that cut a hit short at a quarantined block

    def __len__(self) -> int:
        return len(self._until)

    def add(self, hashes: Iterable[bytes]) -> None:
        """Quarantine ``hashes`` from now for ``seconds`` (logged once per call)."""
        hashes = tuple(hashes)
        if self.seconds <= 0 or not hashes:
            return
        until = self.clock() + self.seconds
        for h in hashes:
            self._until[h] = until
            self._until.move_to_end(h)
        while len(self._until) > self.max_blocks:
            self._until.popitem(last=False)
        log.info(
            "umbp-redis: %d blocks failed to load; not offered as hits for %.0fs",
            len(hashes),
            self.seconds,
        )

    def release(self, block_hash: bytes) -> None:
        """End a block's quarantine (its value was stored again and is valid)."""
        self._until.pop(block_hash, None)

    def now(self) -> float | None:
        """The quarantine's clock, read once per lookup; None when nothing is held."""
        return self.clock() if self._until else None

    def holds(self, block_hash: bytes | None, now: float) -> bool:
        """Whether ``block_hash`` is quarantined at ``now`` (an expired entry is dropped)."""
        until = self._until.get(block_hash) if block_hash is not None else None
        if until is None:
            return False
        if until <= now:
            del self._until[block_hash]  # type: ignore[arg-type]
            return False
        return True
