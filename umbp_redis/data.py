"""The UMBP data model: identities, layouts and plans as plain data.

Nothing here talks to Redis or holds engine state. The types describe vLLM's logical
KV objects (one object per block, cache group and model-parallel rank), the Redis keys
that name them, and the physical byte ranges a transfer executor copies between the
engine's KV tensors and a staging buffer. They can all be built and tested without a
server or a GPU.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, overload

import torch

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


from umbp_redis.keys import (
    _NAMESPACE_RE,
    KEY_PREFIX,
    DecodedKey,
    namespace_pattern,
    parse_key,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheSpec

CONNECTOR_NAME = "UMBPRedisConnector"


class KVLayoutError(ValueError):
    """The engine's KV tensors do not match the KV cache config they were planned from."""


# ---------------------------------------------------------------------------
# Ranks
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class RankTopology:
    """Model-parallel ranks that take part in one KV object, and this process's place.

    A logical block is stored as one object per rank namespace: each
    (tensor, prefill-context, decode-context, pipeline) rank holds its own shard.
    The decode-context rank is not independent: DCP reuses TP (and PCP) ranks, so
    it is derived from the TP and PCP ranks as vLLM builds its DCP groups.
    """

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    pcp_rank: int = 0
    pcp_size: int = 1
    dcp_rank: int = 0
    dcp_size: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "pcp", "dcp"):
            rank = getattr(self, f"{name}_rank")
            size = getattr(self, f"{name}_size")
            if not isinstance(size, int) or size <= 0:
                raise ValueError(f"RankTopology.{name}_size must be a positive int, got {size!r}")
            if not isinstance(rank, int) or not 0 <= rank < size:
                raise ValueError(
                    f"RankTopology.{name}_rank must satisfy 0 <= rank < {size}, got {rank!r}"
                )
        expected = self.dcp_rank_for(
            self.tp_rank, self.pcp_rank, self.tp_size, self.pcp_size, self.dcp_size
        )
        if self.dcp_rank != expected:
            raise ValueError(
                f"RankTopology.dcp_rank {self.dcp_rank} is inconsistent with tp_rank "
                f"{self.tp_rank} and pcp_rank {self.pcp_rank} (expected {expected})"
            )

    @staticmethod
    def dcp_rank_for(
        tp_rank: int, pcp_rank: int, tp_size: int, pcp_size: int, dcp_size: int
    ) -> int:
        """The DCP rank vLLM gives the process at ``tp_rank``/``pcp_rank``.

        With PCP off, DCP groups are runs of consecutive TP ranks; with PCP on, DCP
        is off, spans the PCP axis, or spans the whole TP x PCP axis.
        """
        if dcp_size == 1:
            return 0
        if pcp_size == 1:
            if tp_size % dcp_size:
                raise ValueError(f"tp_size={tp_size} must be divisible by dcp_size={dcp_size}")
            return tp_rank % dcp_size
        if dcp_size == pcp_size:
            return pcp_rank
        if dcp_size == tp_size * pcp_size:
            return tp_rank * pcp_size + pcp_rank
        raise ValueError(
            f"dcp_size={dcp_size} must be 1, pcp_size={pcp_size} or tp_size*pcp_size="
            f"{tp_size * pcp_size} when PCP is enabled"
        )

    @classmethod
    def from_vllm_config(
        cls,
        vllm_config: VllmConfig,
        *,
        tp_rank: int = 0,
        pp_rank: int = 0,
        pcp_rank: int = 0,
    ) -> RankTopology:
        """Sizes from ``vllm_config.parallel_config``; ranks as given (0 on the scheduler)."""
        pc = vllm_config.parallel_config
        tp = int(pc.tensor_parallel_size)
        pcp = int(getattr(pc, "prefill_context_parallel_size", 1) or 1)
        dcp = int(getattr(pc, "decode_context_parallel_size", 1) or 1)
        return cls(
            tp_rank=tp_rank,
            tp_size=tp,
            pp_rank=pp_rank,
            pp_size=int(pc.pipeline_parallel_size),
            pcp_rank=pcp_rank,
            pcp_size=pcp,
            dcp_rank=cls.dcp_rank_for(tp_rank, pcp_rank, tp, pcp, dcp),
            dcp_size=dcp,
        )

    def with_ranks(self, *, tp_rank: int, pp_rank: int, pcp_rank: int) -> RankTopology:
        """The same sizes seen from another process."""
        return dataclasses.replace(
            self,
            tp_rank=tp_rank,
            pp_rank=pp_rank,
            pcp_rank=pcp_rank,
            dcp_rank=self.dcp_rank_for(
                tp_rank, pcp_rank, self.tp_size, self.pcp_size, self.dcp_size
            ),
        )

    def rank_namespaces(self) -> tuple[RankTopology, ...]:
        """Every process of this topology, in (pp, pcp, tp) order."""
        return tuple(
            self.with_ranks(tp_rank=tp, pp_rank=pp, pcp_rank=pcp)
            for pp in range(self.pp_size)
            for pcp in range(self.pcp_size)
            for tp in range(self.tp_size)
        )

    @property
    def num_rank_namespaces(self) -> int:
        """How many processes hold a shard of each logical block."""
        return self.tp_size * self.pcp_size * self.pp_size

    def rank_label(self, *, tp_agnostic: bool = False) -> str:
        """The rank part of a key: ``tp{tp}:pcp{pcp}:dcp{dcp}:pp{pp}`` (``tp*`` if agnostic)."""
        tp = "*" if tp_agnostic else str(self.tp_rank)
        return f"tp{tp}:pcp{self.pcp_rank}:dcp{self.dcp_rank}:pp{self.pp_rank}"


