"""How many prefix tokens of a prompt the shared cache holds, asked from outside vLLM.

For routers and operators: ``CacheLookup(redis_url).lookup(model, text=... or
token_ids=...)`` finds the namespaces whose engines serve ``model`` (their records,
``umbp_redis.data.lookup_record``), computes the prompt's block hashes as those engines
do (vLLM's hash function and first-block seed, block and hash block size, ``cache_salt``,
LoRA) and reads the blocks' stored markers in one pipelined round trip (one per master
on a cluster), exactly as an engine's own lookup does. The answer is what a fresh engine
of that namespace would take from Redis for the prompt. ``umbp-redis lookup`` and
``umbp-redis serve-lookup`` (HTTP, JSON) are the same function.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from umbp_redis.data import BlockIdentityCodec, CacheGroupReach
from umbp_redis.data.lookup_record import NamespaceRecord, record_key, record_pattern
from umbp_redis.store.deployment import DataPlane, open_plane
from umbp_redis.store.redispy import redispy_client
from umbp_redis.store.settings import RedisSettings

log = logging.getLogger(__name__)

# Namespace records are read again after this many seconds, and at most this often when
# a model is not found among them.
RECORDS_MAX_AGE_S = 60.0
RESCAN_MIN_INTERVAL_S = 5.0
# Tokens of one prompt at most (a 1M-token context and some).
MAX_PROMPT_TOKENS = 1 << 21


class LookupFailed(ValueError):
    """A lookup that cannot be answered; ``status`` is its HTTP status."""

    status = 400


class BadLookupRequest(LookupFailed):
    """The request is malformed (no prompt, tokens that are not ints, ...)."""

    status = 400


class UnknownModel(LookupFailed):
    """No engine of the fleet published a namespace for the model."""

    status = 404


class HashesNotReproducible(LookupFailed):
    """The engines' block hashes cannot be computed outside them."""

    status = 409


class CacheUnavailable(LookupFailed):
    """Redis did not answer within ``lookup_timeout_s``."""

    status = 503


@dataclass(frozen=True)
class NamespaceAnswer:
    """One namespace's answer: ``cached_tokens`` of ``prompt_tokens`` would load."""

    namespace: str
    cached_tokens: int
    cached_blocks: int
    block_size: int


@dataclass(frozen=True)
class LookupAnswer:
    """A prompt's answer: the best namespace's tokens, and every namespace's."""

    model: str
    prompt_tokens: int
    cached_tokens: int
    namespaces: tuple[NamespaceAnswer, ...]

    def to_dict(self) -> dict[str, Any]:
        """The answer as JSON-able data."""
        return dataclasses.asdict(self)


class PromptHasher:
    """Block hashes of token ids as a namespace's engines compute them (vLLM's own
    hash function and first-block seed); checks that this process's seed is theirs."""

    def __init__(self, record: NamespaceRecord) -> None:
        if not record.reproducible:
            raise HashesNotReproducible(
                f"namespace {record.namespace}: its engines hash blocks with "
                f"prefix_caching_hash_algo={record.hash_algo} and no PYTHONHASHSEED, so every "
                "engine process has a random first-block seed and nothing outside it can "
                "compute its hashes; set the same PYTHONHASHSEED for the engines and this "
                "service, or use sha256 (vLLM's default)"
            )
        import hashlib

        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import resolve_none_hash_seed

        self.hash_fn = get_hash_fn_by_name(record.hash_algo)
        self.none_hash = self.hash_fn(resolve_none_hash_seed(self.hash_fn))
        if hashlib.sha256(bytes(self.none_hash)).hexdigest()[:16] != record.none_hash_digest:
            raise HashesNotReproducible(
                f"namespace {record.namespace}: this process's first-block seed differs from "
                "its engines' (PYTHONHASHSEED differs); start the lookup service with the "
                "engines' PYTHONHASHSEED"
            )
        self.record = record

    def block_hashes(
        self,
        token_ids: Sequence[int],
        *,
        cache_salt: str | None = None,
        lora: tuple[str, str] | None = None,
    ) -> list[bytes]:
        """The hash of every full KV block of ``token_ids``, in order. ``lora`` is the
        adapter's (name, path) as the engines know it."""
        hbs = self.record.hash_block_size
        scale = self.record.block_size // hbs
        # vLLM's extra keys, in its order: the LoRA on every block, the salt on the first.
        lora_keys: tuple[Any, ...] = () if lora is None else (("lora", lora[0], lora[1]),)
        first = lora_keys + ((("cache_salt", cache_salt),) if cache_salt else ())
        extra: tuple[Any, ...] | None = first or None
        rest = lora_keys or None
        hash_fn = self.hash_fn
        tokens = tuple(token_ids)
        parent = self.none_hash
        sub: list[bytes] = []
        for start in range(0, len(tokens) - hbs + 1, hbs):
            parent = hash_fn((parent, tokens[start : start + hbs], extra))
            sub.append(parent)
            extra = rest
        return [bytes(h) for h in sub[scale - 1 :: scale]]


