"""``UMBPRedisConnector``: the vLLM v1 KV connector. It only dispatches.

The scheduler half (``umbp_redis.engine.scheduler``) decides what to load and store; the
worker half (``umbp_redis.engine.worker``) moves the bytes; both share the data plane
(``umbp_redis.store.plane``). Load it with
``{"kv_connector": "UMBPRedisConnector", "kv_connector_module_path": "umbp_redis.connector",
"kv_role": "kv_both", "kv_connector_extra_config": {"redis_url": "redis://host:6379/0"}}``.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from umbp_redis.data import UMBPConnectorMetadata
from umbp_redis.engine.options import parse_connector_options
from umbp_redis.engine.stats import UMBPConnectorStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


@functools.cache
def _route_logs_to_vllm() -> None:
    """Send this package's log records through vLLM's handlers (same format and level).

    Runs once per process, when its first connector is made: by then vLLM has set up
    its logging, and importing this module changes no logger.
    """
    ours, theirs = logging.getLogger("umbp_redis"), logging.getLogger("vllm")
    if not ours.handlers and theirs.handlers:
        for h in theirs.handlers:
            ours.addHandler(h)
        ours.setLevel(theirs.level or logging.INFO)
        ours.propagate = False


class UMBPRedisConnector(KVConnectorBase_V1, SupportsHMA):
    """Redis-backed KV cache for any number of vLLM engines.

    Supports vLLM's hybrid KV cache manager: each cache group has its own keys and its
    own reach (see ``umbp_redis.data.groups``)."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        _route_logs_to_vllm()
        super().__init__(vllm_config, role, kv_cache_config)
        settings, options = parse_connector_options(
            self._kv_transfer_config.kv_connector_extra_config
        )
        self._scheduler = None
        self._worker = None
        if role == KVConnectorRole.SCHEDULER:
            from umbp_redis.engine.scheduler import UMBPScheduler

            self._scheduler = UMBPScheduler(vllm_config, kv_cache_config, settings, options)
        else:
            from umbp_redis.engine.worker import UMBPWorker

            self._worker = UMBPWorker(vllm_config, kv_cache_config, settings, options)

    @property
    def requires_kv_delivery(self) -> bool:
        """A dropped store is only a future miss."""
        return False

    # -- worker -------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, UMBPConnectorMetadata):
            self._worker.bind(connector_metadata)

    def clear_connector_metadata(self) -> None:
        if self._worker is not None:
            self._worker.clear()
        super().clear_connector_metadata()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if self._worker is not None:
            self._worker.start_load_kv()

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._worker is not None:  # loads by layer; async loads gate the request
            self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # whole blocks are gathered after the forward pass, in wait_for_save

    def wait_for_save(self) -> None:
        if self._worker is not None:
            self._worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)  # the one path: see there
        return None, (results.finished_recving or None)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self._worker is None:
            return KVConnectorTransferResults()
        done, failed = self._worker.take_finished_loads()
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors() if self._worker is not None else set()

    def get_handshake_metadata(self) -> Any:
        return self._worker.handshake_metadata() if self._worker is not None else None

    def build_connector_worker_meta(self) -> Any:
        return self._worker.build_worker_meta() if self._worker is not None else None

    def get_kv_connector_stats(self) -> UMBPConnectorStats | None:
        if self._worker is not None:
            data = self._worker.take_stats()
        elif self._scheduler is not None:
            data = self._scheduler.take_stats()
        else:
            return None
        return UMBPConnectorStats(data=data) if any(data.values()) else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> UMBPConnectorStats:
        return UMBPConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> Any:
        from umbp_redis.engine.stats import UMBPPromMetrics

        return UMBPPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()

    # -- scheduler ----------------------------------------------------------------------

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        if self._scheduler is not None:
            self._scheduler.bind_block_pool(gpu_block_pool)

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[Any, Any]) -> None:
        if self._scheduler is not None:
            self._scheduler.adopt_handshake(metadata)

    def set_xfer_handshake_metadata(self, metadata: dict[Any, Any]) -> None:
        if self._scheduler is not None:
            self._scheduler.adopt_handshake(metadata)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        if self._scheduler is not None:
            self._scheduler.update_connector_output(connector_output)

    def take_events(self) -> Iterable[Any]:
        return self._scheduler.take_events() if self._scheduler is not None else ()

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request)

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request)

    def has_pending_block_frees(self) -> bool:
        return self._scheduler.has_pending_block_frees() if self._scheduler is not None else False

    def has_pending_push_work(self) -> bool:
        return self._scheduler.has_pending_push_work() if self._scheduler is not None else False

    def reset_cache(self) -> bool | None:
        return self._scheduler.reset_cache() if self._scheduler is not None else True
