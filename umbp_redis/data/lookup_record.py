"""What a prefix lookup outside the engine needs to know about a namespace.

Every engine keeps one small record per namespace in Redis,
``umbp:vllm:v2:{namespace}:model`` (a JSON string with the values' TTL, written again
while the engine runs): the model and tokenizer it serves, how it hashes blocks (block
size, hash block size, algorithm, a digest of the first block's parent hash) and how
its cache groups make a hit. With it a router, the CLI or the HTTP lookup service
computes a prompt's block hashes as the engine does and reads the stored markers in one
round trip (``umbp_redis.router.prefix_lookup``). Plain data: no I/O.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from umbp_redis.data.groups import CacheGroupPlans, CacheGroupReach
from umbp_redis.data.keys import KEY_PREFIX, NAMESPACE_RE

RECORD_VERSION = 1


def record_key(namespace: str) -> str:
    """The Redis key of ``namespace``'s record."""
    return f"{KEY_PREFIX}:{namespace}:model"


def record_pattern() -> str:
    """A SCAN ``MATCH`` pattern for every namespace's record."""
    return f"{KEY_PREFIX}:*:model"


@dataclass(frozen=True)
class NamespaceRecord:
    """One namespace's model and hashing, as its engines publish it.

    ``reproducible`` is False where block hashes cannot be computed outside the engine
    (a non-cryptographic hash algorithm with a random per-process seed);
    ``none_hash_digest`` lets a reader check that its own first-block parent hash is
    the engines' (the hash itself is not published)."""

    namespace: str
    model: str
    tokenizer: str
    served_names: tuple[str, ...]
    block_size: int
    hash_block_size: int
    hash_algo: str
    reproducible: bool
    none_hash_digest: str
    groups: tuple[CacheGroupReach, ...]

    def serves(self, name: str) -> bool:
        """Whether requests for model ``name`` reach this namespace's engines."""
        return name == self.model or name in self.served_names

    @property
    def plans(self) -> CacheGroupPlans:
        """How the namespace's cache groups make a hit."""
        return CacheGroupPlans(self.groups)

    def to_json(self) -> str:
        """The record as stored."""
        return json.dumps(
            {
                "version": RECORD_VERSION,
                "namespace": self.namespace,
                "model": self.model,
                "tokenizer": self.tokenizer,
                "served_names": list(self.served_names),
                "block_size": self.block_size,
                "hash_block_size": self.hash_block_size,
                "hash_algo": self.hash_algo,
                "reproducible": self.reproducible,
                "none_hash_digest": self.none_hash_digest,
                "groups": [
                    {
                        "group_id": g.group_id,
                        "kind": g.kind,
                        "block_size": g.block_size,
                        "reach_blocks": g.reach_blocks,
                    }
                    for g in self.groups
                ],
            },
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> NamespaceRecord:
        """A stored record; ``ValueError`` naming what is wrong for anything else."""
        try:
            d: dict[str, Any] = json.loads(text)
            if not isinstance(d, dict):
                raise TypeError("not a JSON object")
            if d.get("version") != RECORD_VERSION:
                raise ValueError(f"record version {d.get('version')!r}, not {RECORD_VERSION}")
            groups = tuple(
                CacheGroupReach(
                    int(g["group_id"]), str(g["kind"]), int(g["block_size"]), int(g["reach_blocks"])
                )
                for g in d["groups"]
            )
            rec = cls(
                namespace=str(d["namespace"]),
                model=str(d["model"]),
                tokenizer=str(d["tokenizer"]),
                served_names=tuple(str(n) for n in d["served_names"]),
                block_size=int(d["block_size"]),
                hash_block_size=int(d["hash_block_size"]),
                hash_algo=str(d["hash_algo"]),
                reproducible=bool(d["reproducible"]),
                none_hash_digest=str(d["none_hash_digest"]),
                groups=groups,
            )
        except (KeyError, TypeError, AttributeError, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"malformed namespace record: {e!r}") from None
        if not NAMESPACE_RE.match(rec.namespace):
            raise ValueError(f"malformed namespace record: namespace {rec.namespace!r}")
        if (
            rec.block_size <= 0
            or rec.hash_block_size <= 0
            or rec.block_size % rec.hash_block_size
            or not rec.groups
        ):
            raise ValueError(
                f"malformed namespace record: block size {rec.block_size}, hash block size "
                f"{rec.hash_block_size}, {len(rec.groups)} groups"
            )
        return rec
