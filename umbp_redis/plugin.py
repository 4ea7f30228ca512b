"""vLLM plugin hook: makes ``"kv_connector": "UMBPRedisConnector"`` work without a module path.

Registered as the ``vllm.general_plugins`` entry point ``umbp_redis``; vLLM calls
``register`` in every process it starts.
"""

from __future__ import annotations


def register() -> None:
    """Register the connector name with vLLM's connector factory (idempotent)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if "UMBPRedisConnector" not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(
            "UMBPRedisConnector", "umbp_redis.connector", "UMBPRedisConnector"
        )