# ---------------------------------------------------------------------------
# Namespaces
# ---------------------------------------------------------------------------


def _stable(value: Any) -> Any:
    """A JSON-able, order-stable rendering of config values (dtypes, enums, tuples)."""
    if isinstance(value, Mapping):
        return {str(k): _stable(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, list | tuple | set | frozenset):
        items = [_stable(v) for v in value]
        return sorted(items, key=repr) if isinstance(value, set | frozenset) else items
    if isinstance(value, bool | int | float | str) or value is None:
        return value
    if isinstance(value, torch.dtype):
        return str(value)
    if hasattr(value, "value") and hasattr(value, "name"):  # enums
        return f"{type(value).__name__}.{value.name}"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _spec_fingerprint(value)
    return repr(value)


def _layer_specs(group: KVCacheGroupSpec) -> dict[str, KVCacheSpec]:
    """Map each layer of a cache group to the spec describing its own pages."""
    spec = group.kv_cache_spec
    per_layer = getattr(spec, "kv_cache_specs", None)
    if isinstance(per_layer, Mapping):
        return {name: per_layer[name] for name in group.layer_names}
    return {name: spec for name in group.layer_names}


def _spec_fingerprint(spec: Any) -> dict[str, Any]:
    """Every field that shapes a layer's stored bytes, in a stable form."""
    out: dict[str, Any] = {"kind": type(spec).__name__}
    for f in dataclasses.fields(spec):
        out[f.name] = _stable(getattr(spec, f.name))
    return out


def _model_fingerprint(model_config: Any) -> dict[str, Any]:
    """Effective model settings that change the KV a checkpoint produces.

    ``hf_config`` already has ``hf_overrides`` applied, so overridden RoPE or attention
    settings separate engines that share a model path.
    """
    hf_config = getattr(model_config, "hf_config", None)
    hf = hf_config.to_dict() if hf_config is not None and hasattr(hf_config, "to_dict") else {}
    for noisy in ("_name_or_path", "transformers_version", "_commit_hash", "architectures_map"):
        hf.pop(noisy, None)
    return {
        "model": getattr(model_config, "model", None),
        "revision": getattr(model_config, "revision", None),
        "dtype": _stable(getattr(model_config, "dtype", None)),
        "quantization": _stable(getattr(model_config, "quantization", None)),
        "hf_config": _stable(hf),
    }


def _engine_may_load_foreign_kv(vllm_config: VllmConfig) -> bool:
    """Whether another connector of this engine may load KV vLLM's cache writer did not make.

    A MultiConnector hands each child a copy of the config holding only that child's
    ``kv_transfer_config``, so the engine's current config is read too when it is set.
    """
    configs = [vllm_config]
    try:
        from vllm.config import get_current_vllm_config_or_none

        current = get_current_vllm_config_or_none()
        if current is not None:
            configs.append(current)
    except ImportError:  # pragma: no cover - older vLLM
        pass
    for cfg in configs:
        ktc = getattr(cfg, "kv_transfer_config", None)
        if ktc is None or ktc.kv_connector != "MultiConnector":
            continue
        children = (ktc.kv_connector_extra_config or {}).get("connectors", [])
        for child in children:
            name = child.get("kv_connector") if isinstance(child, Mapping) else None
            role = child.get("kv_role", ktc.kv_role) if isinstance(child, Mapping) else None
            if name != CONNECTOR_NAME and role in ("kv_consumer", "kv_both"):
                return True
    return False


def namespace_inputs(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, weights: str | None = None
) -> dict[str, Any]:
    """Everything the derived namespace digests, as a JSON-able dict (for logs and docs).

    ``weights`` is the weights fingerprint the caller read (``umbp_redis.weights``):
    reading files is I/O, which this module does not do.
    """
    pc = vllm_config.parallel_config
    cc = vllm_config.cache_config
    groups = []
    for gid, group in enumerate(kv_cache_config.kv_cache_groups):
        groups.append(
            {
                "group": gid,
                "layers": {name: _spec_fingerprint(s) for name, s in _layer_specs(group).items()},
            }
        )
    return {
        "schema": KEY_PREFIX,
        "model": _model_fingerprint(vllm_config.model_config),
        "weights": weights,
        "block_hash_algo": str(getattr(cc, "prefix_caching_hash_algo", "sha256")),
        "cache_dtype": str(getattr(cc, "cache_dtype", "auto")),
        "kv_cache_layout": getattr(kv_cache_config, "kv_cache_layout", None),
        "hash_block_size": getattr(kv_cache_config, "hash_block_size", None),
        "groups": groups,
        "parallel": {
            "tp": int(pc.tensor_parallel_size),
            "pp": int(pc.pipeline_parallel_size),
            "pcp": int(getattr(pc, "prefill_context_parallel_size", 1) or 1),
            "dcp": int(getattr(pc, "decode_context_parallel_size", 1) or 1),
        },
        "foreign_kv": _engine_may_load_foreign_kv(vllm_config),
    }


@dataclass(frozen=True)
class UMBPNamespace:
    """Compatibility namespace of stored objects: engines share objects only within one.

    ``value`` is either the operator's explicit ``key_namespace`` or a 16-hex-digit
    digest of everything that changes the bytes an engine would store.
    """

    value: str
    derived: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.value, str) or not _NAMESPACE_RE.match(self.value):
            raise ValueError(
                "key_namespace must be 1-64 characters of letters, digits, '_', '.' or '-' "
                f"(no ':'), got {self.value!r}"
            )

    def __str__(self) -> str:
        return self.value

    @classmethod
    def configured(cls, vllm_config: VllmConfig) -> UMBPNamespace | None:
        """Return the explicit ``key_namespace`` of the connector config, or None when derived."""
        ktc = getattr(vllm_config, "kv_transfer_config", None)
        extra = (getattr(ktc, "kv_connector_extra_config", None) or {}) if ktc else {}
        value = extra.get("key_namespace")
        if value in (None, ""):
            return None
        return cls(value=value, derived=False)

    @classmethod
    def from_vllm_config(
        cls, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, weights: str | None = None
    ) -> UMBPNamespace:
        """Derive the namespace from a worker's per-layer KV cache config.

        The same inputs give the same value in every process; any change in one of
        them (model settings, revision, weights fingerprint, block hash algorithm,
        specs, layout, parallel sizes, foreign KV) gives another. The scheduler's config
        flattens some spec groups, so the scheduler adopts what its workers report
        rather than deriving its own.
        """
        inputs = namespace_inputs(vllm_config, kv_cache_config, weights)
        blob = json.dumps(inputs, sort_keys=True)
        return cls(value=hashlib.sha256(blob.encode()).hexdigest()[:16], derived=True)

    @classmethod
    def resolve(
        cls, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, weights: str | None = None
    ) -> UMBPNamespace:
        """The configured namespace if there is one, else the derived one."""
        return cls.configured(vllm_config) or cls.from_vllm_config(
            vllm_config, kv_cache_config, weights
        )