class CacheLookup:
    """Answers prefix lookups against one Redis deployment (standalone or cluster).

    Thread-safe; one data plane and one redis-py client per instance. Every wait on
    Redis is bounded by ``lookup_timeout_s`` (markers) or ``op_timeout_s`` (records)."""

    def __init__(
        self,
        settings: RedisSettings | str,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = RedisSettings.from_url(settings) if isinstance(settings, str) else settings
        self.clock = clock
        self._plane: DataPlane = open_plane(self.settings)
        self._client: Any = None
        self._lock = threading.Lock()
        self._records: dict[str, NamespaceRecord] = {}
        self._records_at: float | None = None
        self._hashers: dict[str, PromptHasher] = {}
        self._tokenizers: dict[str, Any] = {}

    # -- records ----------------------------------------------------------------------

    def _redis(self) -> Any:
        if self._client is None:
            self._client = redispy_client(
                self.settings,
                socket_timeout=self.settings.op_timeout_s,
                connect_timeout=self.settings.connect_timeout_s,
            )
        return self._client

    def records(self, *, refresh: bool = False) -> dict[str, NamespaceRecord]:
        """Every namespace's record (namespace -> record), read again when older than
        ``RECORDS_MAX_AGE_S`` or when ``refresh``. Malformed records are skipped."""
        import redis

        now = self.clock()
        with self._lock:
            if not refresh and self._records_at is not None:
                if now - self._records_at < RECORDS_MAX_AGE_S:
                    return dict(self._records)
            if refresh and self._records_at is not None:
                if now - self._records_at < RESCAN_MIN_INTERVAL_S:
                    return dict(self._records)
            self._plane.warm_up()
            try:
                client = self._redis()
                keys = list(client.scan_iter(match=record_pattern(), count=1000))
                if self._plane.lookup_mode == "cluster":  # one slot a key
                    blobs = [client.get(k) for k in keys]
                else:
                    blobs = client.mget(keys) if keys else []
            except redis.RedisError as e:
                raise CacheUnavailable(f"reading namespace records failed: {e}") from None
            records: dict[str, NamespaceRecord] = {}
            for key, blob in zip(keys, blobs, strict=True):
                if blob is None:
                    continue
                try:
                    rec = NamespaceRecord.from_json(blob)
                except ValueError as e:
                    log.warning("umbp-redis lookup: %s: %s", key, e)
                    continue
                if record_key(rec.namespace).encode() == (
                    key if isinstance(key, bytes) else key.encode()
                ):
                    records[rec.namespace] = rec
            self._records, self._records_at = records, now
            return dict(records)

    def namespaces_of(self, model: str) -> list[NamespaceRecord]:
        """The records of the namespaces whose engines serve ``model``; ``UnknownModel``
        when none does (after reading the records again)."""
        found = [r for r in self.records().values() if r.serves(model)]
        if not found:
            found = [r for r in self.records(refresh=True).values() if r.serves(model)]
        if not found:
            known = sorted({n for r in self._records.values() for n in (r.model, *r.served_names)})
            raise UnknownModel(
                f"no engine has published a namespace for model {model!r} "
                f"(models known: {known or 'none'})"
            )
        return sorted(found, key=lambda r: r.namespace)

    # -- lookups ----------------------------------------------------------------------

    def tokenize(self, record: NamespaceRecord, text: str) -> list[int]:
        """``text`` as the engines tokenize a prompt (their tokenizer, special tokens
        added as vLLM adds them to a completion prompt)."""
        tok = self._tokenizers.get(record.tokenizer)
        if tok is None:
            from transformers import AutoTokenizer

            tok = self._tokenizers[record.tokenizer] = AutoTokenizer.from_pretrained(
                record.tokenizer
            )
        return list(tok(text, add_special_tokens=True)["input_ids"])

    def lookup(
        self,
        model: str,
        *,
        text: str | None = None,
        token_ids: Sequence[int] | None = None,
        cache_salt: str | None = None,
        lora: tuple[str, str] | None = None,
        namespace: str | None = None,
    ) -> LookupAnswer:
        """How many leading tokens of the prompt (``text`` or ``token_ids``) a fresh
        engine serving ``model`` would load from Redis: its full blocks before the last
        token that every cache group has, per namespace (only ``namespace`` if given),
        the largest answer first. Raises a ``LookupFailed`` subclass naming the reason."""
        if not isinstance(model, str) or not model:
            raise BadLookupRequest("'model' must be a non-empty string")
        if (text is None) == (token_ids is None):
            raise BadLookupRequest("give exactly one of 'prompt' (text) and 'token_ids'")
        if token_ids is not None and (
            not isinstance(token_ids, list | tuple)
            or not set(map(type, token_ids)) <= {int}  # bools and floats are not token ids
            or (token_ids and min(token_ids) < 0)
        ):
            raise BadLookupRequest("'token_ids' must be a list of non-negative integers")
        if text is not None and not isinstance(text, str):
            raise BadLookupRequest("'prompt' must be a string")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise BadLookupRequest("'cache_salt' must be a string")
        records = self.namespaces_of(model)
        if namespace is not None:
            records = [r for r in records if r.namespace == namespace]
            if not records:
                raise UnknownModel(f"namespace {namespace!r} does not serve model {model!r}")
        answers = []
        n_tokens = 0
        given = list(token_ids) if token_ids is not None else None
        by_tokenizer: dict[str, list[int]] = {}
        for rec in records:
            ids = given
            if ids is None:
                ids = by_tokenizer.get(rec.tokenizer)
                if ids is None:
                    ids = by_tokenizer[rec.tokenizer] = self.tokenize(rec, text or "")
            if len(ids) > MAX_PROMPT_TOKENS:
                raise BadLookupRequest(f"a prompt of {len(ids)} tokens is over {MAX_PROMPT_TOKENS}")
            n_tokens = len(ids)
            blocks = self._hit_blocks(rec, ids, cache_salt, lora)
            answers.append(
                NamespaceAnswer(rec.namespace, blocks * rec.block_size, blocks, rec.block_size)
            )
        answers.sort(key=lambda a: -a.cached_tokens)
        return LookupAnswer(model, n_tokens, answers[0].cached_tokens, tuple(answers))

    def _hasher(self, rec: NamespaceRecord) -> PromptHasher:
        h = self._hashers.get(rec.namespace)
        if h is None or h.record != rec:
            h = self._hashers[rec.namespace] = PromptHasher(rec)
        return h

    def _hit_blocks(
        self,
        rec: NamespaceRecord,
        ids: list[int],
        cache_salt: str | None,
        lora: tuple[str, str] | None,
    ) -> int:
        """Blocks of ``ids`` a fresh engine of ``rec`` would load (one round trip)."""
        max_blocks = (len(ids) - 1) // rec.block_size if ids else 0
        hashes = self._hasher(rec).block_hashes(ids, cache_salt=cache_salt, lora=lora)
        hashes = hashes[:max_blocks]
        if not hashes:
            return 0
        self._plane.warm_up()
        codec = BlockIdentityCodec(rec.namespace)
        groups: tuple[CacheGroupReach, ...] = rec.groups
        encoders = [
            self._plane.lookup_encoder(
                [codec.marker_prefix(g.group_id).encode()],
                refresh_ttl=False,
                hash_hex_len=2 * len(hashes[0]),
            )
            for g in groups
        ]
        cmds = [e.encode(h.hex().encode()) for h in hashes for e in encoders]
        replies = self._plane.lookup_blocks(cmds, len(cmds))
        if replies is None:
            raise CacheUnavailable(
                f"Redis ({self.settings.redacted_url}) did not answer the lookup within "
                f"lookup_timeout_s={self.settings.lookup_timeout_s}"
            )
        n_groups = len(groups)

        def present(b: int, pos: int) -> bool:
            return replies[b * n_groups + pos] == 1

        return rec.plans.longest_hit(0, len(hashes), present)

    def close(self) -> None:
        """Close the connections."""
        self._plane.close()
        if self._client is not None:
            self._client.close()
