"""Byte ranges between the engine's KV tensors and a staging object, and the
per-group templates an executor lowers blocks with."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    pass


class KVRange(NamedTuple):
    """One byte range of a transfer: engine memory at ``engine_address`` and the object
    at ``object_offset``, ``length`` bytes. Stores copy engine->object, loads the reverse."""

    engine_address: int
    object_offset: int
    length: int


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