# ---------------------------------------------------------------------------
# Keys
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class BlockIdentityCodec:
    """Stable rank-local keys from vLLM block hashes.

    ``umbp:vllm:v1:{namespace}:tp{tp}:pcp{pcp}:dcp{dcp}:pp{pp}:g{group_id}:{hash hex}``.
    Groups in ``replicated_groups`` get one TP-agnostic key (``tp*``) that every TP
    rank loads and only TP rank 0 stores. Keys never contain a physical block id, a
    request id or a DP rank, so any engine of the namespace can find them.
    """

    namespace: str
    topology: RankTopology = field(default_factory=RankTopology)
    replicated_groups: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        UMBPNamespace(self.namespace)  # validates the characters
        object.__setattr__(self, "replicated_groups", frozenset(self.replicated_groups))
        object.__setattr__(self, "_prefixes", {})

    def key_prefixes(self, group_id: int) -> tuple[str, ...]:
        """Every rank's key of ``group_id`` up to the block hash, built once per codec.

        ``prefix + block_hash.hex()`` is that rank's key: the hot path concatenates
        strings and validates nothing (the parts were validated here, once).
        """
        cache: dict[int, tuple[str, ...]] = self._prefixes  # type: ignore[attr-defined]
        out = cache.get(group_id)
        if out is None:
            if not isinstance(group_id, int) or group_id < 0:
                raise ValueError(f"group_id must be a non-negative int, got {group_id!r}")
            agnostic = group_id in self.replicated_groups
            labels = dict.fromkeys(
                r.rank_label(tp_agnostic=agnostic) for r in self.topology.rank_namespaces()
            )
            out = tuple(f"{KEY_PREFIX}:{self.namespace}:{lb}:g{group_id}:" for lb in labels)
            cache[group_id] = out
        return out

    def key(self, block_hash: bytes, group_id: int, rank: RankTopology | None = None) -> str:
        """The key of ``block_hash`` in ``group_id`` for ``rank`` (default: this process)."""
        if not isinstance(block_hash, bytes | bytearray) or not block_hash:
            raise TypeError(f"block_hash must be non-empty bytes, got {type(block_hash).__name__}")
        r = rank or self.topology
        label = r.rank_label(tp_agnostic=group_id in self.replicated_groups)
        return f"{KEY_PREFIX}:{self.namespace}:{label}:g{group_id}:{bytes(block_hash).hex()}"

    def rank_keys(self, block_hash: bytes, group_id: int) -> tuple[str, ...]:
        """Every rank's key of one logical block; the block is a hit only if all exist."""
        hx = bytes(block_hash).hex()
        return tuple(p + hx for p in self.key_prefixes(group_id))

    def keys_per_object(self, topology: RankTopology, group_id: int) -> int:
        """Number of rank keys that together hold one logical block."""
        n = topology.num_rank_namespaces
        return n // topology.tp_size if group_id in self.replicated_groups else n

    def stores(self, group_id: int) -> bool:
        """Whether this process writes its key of ``group_id`` (replicated: TP rank 0 only)."""
        return group_id not in self.replicated_groups or self.topology.tp_rank == 0


