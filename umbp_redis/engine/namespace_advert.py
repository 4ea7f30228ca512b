"""This engine's namespace record in Redis, for prefix lookups outside the engine.

The scheduler asks ``NamespaceAdvert.due`` once a step; at most every ``REFRESH_S`` it
answers a ``SET key record EX ttl`` for the stored-marker writer's thread to send (the
step never waits for Redis). See ``umbp_redis.data.lookup_record``.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from umbp_redis.data import CacheGroupPlans
from umbp_redis.data.lookup_record import NamespaceRecord, record_key
from umbp_redis.store.resp import encode_command

if TYPE_CHECKING:
    from vllm.config import VllmConfig

# Seconds between two writes of the record (also the first write's delay at most).
REFRESH_S = 60.0
# Hash algorithms whose first-block parent hash is random per process unless
# PYTHONHASHSEED is set (vLLM's non-cryptographic ones).
NON_CRYPTO_ALGOS = frozenset({"xxhash", "xxhash_cbor"})


def none_hash_digest() -> str:
    """A digest of this process's first-block parent hash (vLLM's ``NONE_HASH``);
    empty before vLLM has set it."""
    from vllm.v1.core import kv_cache_utils

    value = getattr(kv_cache_utils, "NONE_HASH", None)
    if not value:
        return ""
    return hashlib.sha256(bytes(value)).hexdigest()[:16]


def hashes_reproducible(algo: str, env: Any = os.environ) -> bool:
    """Whether another process can compute this engine's block hashes: a cryptographic
    algorithm (fixed default seed) or a shared ``PYTHONHASHSEED``."""
    return algo not in NON_CRYPTO_ALGOS or env.get("PYTHONHASHSEED") is not None


class NamespaceAdvert:
    """Builds this engine's namespace record and says when it is due in Redis."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        block_size: int,
        hash_block_size: int,
        plans: CacheGroupPlans,
        ttl_s: int,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        mc = vllm_config.model_config
        served = mc.served_model_name or []
        self.model = str(mc.model)
        self.tokenizer = str(mc.tokenizer or mc.model)
        self.served_names = tuple([served] if isinstance(served, str) else [str(n) for n in served])
        cc = vllm_config.cache_config
        self.hash_algo = str(cc.prefix_caching_hash_algo)
        self.block_size = block_size
        self.hash_block_size = hash_block_size
        self.plans = plans
        self.ttl = str(int(ttl_s)).encode()
        self.clock = clock
        self._sent_at: float | None = None
        self._namespace: str | None = None

    def record(self, namespace: str) -> NamespaceRecord:
        """The record of ``namespace`` as this engine hashes and hits blocks."""
        return NamespaceRecord(
            namespace=namespace,
            model=self.model,
            tokenizer=self.tokenizer,
            served_names=self.served_names,
            block_size=self.block_size,
            hash_block_size=self.hash_block_size,
            hash_algo=self.hash_algo,
            reproducible=hashes_reproducible(self.hash_algo),
            none_hash_digest=none_hash_digest(),
            groups=self.plans.groups,
        )

    def due(self, namespace: str) -> tuple[bytes, bytes] | None:
        """(key, ``SET`` command) when the record of ``namespace`` is due: never written,
        the namespace changed, or ``REFRESH_S`` passed; else None."""
        now = self.clock()
        if (
            self._namespace == namespace
            and self._sent_at is not None
            and now - self._sent_at < REFRESH_S
        ):
            return None
        rec = self.record(namespace)
        if not rec.none_hash_digest:
            return None  # vLLM has not hashed yet: next step
        self._namespace, self._sent_at = namespace, now
        key = record_key(namespace).encode()
        return key, encode_command(b"SET", key, rec.to_json().encode(), b"EX", self.ttl)
