"""Which parts of a sync load have arrived, for a forward pass that runs alongside it.

A load by layer (``load_by_layer``) receives part 0 of every block of the load, then
part 1, ... (``KVLayoutDescriptor.part_layers``: a part is a few consecutive layers),
straight into the engine's KV cache. The forward pass asks ``wait`` before each
attention layer and goes on once that layer's part of every block has been received,
or once the load has ended (``open_all``: whatever did not load is reported failed
and vLLM discards the step's output for it), or at the load's deadline.
"""

from __future__ import annotations

import threading
import time


class LayerGate:
    """Arrivals of one load's parts, per cache group; thread-safe.

    ``keys[g]`` is how many blocks of group ``g`` the load holds. ``arrived`` records
    blocks whose part has been received (or found failed); a part is open once all
    its group's blocks have it, or once ``open_all`` was called.
    """

    def __init__(self, keys: dict[int, int], deadline: float) -> None:
        self.deadline = deadline
        self._keys = dict(keys)
        self._arrived: dict[tuple[int, int], set[int]] = {}
        self._open: set[tuple[int, int]] = set()
        self._all_open = False
        self._cond = threading.Condition()
        self.waited: set[tuple[int, int]] = set()

    def arrived(self, group: int, part: int, indices: list[int]) -> None:
        """Blocks ``indices`` (positions among the group's blocks) have ``part``."""
        with self._cond:
            got = self._arrived.setdefault((group, part), set())
            got.update(indices)
            if len(got) >= self._keys.get(group, 0):
                self._open.add((group, part))
                self._cond.notify_all()

    def open_all(self) -> None:
        """The load has ended: nothing more will be written, every wait returns."""
        with self._cond:
            self._all_open = True
            self._cond.notify_all()

    def wait(self, group: int, part: int) -> bool:
        """Block until ``part`` of ``group`` is open or the deadline passes; False when
        the deadline passed first (the load goes on until it ends by its deadline)."""
        with self._cond:
            self.waited.add((group, part))
            while not (self._all_open or (group, part) in self._open or group not in self._keys):
                left = self.deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True