def tp_replicated_group_ids(config: KVCacheConfig, topology: RankTopology) -> frozenset[int]:
    """Groups whose blocks are byte-identical on every TP rank.

    Every layer of the group must declare a single TP shard (``max_tp_shards == 1``,
    e.g. MLA latents and sparse indexers, or a TP-replicated Mamba state); context
    parallelism shards such caches by token, so it opts out.
    """
    if topology.pcp_size > 1 or topology.dcp_size > 1:
        return frozenset()
    out = set()
    for gid, group in enumerate(config.kv_cache_groups):
        specs = list(_layer_specs(group).values())
        if specs and all(
            getattr(s, "max_tp_shards", None) == 1 or getattr(s, "tp_replicated", False)
            for s in specs
        ):
            out.add(gid)
    return frozenset(out)


# ---------------------------------------------------------------------------
# Layouts and plans
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class KVRegion:
    """One layer's page inside a rank-local object.

    The page of engine block ``b`` starts at ``base + b * block_stride`` and consists
    of ``segments`` (offset from the block start, length) runs, in memory order; they
    are packed back to back at ``object_offset`` in the object. One segment at offset
    0 means the page is one contiguous run.
    """

    layer_name: str
    group_id: int
    object_offset: int
    length: int
    block_stride: int
    segments: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        if sum(n for _, n in self.segments) != self.length:
            raise ValueError("KVRegion segments must add up to its length")


@dataclass(frozen=True)
class KVLayoutDescriptor:
    """Backend-neutral description of one rank-local object layout (one cache group).

    ``fingerprint`` (16 bytes) digests the regions and sizes: an object written
    under another layout never matches it, so it is never scattered into this engine.
    """

    group_id: int
    regions: tuple[KVRegion, ...]
    object_size: int
    fingerprint: bytes

    @property
    def fingerprint_hex(self) -> str:
        """The fingerprint as 32 hex digits."""
        return self.fingerprint.hex()

    @staticmethod
    def compute_fingerprint(group_id: int, regions: Sequence[KVRegion], object_size: int) -> bytes:
        """Digest of what decides where each stored byte goes (not of addresses)."""
        desc = [(r.layer_name, r.group_id, r.object_offset, r.length, r.segments) for r in regions]
        blob = json.dumps([group_id, object_size, desc]).encode()
        return hashlib.blake2b(blob, digest_size=16).digest()


class KVRange(NamedTuple):
    """One byte range of a transfer: engine memory at ``engine_address`` and the object
    at ``object_offset``, ``length`` bytes. Stores copy engine->object, loads the reverse."""

    engine_address: int
    object_offset: int
    length: int


@dataclass(frozen=True)
class BlockTransferPlan:
    """One complete logical block transfer.

    The logical part (block hash, group, engine block id, request) comes from the
    scheduler; the physical part (key, ranges, size, fingerprint) is filled in on the
    worker by ``KVLayoutPlanner.plan_for_block``.
    """

    block_id: int
    group_id: int
    key: str = ""
    block_hash: bytes = b""
    request_id: str | None = None
    object_size: int = 0
    layout_fingerprint: bytes = b""
    ranges: tuple[KVRange, ...] = ()

    @property
    def lowered(self) -> bool:
        """Whether the physical ranges are present."""
        return bool(self.ranges)


@dataclass(frozen=True)
class KVRangeRun:
    """``count`` ranges of a template that one strided copy moves.

    Piece ``k`` (``0 <= k < count``) of engine block ``b`` is ``length`` bytes at engine
    address ``engine_base + b * block_stride + k * step`` and at
    ``object_offset + k * length`` in the object: the pieces are equally spaced in the
    engine (``step >= length``, so they never overlap) and back to back in the object.
    """

    engine_base: int
    block_stride: int
    step: int
    count: int
    length: int
    object_offset: int

    def pieces(self) -> list[KVRangeRun]:
        """The run as ``count`` runs of one range each."""
        return [
            KVRangeRun(
                self.engine_base + k * self.step,
                self.block_stride,
                self.length,
                1,
                self.length,
                self.object_offset + k * self.length,
            )
            for k in range(self.count)
        ]


