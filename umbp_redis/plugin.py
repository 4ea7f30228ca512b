"""vLLM plugin hook: makes ``"kv_connector": "UMBPRedisConnector"`` work without a module
path, and ``{"type": "umbp_redis"}`` a secondary tier of vLLM's offloading.

Registered as the ``vllm.general_plugins`` entry point ``umbp_redis``; vLLM calls
``register`` in every process it starts.
"""

from __future__ import annotations


def register() -> None:
    """Register the connector name with vLLM's connector factory and the tier type with
    its secondary tier factory, and mask a Redis password of the connector's config in
    vLLM's argument log line (idempotent)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    from umbp_redis import log_redaction

    log_redaction.install()

    if "UMBPRedisConnector" not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(
            "UMBPRedisConnector", "umbp_redis.connector", "UMBPRedisConnector"
        )
    if "umbp_redis" not in SecondaryTierFactory._registry:
        SecondaryTierFactory.register_tier(
            "umbp_redis", "umbp_redis.engine.redis_tier", "UMBPRedisTier"
        )
