"""Chunks of vLLM's offloading tiers, as this project keeps them in Redis.

vLLM's ``OffloadingConnector`` with tiering moves *chunks* (``blocks_per_chunk`` blocks of
every group a worker holds, one row of its CPU primary tier) under an ``OffloadKey`` (a
block hash and a group index). They are not this connector's blocks: they get their own
key kind, ``umbp:vllm:v2:{namespace}:chunk:{offload key hex}``, in a namespace derived
from everything that shapes a chunk's bytes, so a chunk is never read as a block, nor a
block as a chunk, nor a chunk of another model or layout. Plain data: no I/O.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from umbp_redis.data.keys import KEY_PREFIX

CHUNK_KIND = "chunk"


def chunk_namespace_inputs(offloading_config: Any, chunk_bytes: int) -> dict[str, Any]:
    """What a chunk namespace digests: the model and KV dtype, the groups (block sizes
    and layers), bytes per block and per chunk, blocks per chunk and tokens per hash,
    the parallel sizes and the host and KV cache layouts."""
    c = offloading_config
    par = c.parallel
    return {
        "schema": KEY_PREFIX,
        "kind": CHUNK_KIND,
        "model": {"name": str(c.model.name), "dtype": str(c.model.dtype)},
        "groups": [
            {
                "group_id": int(g.group_id),
                "tokens_per_block": int(g.tokens_per_block),
                "layers": list(g.layer_names),
            }
            for g in c.groups
        ],
        "worker_kv_bytes_per_block": int(c.worker_kv_bytes_per_block),
        "chunk_bytes": int(chunk_bytes),
        "tokens_per_hash": int(c.cache.tokens_per_hash),
        "blocks_per_chunk": int(c.cache.blocks_per_chunk),
        "parallel": {
            "world_size": int(par.world_size),
            "tp": int(par.tp_size),
            "pp": int(par.pp_size),
            "pcp": int(par.pcp_size),
            "dcp": int(par.dcp_size),
        },
        "replicated_layout": bool(c.replicated_layout),
        "canonical_layout": bool(c.canonical_layout),
        "kv_cache_layout": c.kv_cache_layout,
    }


def chunk_namespace(offloading_config: Any, chunk_bytes: int) -> str:
    """The 16-hex-digit namespace of chunks of this offloading configuration."""
    blob = json.dumps(chunk_namespace_inputs(offloading_config, chunk_bytes), sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def chunk_fingerprint(namespace: str) -> bytes:
    """The 16-byte layout fingerprint chunk values of ``namespace`` are bound to (a
    value of another namespace, or a block's value, fails validation)."""
    return hashlib.sha256(f"{CHUNK_KIND}:{namespace}".encode()).digest()[:16]


def chunk_key(namespace: str, offload_key: bytes) -> bytes:
    """The Redis key of one chunk."""
    return f"{KEY_PREFIX}:{namespace}:{CHUNK_KIND}:{bytes(offload_key).hex()}".encode()