@dataclass(frozen=True)
class KVRangeTemplate:
    """Every block's transfer ranges of one cache group, as columns.

    Range ``i`` of engine block ``b`` is ``lengths[i]`` bytes at engine address
    ``engine_bases[i] + b * block_strides[i]`` and at ``object_offsets[i]`` in the
    object. Ranges are in object order and tile the object exactly. Batched
    executors lower many blocks at once from these columns instead of a plan each.
    """

    group_id: int
    object_size: int
    layout_fingerprint: bytes
    engine_bases: tuple[int, ...]
    block_strides: tuple[int, ...]
    object_offsets: tuple[int, ...]
    lengths: tuple[int, ...]

    def __post_init__(self) -> None:
        n = len(self.engine_bases)
        if not (len(self.block_strides) == len(self.object_offsets) == len(self.lengths) == n):
            raise ValueError("KVRangeTemplate columns differ in length")
        end = 0
        for off, length in zip(self.object_offsets, self.lengths, strict=True):
            if off != end or length <= 0:
                raise ValueError("KVRangeTemplate ranges must tile the object in order")
            end += length
        if end != self.object_size:
            raise ValueError(
                f"KVRangeTemplate ranges cover {end} bytes of a {self.object_size}-byte object"
            )

    def __len__(self) -> int:
        return len(self.lengths)

    def ranges_for(self, block_id: int) -> tuple[KVRange, ...]:
        """The ranges of one engine block."""
        return tuple(
            KVRange(base + block_id * stride, off, length)
            for base, stride, off, length in zip(
                self.engine_bases,
                self.block_strides,
                self.object_offsets,
                self.lengths,
                strict=True,
            )
        )

    def runs(self) -> tuple[KVRangeRun, ...]:
        """The ranges merged into strided runs, in object order.

        Consecutive ranges join a run while they have its length and block stride and
        follow the previous range at the run's step (at least the length). vLLM's
        shared-tensor layouts (all layers of a block one layer stride apart) become one
        run a block, so an executor makes one copy call where it made one a layer.
        """
        runs: list[KVRangeRun] = []
        for base, stride, off, length in zip(
            self.engine_bases, self.block_strides, self.object_offsets, self.lengths, strict=True
        ):
            if runs:
                last = runs[-1]
                step = base - (last.engine_base + (last.count - 1) * last.step)
                if (
                    length == last.length
                    and stride == last.block_stride
                    and step >= length
                    and (last.count == 1 or step == last.step)
                ):
                    runs[-1] = dataclasses.replace(last, step=step, count=last.count + 1)
                    continue
            runs.append(KVRangeRun(base, stride, length, 1, length, off))
        return tuple(runs)

    def chunked(self, max_bytes: int) -> KVRangeTemplate:
        """The same bytes with no range longer than ``max_bytes`` (split in order).

        Pieces start at multiples of ``max_bytes`` from their range's start, so a
        range's alignment carries over to its pieces when ``max_bytes`` is a multiple
        of it. Executors use this to spread one long range over many workers.
        """
        if max_bytes <= 0:
            raise ValueError("max_bytes must be positive")
        cols: tuple[list[int], list[int], list[int], list[int]] = ([], [], [], [])
        for base, stride, off, length in zip(
            self.engine_bases, self.block_strides, self.object_offsets, self.lengths, strict=True
        ):
            for piece in range(0, length, max_bytes):
                cols[0].append(base + piece)
                cols[1].append(stride)
                cols[2].append(off + piece)
                cols[3].append(min(max_bytes, length - piece))
        return dataclasses.replace(
            self,
            engine_bases=tuple(cols[0]),
            block_strides=tuple(cols[1]),
            object_offsets=tuple(cols[2]),
            lengths=tuple(cols[3]),
        )


@dataclass(frozen=True)
class StagingCopyPlan:
    """Which engine blocks are copied to (stores) or from (loads) which staging slots.

    Columnar: entry ``i`` moves engine block ``block_ids[i]`` of cache group
    ``group_ids[i]`` to or from staging slot ``slots[i]``. Slots are distinct.
    """

    group_ids: tuple[int, ...]
    block_ids: tuple[int, ...]
    slots: tuple[int, ...]

    def __post_init__(self) -> None:
        n = len(self.group_ids)
        if len(self.block_ids) != n or len(self.slots) != n:
            raise ValueError(
                f"StagingCopyPlan columns differ in length: {n} groups, "
                f"{len(self.block_ids)} blocks, {len(self.slots)} slots"
            )
        if len(set(self.slots)) != n:
            raise ValueError("StagingCopyPlan slots must be distinct")

    def __len__(self) -> int:
        return len(self.slots)

    def by_group(self) -> dict[int, tuple[tuple[int, ...], tuple[int, ...]]]:
        """(block ids, slots) of each cache group, in plan order."""
        out: dict[int, tuple[list[int], list[int]]] = {}
        for gid, bid, slot in zip(self.group_ids, self.block_ids, self.slots, strict=True):
            blocks, slots = out.setdefault(gid, ([], []))
            blocks.append(bid)
            slots.append(slot)
        return {g: (tuple(b), tuple(s)) for g, (b, s) in out.items()}


@dataclass(frozen=True)
class _BlockBatch(Sequence[BlockTransferPlan]):
    """Columnar whole-block transfers of one request; request data shared by all."""

    request_id: str
    block_hashes: tuple[bytes, ...]
    block_ids: tuple[int, ...]
    group_ids: tuple[int, ...]
    event_id: int = 0

    def __post_init__(self) -> None:
        n = len(self.block_hashes)
        if len(self.block_ids) != n or len(self.group_ids) != n:
            raise ValueError(
                f"{type(self).__name__} columns differ in length: {n} hashes, "
                f"{len(self.block_ids)} block ids, {len(self.group_ids)} group ids"
            )

    def __len__(self) -> int:
        return len(self.block_ids)

    @overload
    def __getitem__(self, i: int) -> BlockTransferPlan: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[BlockTransferPlan]: ...

    def __getitem__(self, i: int | slice) -> BlockTransferPlan | Sequence[BlockTransferPlan]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return BlockTransferPlan(
            block_id=self.block_ids[i],
            group_id=self.group_ids[i],
            block_hash=self.block_hashes[i],
            request_id=self.request_id,
        )

    def __iter__(self) -> Iterator[BlockTransferPlan]:
        for i in range(len(self)):
            yield self[i]


@dataclass(frozen=True)
class BlockLoadBatch(_BlockBatch):
    """Whole-block loads (Redis -> engine) of one request.

    ``fail_all``: the scheduler could not plan this load after promising its tokens to
    vLLM; the workers report every block as not loaded, so vLLM recomputes them.
    """

    fail_all: bool = False


@dataclass(frozen=True)
class BlockStoreBatch(_BlockBatch):
    """Whole-block stores (engine -> Redis) of one request; ``event_id`` names the store
    event the workers report back."""


