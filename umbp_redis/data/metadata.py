"""Metadata crossing process boundaries (scheduler <-> workers), on vLLM's base
classes (stand-ins where vLLM is absent)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from umbp_redis.data.plans import BlockLoadBatch, BlockStoreBatch
from umbp_redis.data.state import StoreEventResult
from umbp_redis.data.topology import RankTopology

if TYPE_CHECKING:
    pass


try:  # vLLM is the host program; the data model also works without it (e.g. the CLI).
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorHandshakeMetadata,
        KVConnectorMetadata,
        KVConnectorWorkerMetadata,
    )
except ImportError:  # pragma: no cover - exercised only where vLLM is absent
    from abc import ABC

    class KVConnectorHandshakeMetadata(ABC):  # type: ignore[no-redef]  # noqa: B024
        """Stand-in for vLLM's base class when vLLM is not installed."""

    class KVConnectorMetadata(ABC):  # type: ignore[no-redef]  # noqa: B024
        """Stand-in for vLLM's base class when vLLM is not installed."""

    class KVConnectorWorkerMetadata(ABC):  # type: ignore[no-redef]  # noqa: B024
        """Stand-in for vLLM's base class when vLLM is not installed."""


@dataclass
class UMBPConnectorMetadata(KVConnectorMetadata):
    """Scheduler-to-worker plans for one engine step.

    ``loads``/``stores`` are the step's batches; ``cancelled_requests`` are preempted or
    aborted requests whose pending transfers the workers drop; ``step_requests`` is how
    many requests the step computes (those that wait behind its sync loads).
    """

    loads: list[BlockLoadBatch] = field(default_factory=list)
    stores: list[BlockStoreBatch] = field(default_factory=list)
    cancelled_requests: list[str] = field(default_factory=list)
    step_requests: int = 0

    @property
    def is_empty(self) -> bool:
        """Nothing to do this step."""
        return not (self.loads or self.stores or self.cancelled_requests)


# Load times one report of the workers carries at most (the newest are kept).
MAX_LOAD_TIMES = 256


@dataclass
class UMBPConnectorWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker completions of one step, aggregated across ranks.

    ``failed_loads``: block hashes whose load failed on a worker (an invalid value or an
    error reply): the scheduler stops offering them as hits for a while.
    ``repaired_loads``: such blocks stored again (valid) since: offered again.
    ``failed_requests``: requests one of whose loads failed that way: they are offered
    no more Redis hits (vLLM asks again after a failed load at the prompt's start; the
    same failing value must not be loaded over and over).
    ``removed_blocks``: blocks whose value a worker found missing, or invalid and
    deleted: the scheduler deletes their stored markers and announces them removed.
    ``sync_failed_requests``: requests a block of whose sync load did not load. vLLM
    cached the load's blocks, and those the step computed after them, before the load
    ran; the scheduler takes them out of vLLM's prefix cache.
    ``layer_loads_off``: a worker turned its loads by layer off (its forward pass did
    not wait for every layer): the scheduler stops planning large loads sync.
    ``load_times``: (bytes, seconds, complete) of loads a worker ran, for the
    scheduler's estimate of what a load costs (complete False: it ran out of time after
    those seconds); at most ``MAX_LOAD_TIMES``.
    """

    store_results: dict[int, StoreEventResult] = field(default_factory=dict)
    failed_loads: tuple[bytes, ...] = ()
    repaired_loads: tuple[bytes, ...] = ()
    failed_requests: tuple[str, ...] = ()
    removed_blocks: tuple[bytes, ...] = ()
    sync_failed_requests: tuple[str, ...] = ()
    layer_loads_off: bool = False
    load_times: tuple[tuple[int, float, bool], ...] = ()

    def aggregate(self, other: KVConnectorWorkerMetadata) -> UMBPConnectorWorkerMetadata:
        """Merge another rank's completions into a new object (neither input changes)."""
        if not isinstance(other, UMBPConnectorWorkerMetadata):
            raise TypeError(f"cannot aggregate with {type(other).__name__}")
        merged = dict(self.store_results)
        for eid, res in other.store_results.items():
            merged[eid] = merged[eid].merge(res) if eid in merged else res
        failed = tuple(dict.fromkeys(self.failed_loads + other.failed_loads))
        repaired = tuple(dict.fromkeys(self.repaired_loads + other.repaired_loads))
        requests = tuple(dict.fromkeys(self.failed_requests + other.failed_requests))
        removed = tuple(dict.fromkeys(self.removed_blocks + other.removed_blocks))
        sync_failed = tuple(dict.fromkeys(self.sync_failed_requests + other.sync_failed_requests))
        return UMBPConnectorWorkerMetadata(
            merged,
            failed,
            repaired,
            requests,
            removed,
            sync_failed,
            self.layer_loads_off or other.layer_loads_off,
            (self.load_times + other.load_times)[-MAX_LOAD_TIMES:],
        )


@dataclass
class UMBPHandshakeMetadata(KVConnectorHandshakeMetadata):
    """Namespace a worker derived, reported to the scheduler at startup;
    ``loads_by_layer``: whether its sync loads run alongside the forward pass, a part of
    every block at a time (``load_by_layer``), so that large ones cost the step little."""

    namespace: str
    topology: RankTopology
    loads_by_layer: bool = False
