"""The UMBP data model: identities, layouts and plans as plain data.

Nothing here talks to Redis or holds engine state. The types describe vLLM's logical
KV objects (one object per block, cache group and model-parallel rank), the Redis keys
that name them, and the physical byte ranges a transfer executor copies between the
engine's KV tensors and a staging buffer. They can all be built and tested without a
server or a GPU.

One module per concern: ``topology`` (ranks), ``namespace`` (compatibility
namespaces), ``groups`` (what each cache group needs for a hit), ``keys`` (the key
schema, light: no torch or vLLM) and ``codec`` (keys of blocks), ``ranges`` and
``layout`` (object layouts and range templates), ``plans`` (transfers), ``state``
(request state), ``metadata`` (what crosses processes), ``lookup_record`` (what a
lookup outside the engine needs of a namespace), ``chunks`` (vLLM offloading chunks).
``from umbp_redis.data import NAME`` works for every public name; the submodule is
imported on first use, so reading keys (``umbp_redis.data.keys``) stays light.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from umbp_redis.data.codec import (
        BlockIdentityCodec,
        tp_replicated_group_ids,
    )
    from umbp_redis.data.groups import (
        CacheGroupPlans,
        CacheGroupReach,
        UnsupportedCacheGroup,
        block_failures_reportable,
    )
    from umbp_redis.data.keys import (
        KEY_PREFIX,
        NAMESPACE_RE,
        DecodedKey,
        namespace_pattern,
        parse_key,
        value_pattern,
    )
    from umbp_redis.data.layout import (
        KVLayoutDescriptor,
        KVLayoutError,
        KVLayoutPlanner,
        KVRegion,
    )
    from umbp_redis.data.metadata import (
        UMBPConnectorMetadata,
        UMBPConnectorWorkerMetadata,
        UMBPHandshakeMetadata,
    )
    from umbp_redis.data.namespace import (
        CONNECTOR_NAME,
        UMBPNamespace,
        layer_specs,
        namespace_inputs,
    )
    from umbp_redis.data.plans import (
        BlockLoadBatch,
        BlockStoreBatch,
        BlockTransferPlan,
        LoadSpec,
        StagingCopyPlan,
    )
    from umbp_redis.data.ranges import (
        KVRange,
        KVRangeRun,
        KVRangeTemplate,
    )
    from umbp_redis.data.state import (
        RequestTracker,
        StoreEventResult,
    )
    from umbp_redis.data.topology import (
        RankTopology,
    )

_WHERE = {
    "BlockIdentityCodec": "codec",
    "BlockLoadBatch": "plans",
    "BlockStoreBatch": "plans",
    "BlockTransferPlan": "plans",
    "CacheGroupPlans": "groups",
    "CacheGroupReach": "groups",
    "CONNECTOR_NAME": "namespace",
    "DecodedKey": "keys",
    "KEY_PREFIX": "keys",
    "KVLayoutDescriptor": "layout",
    "KVLayoutError": "layout",
    "KVLayoutPlanner": "layout",
    "KVRange": "ranges",
    "KVRangeRun": "ranges",
    "KVRangeTemplate": "ranges",
    "KVRegion": "layout",
    "LoadSpec": "plans",
    "NAMESPACE_RE": "keys",
    "RankTopology": "topology",
    "RequestTracker": "state",
    "StagingCopyPlan": "plans",
    "StoreEventResult": "state",
    "UMBPConnectorMetadata": "metadata",
    "UMBPConnectorWorkerMetadata": "metadata",
    "UMBPHandshakeMetadata": "metadata",
    "UMBPNamespace": "namespace",
    "UnsupportedCacheGroup": "groups",
    "block_failures_reportable": "groups",
    "layer_specs": "namespace",
    "namespace_inputs": "namespace",
    "namespace_pattern": "keys",
    "parse_key": "keys",
    "tp_replicated_group_ids": "codec",
    "value_pattern": "keys",
}

__all__ = [
    "BlockIdentityCodec",
    "BlockLoadBatch",
    "BlockStoreBatch",
    "BlockTransferPlan",
    "CONNECTOR_NAME",
    "CacheGroupPlans",
    "CacheGroupReach",
    "DecodedKey",
    "KEY_PREFIX",
    "KVLayoutDescriptor",
    "KVLayoutError",
    "KVLayoutPlanner",
    "KVRange",
    "KVRangeRun",
    "KVRangeTemplate",
    "KVRegion",
    "LoadSpec",
    "NAMESPACE_RE",
    "RankTopology",
    "RequestTracker",
    "StagingCopyPlan",
    "StoreEventResult",
    "UMBPConnectorMetadata",
    "UMBPConnectorWorkerMetadata",
    "UMBPHandshakeMetadata",
    "UMBPNamespace",
    "UnsupportedCacheGroup",
    "block_failures_reportable",
    "layer_specs",
    "namespace_inputs",
    "namespace_pattern",
    "parse_key",
    "tp_replicated_group_ids",
    "value_pattern",
]


def __getattr__(name: str) -> Any:
    """Import the submodule that defines ``name`` on first use."""
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
