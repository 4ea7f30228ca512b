"""GPU gather/scatter between CUDA KV blocks and pinned host staging, with a CuPy kernel.

``CupyBlockCopier`` moves a whole batch with one launch of ``umbp_copy_chunks``
(``block_copy.cu``) per cache group, with no Python loop over regions:

- each group's ``KVRangeTemplate`` is split into chunks of at most ``chunk_bytes`` and
  uploaded to the device once; a launch gets only the batch's (block id, slot) pairs;
- the kernel reads and writes pinned staging directly, at the device address CUDA
  reports for it (the host address itself under unified addressing);
- gathers run on a store stream that first waits on an event recorded on the engine's
  stream (so they read what the forward pass wrote); the engine's stream never waits
  for them, so the next forward pass overlaps the copy (the worker keeps the source
  blocks pinned until the gather's handle is ``done``);
- scatters run on a load stream after the ``engine_point`` event the worker recorded
  when it started the load; their handle's ``wait`` returns once the bytes are in.

Importing this module needs no CuPy: it is imported when the copier is built, and a
missing CuPy or a kernel that does not compile raises ``CopyBackendUnavailable``.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from importlib import resources
from typing import Any

import numpy as np
import torch

from umbp_redis.data import KVRangeTemplate, StagingCopyPlan
from umbp_redis.engine.copy.interface import CopyBackendUnavailable
from umbp_redis.engine.copy.torch_copy import checked_groups
from umbp_redis.engine.staging import StagingPool

KERNEL_FILE = "block_copy.cu"
KERNEL_NAME = "umbp_copy_chunks"
# Longest piece one CTA copies: splits a 2 MiB object over 128 CTAs.
CHUNK_BYTES = 16 * 1024
THREADS_PER_CTA = 256
MAX_GRID_Y = 65535  # CUDA's limit on gridDim.y (entries per launch)


def kernel_source() -> str:
    """The CUDA C++ source of the copy kernel shipped with the package."""
    return (
        resources.files(__package__ or "umbp_redis.engine.copy").joinpath(KERNEL_FILE).read_text()
    )


def chunk_table(template: KVRangeTemplate, chunk_bytes: int = CHUNK_BYTES) -> np.ndarray:
    """The kernel's chunk table of ``template``: int64 of shape (4, n_chunks).

    Rows: engine address of block 0, block stride, object offset, length.
    """
    chunks = template.chunked(chunk_bytes)
    return np.array(
        [chunks.engine_bases, chunks.block_strides, chunks.object_offsets, chunks.lengths],
        dtype=np.int64,
    ).reshape(4, len(chunks))


def launch_entries(block_ids: tuple[int, ...], slots: tuple[int, ...]) -> np.ndarray:
    """One launch's (block id, slot) pairs as the kernel reads them: int32 (2, n)."""
    return np.array([block_ids, slots], dtype=np.int32).reshape(2, len(block_ids))


def _device_address(cupy: Any, host_address: int) -> int:
    """Where kernels reach pinned host memory at ``host_address``; raises
    ``CopyBackendUnavailable`` when it is not mapped for the device."""
    runtime = cupy.cuda.runtime
    try:
        attrs = runtime.pointerGetAttributes(host_address)
        device_address = int(attrs.devicePointer)
        is_host = attrs.type == getattr(runtime, "memoryTypeHost", 1)
    except Exception as e:
        raise CopyBackendUnavailable(f"cannot map the staging memory ({e!r})") from None
    if not is_host or not device_address:
        raise CopyBackendUnavailable("the staging memory is not mapped for the device")
    return device_address


class EventHandle:
    """A copy ordered before ``event`` on a CUDA stream."""

    def __init__(self, event: torch.cuda.Event) -> None:
        self.event = event

    def wait(self) -> None:
        """Block (without spinning) until the copy has completed."""
        self.event.synchronize()

    def done(self) -> bool:
        """Whether the copy has completed (a query of its event; never blocks)."""
        return bool(self.event.query())


