"""What a worker owes vLLM and the scheduler: finished loads, failed blocks, store
reports, values found bad, removed or stored again. Transfer threads write it; the
engine's thread drains it (``take_finished_loads``, ``take_load_errors``, ``drain``)."""

from __future__ import annotations

import threading
from collections.abc import Iterable

from umbp_redis.data import StoreEventResult, UMBPConnectorWorkerMetadata
from umbp_redis.data.metadata import MAX_LOAD_TIMES

# Failed-load block hashes one report carries at most (the oldest are dropped).
MAX_FAILED_LOADS_REPORTED = 4096


def _remember(seen: dict[bytes, None], hashes: Iterable[bytes]) -> None:
    """Add ``hashes`` to the insertion-ordered ``seen``, dropping the oldest beyond
    ``MAX_FAILED_LOADS_REPORTED``."""
    for h in hashes:
        seen[h] = None
    while len(seen) > MAX_FAILED_LOADS_REPORTED:
        del seen[next(iter(seen))]


class WorkerLedger:
    """One worker's outcomes since they were last taken, under one lock.

    Blocks that did not load are owed to vLLM as block ids, or, where vLLM cannot take
    block ids (several cache groups: ``fails_per_request``), as failed requests. The
    scheduler is owed the rest through ``drain``.
    """

    def __init__(self, fails_per_request: bool) -> None:
        self.fails_per_request = fails_per_request
        self._lock = threading.Lock()
        self._finished_loads: set[str] = set()
        self._load_errors: set[int] = set()
        self._failed_recving: set[str] = set()
        self._sync_failed: dict[str, None] = {}  # requests whose sync load failed
        self._store_reports: dict[int, StoreEventResult] = {}
        # Block hashes whose load failed (invalid or error) since the last drain; those
        # reported lately (bounded); those of them stored again since the last drain.
        self._failed_values: dict[bytes, None] = {}
        self._recent_failed: dict[bytes, None] = {}
        self._repaired: dict[bytes, None] = {}
        self._failed_requests: dict[str, None] = {}
        self._removed: dict[bytes, None] = {}
        self._load_times: list[tuple[int, float, bool]] = []

    def load_failed(self, request_id: str, block_ids: Iterable[int], *, sync: bool) -> None:
        """Blocks of a load that did not load (vLLM recomputes them); a failed sync load
        is also owed to the scheduler (``sync_failed_requests``)."""
        block_ids = set(block_ids)
        if not block_ids:
            return
        with self._lock:
            if sync:
                self._sync_failed[request_id] = None
            if self.fails_per_request:
                self._failed_recving.add(request_id)
            else:
                self._load_errors |= block_ids

    def load_timed(self, nbytes: int, seconds: float, complete: bool) -> None:
        """A load of ``nbytes`` took ``seconds`` (``complete`` False: it ran out of time
        then); the newest ``MAX_LOAD_TIMES`` are kept."""
        with self._lock:
            self._load_times.append((nbytes, seconds, complete))
            if len(self._load_times) > MAX_LOAD_TIMES:
                del self._load_times[0]

    def load_finished(self, request_id: str) -> None:
        """An async load of ``request_id`` is terminal."""
        with self._lock:
            self._finished_loads.add(request_id)

    def values_failed(self, request_id: str, block_hashes: list[bytes]) -> None:
        """Values that would fail again (error replies, invalid values that stay): the
        scheduler quarantines their blocks and offers the request no more hits."""
        if not block_hashes:
            return
        with self._lock:
            self._failed_requests[request_id] = None
            _remember(self._failed_values, block_hashes)
            _remember(self._recent_failed, block_hashes)

    def values_removed(self, block_hashes: list[bytes]) -> None:
        """Values not in Redis: found missing, or invalid and deleted (announced as
        removed; their stored markers are deleted)."""
        with self._lock:
            _remember(self._removed, block_hashes)

    @property
    def has_recent_failures(self) -> bool:
        """Whether some recently failed value may be stored again (``values_stored``)."""
        return bool(self._recent_failed)

    def values_stored(self, block_hashes: list[bytes]) -> None:
        """Blocks stored again (valid): those whose load had failed lately may be
        offered as hits again."""
        with self._lock:
            for h in block_hashes:
                if h in self._recent_failed:
                    del self._recent_failed[h]
                    self._repaired[h] = None

    def store_reported(self, event_id: int, failed_keys: frozenset[str]) -> None:
        """This worker is done with a store event (``failed_keys`` did not land)."""
        with self._lock:
            prev = self._store_reports.get(event_id)
            res = StoreEventResult(event_id, 1, failed_keys)
            self._store_reports[event_id] = prev.merge(res) if prev else res

    def take_finished_loads(self) -> tuple[set[str], set[str]]:
        """Requests whose async loads are terminal since the last call, and those of
        them whose load failed (only with ``fails_per_request``)."""
        with self._lock:
            done, self._finished_loads = self._finished_loads, set()
            failed, self._failed_recving = self._failed_recving & done, self._failed_recving - done
        return done, failed

    def take_load_errors(self) -> set[int]:
        """Destination blocks that did not load since the last call."""
        with self._lock:
            errs, self._load_errors = self._load_errors, set()
        return errs

    def drain(self, layer_loads_off: bool = False) -> UMBPConnectorWorkerMetadata | None:
        """What the scheduler is owed since the last call (None when nothing)."""
        with self._lock:
            reports, self._store_reports = self._store_reports, {}
            failed, self._failed_values = tuple(self._failed_values), {}
            repaired, self._repaired = tuple(self._repaired), {}
            requests, self._failed_requests = tuple(self._failed_requests), {}
            removed, self._removed = tuple(self._removed), {}
            sync_failed, self._sync_failed = tuple(self._sync_failed), {}
            timed, self._load_times = tuple(self._load_times), []
        if not (
            reports
            or failed
            or repaired
            or requests
            or removed
            or sync_failed
            or layer_loads_off
            or timed
        ):
            return None
        return UMBPConnectorWorkerMetadata(
            reports, failed, repaired, requests, removed, sync_failed, layer_loads_off, timed
        )