def _block_dim(tensor: torch.Tensor, num_blocks: int) -> int:
    """Which dim of a layer tensor indexes blocks: 0, or 1 for K/V-outer 5-D layouts."""
    shape = tuple(tensor.shape)
    if shape[0] % num_blocks == 0 and not (len(shape) == 5 and shape[0] == 2 and num_blocks != 2):
        return 0
    if len(shape) >= 2 and shape[0] == 2 and shape[1] % num_blocks == 0:
        return 1
    raise KVLayoutError(
        f"no dim of shape {shape} indexes the config's {num_blocks} blocks "
        "(expected dim 0, or dim 1 of a (2, num_blocks, ...) K/V-outer layout)"
    )


def _page_segments(
    tensor: torch.Tensor, num_blocks: int
) -> tuple[int, tuple[tuple[int, int], ...]]:
    """Block stride and byte (offset, length) runs of one block's page, in memory order.

    The page of block ``b`` is every element whose block index is ``b`` (or, when a
    block spans several kernel blocks, ``b*r .. b*r+r-1``). Its dims are sorted by
    stride and merged where contiguous, so a contiguous page is one run and a page
    whose heads lie apart (LHBNC) or whose K and V lie apart becomes several.
    """
    esz = tensor.element_size()
    bdim = _block_dim(tensor, num_blocks)
    shape = list(tensor.shape)
    strides = [s * esz for s in tensor.stride()]
    ratio = shape[bdim] // num_blocks
    block_stride = strides[bdim] * ratio
    dims = [(shape[i], strides[i]) for i in range(len(shape)) if i != bdim and shape[i] > 1]
    if ratio > 1:
        dims.append((ratio, strides[bdim]))
    dims.sort(key=lambda d: d[1], reverse=True)
    merged: list[list[int]] = []
    for size, stride in dims:
        if merged and merged[-1][1] == stride * size:
            merged[-1][0] *= size
            merged[-1][1] = stride
        else:
            merged.append([size, stride])
    run = esz
    if merged and merged[-1][1] == esz:
        run = merged[-1][0] * esz
        merged.pop()
    offsets = [0]
    for size, stride in merged:
        offsets = [o + k * stride for o in offsets for k in range(size)]
    offsets.sort()
    segs: list[tuple[int, int]] = []
    for o in offsets:
        if segs and segs[-1][0] + segs[-1][1] == o:
            segs[-1] = (segs[-1][0], segs[-1][1] + run)
        else:
            segs.append((o, run))
    return block_stride, tuple(segs)


def _expected_page_bytes(spec: Any) -> int | None:
    for attr in ("real_page_size_bytes", "page_size_bytes"):
        try:
            value = getattr(spec, attr)
        except (NotImplementedError, AssertionError, AttributeError, TypeError):
            continue
        if isinstance(value, int):
            return value
    return None


