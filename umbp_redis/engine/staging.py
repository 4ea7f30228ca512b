"""A bounded pool of host staging slots, allocated once and reused.

Every transfer goes through staging memory: a store gathers engine blocks into slots
and the data plane sends them from there; a load receives into slots and scatters
them into the engine. The pool never grows: when it is empty, ``acquire`` returns
None and the caller drops the store (or fails the load into a recompute).
"""

from __future__ import annotations

import threading

import numpy as np
import torch


def staging_budget(max_bytes: int, *, pinned: bool) -> int:
    """The bytes of slots to allocate so that the pool's memory stays within ``max_bytes``.

    torch's pinned-memory allocator rounds every allocation up to a power of two, so a
    pinned pool gets the largest power of two not above ``max_bytes`` (a pool of
    ``max_bytes // slot_bytes`` slots within it then rounds up to at most that much);
    unpinned memory is allocated as asked.
    """
    if max_bytes <= 0:
        raise ValueError("max_bytes must be positive")
    return 1 << (max_bytes.bit_length() - 1) if pinned else max_bytes


class StagingPool:
    """``max_bytes // slot_bytes`` slots of ``slot_bytes`` each, in one allocation.

    Raises ``ValueError`` when ``max_bytes`` holds no slot: the pool never exceeds it.
    """

    def __init__(self, slot_bytes: int, max_bytes: int, *, pin_memory: bool = False) -> None:
        if slot_bytes <= 0:
            raise ValueError("slot_bytes must be positive")
        if max_bytes < slot_bytes:
            raise ValueError(f"{max_bytes} bytes hold no {slot_bytes}-byte staging slot")
        self.slot_bytes = slot_bytes
        self.num_slots = max_bytes // slot_bytes
        self.buffer = torch.zeros(
            (self.num_slots, slot_bytes), dtype=torch.uint8, pin_memory=pin_memory
        )
        self._rows = self.buffer.numpy()
        self._free = list(range(self.num_slots))
        self._lock = threading.Lock()

    def acquire(self, count: int) -> list[int] | None:
        """``count`` free slot indices, or None (and nothing taken) if fewer are free."""
        with self._lock:
            if count > len(self._free):
                return None
            taken, self._free = (
                self._free[-count:] if count else [],
                self._free[: len(self._free) - count],
            )
            return taken

    def release(self, slots: list[int]) -> None:
        """Give slots back."""
        with self._lock:
            self._free.extend(slots)

    def tensor(self, slot: int) -> torch.Tensor:
        """The slot as a uint8 tensor (for copies)."""
        return self.buffer[slot]

    def array(self, slot: int) -> np.ndarray:
        """The slot as a numpy array sharing its memory (for socket I/O)."""
        return self._rows[slot]

    @property
    def free_slots(self) -> int:
        """Slots not in use."""
        with self._lock:
            return len(self._free)
