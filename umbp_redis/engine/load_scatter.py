"""Copies of a staged load that start as its values arrive.

A load through staging (device KV caches, or host ones when receiving straight into the
blocks is off) receives each value into a staging slot and then copies the slot into the
engine's block. ``ScatterAsLoaded`` takes the data plane's ``on_loaded`` reports (the
indices of values received and found valid, a window at a time) and starts their copies
at once, so that copying one window overlaps receiving the next instead of waiting for
the whole batch. On a GPU the copies are launched on the copier's stream and return at
once; with torch copies on the host they run in the reporting transfer thread while the
server is already sending the next window.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from umbp_redis.data import StagingCopyPlan
from umbp_redis.engine.copy.interface import BlockCopier, CopyHandle

log = logging.getLogger(__name__)


class ScatterAsLoaded:
    """Starts the staging -> engine copies of a load's blocks as they are reported.

    ``plan_of(indices)`` gives the copy plan of those blocks of the load (index = the
    block's position in the load); ``after`` orders the copies after the engine's work
    (``BlockCopier.engine_point``); once ``cancelled()`` is true no copy is started.
    Thread-safe: reports may come from several transfer threads. ``wait`` must be
    called before the staging slots are reused.
    """

    def __init__(
        self,
        copier: BlockCopier,
        plan_of: Callable[[list[int]], StagingCopyPlan],
        after: object | None,
        cancelled: Callable[[], bool] = lambda: False,
    ) -> None:
        self._copier = copier
        self._plan_of = plan_of
        self._after = after
        self._cancelled = cancelled
        self._lock = threading.Lock()
        self._handles: list[tuple[list[int], CopyHandle]] = []
        self.launches = 0
        self.started: set[int] = set()
        self.failed: set[int] = set()

    def launch(self, indices: list[int]) -> None:
        """Start the copies of ``indices`` not started yet, unless the load was
        cancelled (its blocks are left alone). Never raises: a copy that cannot be
        started marks its blocks failed (they are then recomputed)."""
        if self._cancelled():
            return
        with self._lock:
            todo = [i for i in indices if i not in self.started]
            if not todo:
                return
            self.started.update(todo)
            try:
                handle = self._copier.scatter(self._plan_of(todo), self._after)
            except Exception as e:
                log.error("umbp-redis: copy of %d loaded blocks failed: %r", len(todo), e)
                self.failed.update(todo)
                return
            self._handles.append((todo, handle))
            self.launches += 1

    def wait(self) -> None:
        """Block until every started copy has finished; a copy that failed marks its
        blocks failed. Never raises."""
        with self._lock:
            handles, self._handles = self._handles, []
        for todo, handle in handles:
            try:
                handle.wait()
            except Exception as e:
                log.error("umbp-redis: copy of %d loaded blocks failed: %r", len(todo), e)
                with self._lock:
                    self.failed.update(todo)