class KVLayoutPlanner:
    """Create a deterministic all-layer object layout from vLLM's ``KVCacheConfig``.

    Each transferable cache group gets one object layout: every layer's page of one
    block, in the group's layer order, back to back. ``register_kv_caches`` derives the
    pages' runs from the live tensors' strides and checks them against the config.
    """

    def __init__(self, kv_cache_config: KVCacheConfig) -> None:
        self.kv_cache_config = kv_cache_config
        self.num_blocks = int(kv_cache_config.num_blocks)
        self.group_layers: dict[int, tuple[str, ...]] = {}
        self.layer_specs: dict[str, Any] = {}
        self.layer_group: dict[str, int] = {}
        for gid, group in enumerate(kv_cache_config.kv_cache_groups):
            if not getattr(group, "enable_kv_transfer", True):
                continue
            specs = _layer_specs(group)
            self.group_layers[gid] = tuple(group.layer_names)
            for name, spec in specs.items():
                self.layer_specs[name] = spec
                self.layer_group[name] = gid
        self.tensor_block_stride: dict[str, int] = {}
        for kvt in kv_cache_config.kv_cache_tensors:
            for name in kvt.layers:
                self.tensor_block_stride[name] = int(kvt.block_stride)
        self.layouts: dict[int, KVLayoutDescriptor] = {}
        self.base_addresses: dict[str, int] = {}

    @property
    def group_ids(self) -> tuple[int, ...]:
        """The groups with an object layout."""
        return tuple(self.group_layers)

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> dict[str, int]:
        """Capture stable base addresses and page runs of the planned KV regions.

        Returns the base address (block 0) of every planned layer. Raises
        ``KVLayoutError`` naming the layer when a tensor is missing, has another dtype,
        block count, page size or block stride than the config describes.
        """
        bases: dict[str, int] = {}
        layouts: dict[int, KVLayoutDescriptor] = {}
        for gid, names in self.group_layers.items():
            regions = []
            offset = 0
            for name in names:
                tensor = kv_caches.get(name)
                if tensor is None:
                    raise KVLayoutError(
                        f"layer {name!r} of KV cache group {gid} has no registered tensor"
                    )
                self._check(name, tensor)
                block_stride, segments = _page_segments(tensor, self.num_blocks)
                length = sum(n for _, n in segments)
                expected = _expected_page_bytes(self.layer_specs[name])
                if expected is not None and expected != length:
                    raise KVLayoutError(
                        f"layer {name!r}: a block's page holds {length} bytes in tensor of shape "
                        f"{tuple(tensor.shape)}, but its spec says {expected}"
                    )
                cfg_stride = self.tensor_block_stride.get(name)
                if cfg_stride is not None and cfg_stride != block_stride:
                    raise KVLayoutError(
                        f"layer {name!r}: block stride {block_stride} bytes does not match "
                        f"KVCacheTensor.block_stride {cfg_stride}"
                    )
                regions.append(
                    KVRegion(
                        layer_name=name,
                        group_id=gid,
                        object_offset=offset,
                        length=length,
                        block_stride=block_stride,
                        segments=segments,
                    )
                )
                offset += length
                bases[name] = int(tensor.data_ptr())
            fp = KVLayoutDescriptor.compute_fingerprint(gid, regions, offset)
            layouts[gid] = KVLayoutDescriptor(gid, tuple(regions), offset, fp)
        self.layouts = layouts
        self.base_addresses = bases
        return dict(bases)

    def _check(self, name: str, tensor: torch.Tensor) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise KVLayoutError(f"layer {name!r}: expected a torch.Tensor, got {type(tensor)}")
        spec_dtype = getattr(self.layer_specs[name], "dtype", None)
        if (
            isinstance(spec_dtype, torch.dtype)
            and tensor.element_size() != torch.empty((), dtype=spec_dtype).element_size()
        ):
            raise KVLayoutError(
                f"layer {name!r}: tensor dtype {tensor.dtype} does not match spec dtype "
                f"{spec_dtype}"
            )
        _block_dim(tensor, self.num_blocks)

    def layout(self, group_id: int) -> KVLayoutDescriptor:
        """The object layout of ``group_id`` (after ``register_kv_caches``)."""
        try:
            return self.layouts[group_id]
        except KeyError:
            raise KVLayoutError(
                f"no object layout for group {group_id}: registered groups are "
                f"{sorted(self.layouts)}"
            ) from None

    def range_template(self, group_id: int, base_addresses: Mapping[str, int]) -> KVRangeTemplate:
        """The ranges of every block of ``group_id``, as addresses of block 0 plus strides.

        Runs adjacent both in engine memory and in the object, with the same block
        stride, are coalesced (for every block at once), so a block-outermost layout
        whose layers lie side by side is one range per block.
        """
        layout = self.layout(group_id)
        bases: list[int] = []
        strides: list[int] = []
        offsets: list[int] = []
        lengths: list[int] = []
        for region in layout.regions:
            start = base_addresses[region.layer_name]
            obj = region.object_offset
            for seg_off, seg_len in region.segments:
                addr = start + seg_off
                if (
                    lengths
                    and strides[-1] == region.block_stride
                    and bases[-1] + lengths[-1] == addr
                    and offsets[-1] + lengths[-1] == obj
                ):
                    lengths[-1] += seg_len
                else:
                    bases.append(addr)
                    strides.append(region.block_stride)
                    offsets.append(obj)
                    lengths.append(seg_len)
                obj += seg_len
        return KVRangeTemplate(
            group_id=group_id,
            object_size=layout.object_size,
            layout_fingerprint=layout.fingerprint,
            engine_bases=tuple(bases),
            block_strides=tuple(strides),
            object_offsets=tuple(offsets),
            lengths=tuple(lengths),
        )

    def plan_for_block(
        self,
        key: str,
        block_id: int,
        base_addresses: Mapping[str, int],
        *,
        group_id: int | None = None,
        request_id: str | None = None,
        block_hash: bytes = b"",
        lower: bool = True,
    ) -> BlockTransferPlan:
        """Lower one engine block into a deterministic scatter/gather plan.

        The ranges are ``range_template(group_id, base_addresses).ranges_for(block_id)``,
        so this plan and the batched executors' copies are the same bytes. With
        ``lower=False`` the plan has no ranges (key, size and fingerprint only), for
        executors that copy whole batches from the template.
        """
        if group_id is None:
            if len(self.layouts) != 1:
                raise KVLayoutError("group_id is required when there are several cache groups")
            group_id = next(iter(self.layouts))
        layout = self.layout(group_id)
        if not 0 <= block_id < self.num_blocks:
            raise KVLayoutError(f"block id {block_id} outside 0..{self.num_blocks - 1}")
        ranges = self.range_template(group_id, base_addresses).ranges_for(block_id) if lower else ()
        return BlockTransferPlan(
            block_id=block_id,
            group_id=group_id,
            key=key,
            block_hash=block_hash,
            request_id=request_id,
            object_size=layout.object_size,
            layout_fingerprint=layout.fingerprint,
            ranges=tuple(ranges),
        )


# ---------------------------------------------------------------------------
# Request and transfer state
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class LoadSpec:
    """Scheduler decision for one externally loaded prefix.

    ``local_tokens`` are already computed (vLLM prefix cache), ``external_tokens`` is
    the block-aligned prefix present in Redis; the difference is loaded.
    """

    local_tokens: int
    external_tokens: int
    load_async: bool = True

    def __post_init__(self) -> None:
        if self.local_tokens < 0 or self.external_tokens < self.local_tokens:
            raise ValueError(
                f"LoadSpec needs 0 <= local_tokens <= external_tokens, got "
                f"{self.local_tokens} and {self.external_tokens}"
            )

    @property
    def tokens_to_load(self) -> int:
        """Tokens the connector loads beyond the local prefix hit."""
        return self.external_tokens - self.local_tokens


