"""Object layouts planned from the KV cache config and checked against the live
tensors (strides, never an assumed shape)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from umbp_redis.data.namespace import layer_specs
from umbp_redis.data.parts import split_layers
from umbp_redis.data.plans import BlockTransferPlan
from umbp_redis.data.ranges import KVRangeTemplate

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig


class KVLayoutError(ValueError):
    """The engine's KV tensors do not match the KV cache config they were planned from."""


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

    def part_layers(self) -> tuple[tuple[str, ...], ...]:
        """The layers of each part the object is stored in, in object order (see
        ``umbp_redis.data.parts``)."""
        layers = list(dict.fromkeys(r.layer_name for r in self.regions))
        return split_layers(layers, self.object_size)

    def part_lengths(self) -> tuple[int, ...]:
        """The bytes of each part of ``part_layers`` (they add up to ``object_size``)."""
        size: dict[str, int] = {}
        for r in self.regions:
            size[r.layer_name] = size.get(r.layer_name, 0) + r.length
        return tuple(sum(size[name] for name in part) for part in self.part_layers())

    def layer_parts(self) -> dict[str, int]:
        """Which part of ``part_layers`` holds each layer."""
        return {name: i for i, part in enumerate(self.part_layers()) for name in part}

    @staticmethod
    def compute_fingerprint(group_id: int, regions: Sequence[KVRegion], object_size: int) -> bytes:
        """Digest of what decides where each stored byte goes (not of addresses)."""
        desc = [(r.layer_name, r.group_id, r.object_offset, r.length, r.segments) for r in regions]
        blob = json.dumps([group_id, object_size, desc]).encode()
        return hashlib.blake2b(blob, digest_size=16).digest()


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
            if not group.enable_kv_transfer:
                continue
            specs = layer_specs(group)
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