class CupyBlockCopier:
    """``BlockCopier`` for CUDA KV tensors and pinned staging; see the module doc."""

    name = "cupy"

    def __init__(
        self,
        kv_caches: Mapping[str, torch.Tensor],
        templates: Mapping[int, KVRangeTemplate],
        staging: StagingPool,
        num_blocks: int,
        *,
        chunk_bytes: int = CHUNK_BYTES,
        threads_per_cta: int = THREADS_PER_CTA,
    ) -> None:
        try:
            import cupy
        except Exception as e:  # ImportError, or a CuPy built for another CUDA
            raise CopyBackendUnavailable(f"CuPy is not importable ({e!r})") from None
        devices = {t.device for t in kv_caches.values()}
        if len(devices) != 1 or next(iter(devices)).type != "cuda":
            raise CopyBackendUnavailable(
                f"the KV cache must lie on one CUDA device, found {sorted(map(str, devices))}"
            )
        if not staging.buffer.is_pinned():
            raise CopyBackendUnavailable("the staging pool is not pinned host memory")
        index = next(iter(devices)).index
        self.device = torch.device("cuda", torch.cuda.current_device() if index is None else index)
        self._cupy: Any = cupy
        self._staging = staging
        self._staging_device_address = _device_address(cupy, staging.buffer.data_ptr())
        self._num_blocks = num_blocks
        self._threads = threads_per_cta
        with cupy.cuda.Device(self.device.index):
            try:
                module = cupy.RawModule(code=kernel_source(), options=("-std=c++17",))
                self._kernel = module.get_function(KERNEL_NAME)
            except Exception as e:
                raise CopyBackendUnavailable(f"the copy kernel did not build ({e!r})") from None
        self._streams = {
            "store": torch.cuda.Stream(self.device),
            "load": torch.cuda.Stream(self.device),
        }
        self._cupy_streams = {
            k: cupy.cuda.ExternalStream(s.cuda_stream, self.device.index)
            for k, s in self._streams.items()
        }
        self._tables: dict[int, tuple[torch.Tensor, int]] = {}
        for gid, template in templates.items():
            table = chunk_table(template, chunk_bytes)
            self._tables[gid] = (self._upload(table), table.shape[1])
        self._object_sizes = {gid: t.object_size for gid, t in templates.items()}
        # One launch sequence per stream at a time (stores on the engine's thread,
        # loads on the load thread).
        self._locks = {k: threading.Lock() for k in self._streams}

    def engine_point(self) -> torch.cuda.Event:
        """An event after the engine's work submitted so far on this thread's stream."""
        self._refuse_capture()
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def gather(self, plan: StagingCopyPlan) -> EventHandle:
        """Launch the gather after the engine's work so far; the engine does not wait."""
        ready = self.engine_point()
        return EventHandle(self._run("store", plan, ready, to_staging=True))

    def scatter(self, plan: StagingCopyPlan, after: object | None = None) -> EventHandle:
        """Launch the scatter after ``after`` (an ``engine_point`` event, or None)."""
        if after is not None and not isinstance(after, torch.cuda.Event):
            raise TypeError(f"after must be an engine_point event, got {type(after).__name__}")
        return EventHandle(self._run("load", plan, after, to_staging=False))

    def _run(
        self, direction: str, plan: StagingCopyPlan, after: Any, *, to_staging: bool
    ) -> torch.cuda.Event:
        groups = checked_groups(plan, self._object_sizes, self._num_blocks, self._staging)
        stream = self._streams[direction]
        done = torch.cuda.Event(blocking=True)
        with self._locks[direction], torch.cuda.device(self.device):
            if after is not None:
                stream.wait_event(after)
            for gid, (blocks, slots) in groups.items():
                for start in range(0, len(blocks), MAX_GRID_Y):
                    stop = start + MAX_GRID_Y
                    self._launch(direction, gid, blocks[start:stop], slots[start:stop], to_staging)
            done.record(stream)
        return done

    def _launch(
        self,
        direction: str,
        gid: int,
        blocks: tuple[int, ...],
        slots: tuple[int, ...],
        to_staging: bool,
    ) -> None:
        cupy = self._cupy
        table, n_chunks = self._tables[gid]
        stream = self._streams[direction]
        with torch.cuda.stream(stream):
            entries = self._upload(launch_entries(blocks, slots), non_blocking=True)
        args = (
            np.uint64(table.data_ptr()),
            np.int32(n_chunks),
            np.uint64(entries.data_ptr()),
            np.int32(len(blocks)),
            np.uint64(self._staging_device_address),
            np.int64(self._staging.slot_bytes),
            np.int32(1 if to_staging else 0),
        )
        with cupy.cuda.Device(self.device.index), self._cupy_streams[direction]:
            self._kernel((n_chunks, len(blocks)), (self._threads,), args)

    def receive_views(self, group_id: int, block_id: int) -> list[memoryview] | None:
        """Device memory cannot be received into: loads go through staging (None)."""
        return None

    def _upload(self, array: np.ndarray, non_blocking: bool = False) -> torch.Tensor:
        """``array`` in device memory, allocated on the calling thread's current stream.

        Non-blocking uploads go through pinned memory. Both caching allocators reuse
        these buffers only after the stream's later work, so dropping the tensor right
        after the launch that reads it is safe, and the caller does not wait.
        """
        host = torch.from_numpy(array)
        if non_blocking:
            host = host.pin_memory()
        return host.to(self.device, non_blocking=non_blocking)

    def _refuse_capture(self) -> None:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("umbp-redis copies cannot run inside CUDA graph capture")