@dataclass
class RequestTracker:
    """Core request state shared by every runtime mode (scheduler side)."""

    request_id: str
    block_ids: tuple[list[int], ...] = ()
    num_saved_tokens: int = 0
    num_loaded_tokens: int = 0
    preempted: bool = False

    def mark_saved(self, token_count: int, block_size: int) -> int:
        """Advance the save watermark to the last complete block boundary of ``token_count``.

        Never moves backwards; returns the watermark (in tokens) after the call.
        """
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        boundary = (max(0, token_count) // block_size) * block_size
        if boundary > self.num_saved_tokens:
            self.num_saved_tokens = boundary
        return self.num_saved_tokens

    def append_blocks(self, new_block_ids: Sequence[Sequence[int]]) -> None:
        """Extend each group's block table with newly allocated blocks."""
        if not self.block_ids:
            self.block_ids = tuple([] for _ in new_block_ids)
        for table, new in zip(self.block_ids, new_block_ids, strict=True):
            table.extend(new)

    def replace_blocks(self, block_ids: Sequence[Sequence[int]]) -> None:
        """Replace stale pre-preemption tables with the resumed request's full tables."""
        self.block_ids = tuple(list(ids) for ids in block_ids)
        self.preempted = False


PENDING, DONE, FAILED = "pending", "done", "failed"


@dataclass
class TransferJobState:
    """Per-key completion state of one job; one failed key does not fail its siblings."""

    job_id: int
    keys: tuple[str, ...]
    status: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for k in self.keys:
            self.status.setdefault(k, PENDING)

    def mark(self, key: str, ok: bool) -> None:
        """Record that ``key`` finished (``ok``) or failed; unknown keys are an error."""
        if key not in self.status:
            raise KeyError(f"key {key!r} is not part of job {self.job_id}")
        self.status[key] = DONE if ok else FAILED

    @property
    def failed_keys(self) -> frozenset[str]:
        """Keys that failed."""
        return frozenset(k for k, s in self.status.items() if s == FAILED)

    @property
    def done_keys(self) -> frozenset[str]:
        """Keys that finished."""
        return frozenset(k for k, s in self.status.items() if s == DONE)

    @property
    def is_terminal(self) -> bool:
        """Every key finished or failed."""
        return all(s != PENDING for s in self.status.values())


@dataclass(frozen=True)
class StoreEventResult:
    """How many workers finished one store event, and which keys failed on any of them."""

    event_id: int
    finished_workers: int = 1
    failed_keys: frozenset[str] = frozenset()

    def merge(self, other: StoreEventResult) -> StoreEventResult:
        """Combine two reports of the same event."""
        if other.event_id != self.event_id:
            raise ValueError("cannot merge results of different store events")
        return StoreEventResult(
            self.event_id,
            self.finished_workers + other.finished_workers,
            self.failed_keys | other.failed_keys,
        )


# ---------------------------------------------------------------------------
# Metadata crossing process boundaries
# ---------------------------------------------------------------------------


@dataclass
class UMBPConnectorMetadata(KVConnectorMetadata):
    """Scheduler-to-worker plans for one engine step.

    ``loads``/``stores`` are the step's batches; ``cancelled_requests`` are preempted or
    aborted requests whose pending transfers the workers drop.
    """

    loads: list[BlockLoadBatch] = field(default_factory=list)
    stores: list[BlockStoreBatch] = field(default_factory=list)
    cancelled_requests: list[str] = field(default_factory=list)
    load_async: bool = True

    @property
    def is_empty(self) -> bool:
        """Nothing to do this step."""
        return not (self.loads or self.stores or self.cancelled_requests)


@dataclass
class UMBPConnectorWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker completions of one step, aggregated across ranks."""

    store_results: dict[int, StoreEventResult] = field(default_factory=dict)
    failed_load_requests: set[str] = field(default_factory=set)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> UMBPConnectorWorkerMetadata:
        """Merge another rank's completions into a new object (neither input changes)."""
        if not isinstance(other, UMBPConnectorWorkerMetadata):
            raise TypeError(f"cannot aggregate with {type(other).__name__}")
        merged = dict(self.store_results)
        for eid, res in other.store_results.items():
            merged[eid] = merged[eid].merge(res) if eid in merged else res
        return UMBPConnectorWorkerMetadata(
            merged, set(self.failed_load_requests) | set(other.failed_load_requests)
        )


@dataclass
class UMBPHandshakeMetadata(KVConnectorHandshakeMetadata):
    """Namespace a worker derived, reported to the scheduler at startup."""

    namespace: str
    topology: RankTopology
    layout_fingerprints: dict[int, str] = field(default_factory=dict)
    object_sizes: dict[int, int] = field(default_factory=dict)


def cdiv(a: int, b: int) -> int:
    """Ceiling division."""
    return -(-a // b)


__all__ = [
    "KEY_PREFIX",
    "BlockIdentityCodec",
    "BlockLoadBatch",
    "BlockStoreBatch",
    "BlockTransferPlan",
    "DecodedKey",
    "KVLayoutDescriptor",
    "KVLayoutError",
    "KVLayoutPlanner",
    "KVRange",
    "KVRegion",
    "LoadSpec",
    "RankTopology",
    "RequestTracker",
    "StoreEventResult",
    "TransferJobState",
    "UMBPConnectorMetadata",
    "UMBPConnectorWorkerMetadata",
    "UMBPHandshakeMetadata",
    "UMBPNamespace",
    "namespace_inputs",
    "namespace_pattern",
    "parse_key",
    "tp_replicated_group_ids",
]
