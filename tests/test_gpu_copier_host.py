"""``CupyBlockCopier``'s own host code, run on the CPU against a recording stand-in for
CuPy and ``torch.cuda``.

The stand-in runs each kernel launch through the CPU emulation of ``block_copy.cu``
with the exact (grid, block, args) the copier passes, checking the argument types
against the kernel's signature; it logs every stream operation (event records, waits,
launches, host waits) instead of running them asynchronously. So these tests check,
without a GPU, that the copier moves the right bytes through the kernel interface and
issues the stream ordering the design needs; ``test_gpu_copy.py`` checks on a device
that CUDA honours it.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import logging
import sys
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import kernel_emulation
import numpy as np
import pytest
import torch
from layout_cases import CASES, fill_random, storages, zeroed_clone

from umbp_redis.data import KVLayoutPlanner, KVRangeTemplate, StagingCopyPlan
from umbp_redis.engine.copy import cuda_copy as gpu_copy
from umbp_redis.engine.copy.cuda_copy import KERNEL_NAME, CupyBlockCopier, kernel_source
from umbp_redis.engine.copy.factory import make_block_copier
from umbp_redis.engine.copy.interface import CopyBackendUnavailable
from umbp_redis.engine.copy.torch_copy import TorchBlockCopier
from umbp_redis.engine.staging import StagingPool
from umbp_redis.store.errors import ConfigError

CUDA0 = torch.device("cuda", 0)


class FakeCuda:
    """The parts of ``torch.cuda`` and CuPy the copier uses, logging what they are asked."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        self.log: list[tuple[Any, ...]] = []
        self.ids = itertools.count(1)
        self.local = threading.local()
        fake = self

        class Stream:
            def __init__(self, device: Any = None, priority: int = 0, name: str = "") -> None:
                self.name = name or f"stream{next(fake.ids)}"
                self.cuda_stream = next(fake.ids) * 4096

            def wait_event(self, event: Any) -> None:
                fake.log.append(("wait", self.name, event.name))

        class Event:
            def __init__(self, enable_timing: bool = False, blocking: bool = False) -> None:
                self.name = f"event{next(fake.ids)}"
                self.blocking = blocking

            def record(self, stream: Any = None) -> None:
                stream = stream or fake.current_stream()
                fake.log.append(("record", self.name, stream.name))

            def synchronize(self) -> None:
                fake.log.append(("host_wait", self.name, self.blocking))

            def query(self) -> bool:
                fake.log.append(("query", self.name))
                return True  # the emulated launches ran when they were issued

        class ExternalStream:
            def __init__(self, ptr: int, device_id: int = -1) -> None:
                self.ptr, self.device_id = ptr, device_id

            def __enter__(self) -> ExternalStream:
                fake.local.cupy_stream = self
                return self

            def __exit__(self, *exc: object) -> None:
                fake.local.cupy_stream = None

        class Kernel:
            def __call__(self, grid: tuple[int, ...], block: tuple[int, ...], args: tuple) -> None:  # type: ignore[type-arg]
                ext = getattr(fake.local, "cupy_stream", None)
                assert ext is not None, "kernel launched outside a stream context"
                stream = fake.streams_by_ptr[ext.ptr]
                fake.log.append(("launch", stream.name, grid))
                kernel_emulation.launch(fake.lib, grid, block, args)

        class RawModule:
            def __init__(self, code: str, options: tuple[str, ...] = ()) -> None:
                assert code == kernel_source()
                fake.build_options = options
                if fake.fail_build:
                    raise RuntimeError("nvrtc: compilation failed")

            def get_function(self, name: str) -> Kernel:
                assert name == KERNEL_NAME
                return Kernel()

        self.Stream, self.Event = Stream, Event
        self.engine = Stream(name="engine")
        self.streams_by_ptr: dict[int, Any] = {}
        self.fail_build = False
        self.build_options: tuple[str, ...] = ()
        self.memory_type = 1  # cudaMemoryTypeHost
        self.cupy = SimpleNamespace(
            RawModule=RawModule,
            cuda=SimpleNamespace(
                Device=lambda index: contextlib.nullcontext(),
                ExternalStream=ExternalStream,
                runtime=SimpleNamespace(
                    memoryTypeHost=1,
                    pointerGetAttributes=lambda ptr: SimpleNamespace(
                        devicePointer=ptr, type=self.memory_type
                    ),
                ),
            ),
        )

    def current_stream(self, device: Any = None) -> Any:
        return getattr(self.local, "stream", None) or self.engine

    @contextlib.contextmanager
    def stream(self, stream: Any) -> Iterator[None]:
        prev = getattr(self.local, "stream", None)
        self.local.stream = stream
        try:
            yield
        finally:
            self.local.stream = prev

    def install(self, mp: pytest.MonkeyPatch) -> None:
        fake = self
        real_stream = self.Stream

        class TrackedStream(real_stream):  # type: ignore[misc, valid-type]
            def __init__(self, *a: Any, **kw: Any) -> None:
                super().__init__(*a, **kw)
                fake.streams_by_ptr[self.cuda_stream] = self

        mp.setitem(sys.modules, "cupy", self.cupy)
        mp.setattr(torch.cuda, "Stream", TrackedStream)
        mp.setattr(torch.cuda, "Event", self.Event)
        mp.setattr(torch.cuda, "current_stream", self.current_stream)
        mp.setattr(torch.cuda, "stream", self.stream)
        mp.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
        mp.setattr(torch.cuda, "current_device", lambda: 0)
        mp.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
        # Device memory is host memory here: the emulated kernel reads it directly.
        mp.setattr(
            CupyBlockCopier,
            "_upload",
            lambda self, array, non_blocking=False: torch.from_numpy(np.array(array, copy=True)),
        )

    def stream_named(self, kind: str) -> str:
        """Name of the copier's store or load stream, from the launch log."""
        return next(e[1] for e in self.log if e[0] == "launch" and e[1] != "engine")


class PinnedPool:
    """A CPU staging pool that says it is pinned (the fake device reaches it directly)."""

    def __init__(self, pool: StagingPool) -> None:
        self.pool = pool
        self.slot_bytes = pool.slot_bytes
        self.num_slots = pool.num_slots
        self.buffer = SimpleNamespace(is_pinned=lambda: True, data_ptr=pool.buffer.data_ptr)


@pytest.fixture
def fake(emulated_kernel: ctypes.CDLL, monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    f = FakeCuda(emulated_kernel)
    f.install(monkeypatch)
    return f


def _on_cuda(caches: dict[str, torch.Tensor]) -> dict[str, Any]:
    """What the copier reads of the KV tensors (their device), claiming CUDA."""
    return {n: SimpleNamespace(device=CUDA0) for n in caches}


def _setup(case: str, slots: int = 4, **kw: Any) -> tuple[Any, ...]:
    cfg, caches = CASES[case]("cpu")
    fill_random(caches, seed=5)
    planner = KVLayoutPlanner(cfg)
    bases = planner.register_kv_caches(caches)
    templates = {g: planner.range_template(g, bases) for g in planner.layouts}
    size = templates[0].object_size
    pool = StagingPool(size, slots * size)
    pinned: Any = PinnedPool(pool)
    copier = CupyBlockCopier(_on_cuda(caches), templates, pinned, planner.num_blocks, **kw)
    return planner, templates, caches, pool, copier


@pytest.mark.parametrize("case", sorted(CASES))
def test_gather_moves_the_reference_bytes_in_the_designed_order(fake: FakeCuda, case: str) -> None:
    planner, templates, caches, pool, copier = _setup(case, chunk_bytes=64, threads_per_cta=32)
    assert fake.build_options == ("-std=c++17",)
    plan = StagingCopyPlan((0,) * 4, (5, 1, 0, 3), (1, 3, 0, 2))
    fake.log.clear()
    handle = copier.gather(plan)
    store = fake.stream_named("store")
    ready, done = fake.log[0][1], fake.log[3][1]
    assert fake.log == [
        ("record", ready, "engine"),  # after the forward pass's work ...
        ("wait", store, ready),  # ... the copy stream starts,
        ("launch", store, (len(gpu_copy.chunk_table(templates[0], 64).T), 4)),  # in one launch,
        ("record", done, store),  # and later engine work does not wait for it.
    ]
    assert handle.done() and fake.log[-1] == ("query", done)  # polled without blocking
    handle.wait()
    assert fake.log[-1] == ("host_wait", done, True)  # a blocking (not spinning) event

    ref = StagingPool(pool.slot_bytes, pool.num_slots * pool.slot_bytes)
    TorchBlockCopier(caches, templates, ref, planner.num_blocks).gather(plan)
    assert torch.equal(pool.buffer, ref.buffer)


def test_scatter_waits_for_the_engine_point_then_reports_its_own_event(fake: FakeCuda) -> None:
    planner, templates, caches, pool, copier = _setup("kv_outer_5d")
    copier.gather(StagingCopyPlan((0, 0), (2, 4), (0, 1))).wait()
    other = zeroed_clone(caches)
    p2 = KVLayoutPlanner(planner.kv_cache_config)
    t2 = {0: p2.range_template(0, p2.register_kv_caches(other))}
    dst = CupyBlockCopier(_on_cuda(other), t2, PinnedPool(pool), p2.num_blocks)  # type: ignore[arg-type]
    fake.log.clear()
    point: Any = dst.engine_point()
    handle = dst.scatter(StagingCopyPlan((0, 0), (5, 1), (0, 1)), after=point)
    load = fake.stream_named("load")
    assert fake.log[0] == ("record", point.name, "engine")
    assert fake.log[1:] == [
        ("wait", load, point.name),
        ("launch", load, fake.log[2][2]),
        ("record", fake.log[3][1], load),
    ]  # the engine's stream does not wait for loads: the request is not scheduled yet
    handle.wait()
    assert fake.log[-1] == ("host_wait", fake.log[3][1], True)

    want = zeroed_clone(caches)
    p3 = KVLayoutPlanner(planner.kv_cache_config)
    t3 = {0: p3.range_template(0, p3.register_kv_caches(want))}
    TorchBlockCopier(want, t3, pool, p3.num_blocks).scatter(StagingCopyPlan((0, 0), (5, 1), (0, 1)))
    for got, ref in zip(storages(other), storages(want), strict=True):
        assert torch.equal(got, ref)
    with pytest.raises(TypeError, match="engine_point"):
        dst.scatter(StagingCopyPlan((0,), (1,), (0,)), after="not an event")


def test_batches_split_at_the_grid_limit_and_per_cache_group(
    fake: FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg, caches = CASES["packed_4d"]("cpu")
    fill_random(caches, seed=6)
    planner = KVLayoutPlanner(cfg)
    tmpl = planner.range_template(0, planner.register_kv_caches(caches))
    # Two cache groups with the same layout (the kernel only sees chunk tables).
    templates: dict[int, KVRangeTemplate] = {0: tmpl, 7: tmpl}
    pool = StagingPool(tmpl.object_size, 6 * tmpl.object_size)
    copier = CupyBlockCopier(_on_cuda(caches), templates, PinnedPool(pool), planner.num_blocks)  # type: ignore[arg-type]
    monkeypatch.setattr(gpu_copy, "MAX_GRID_Y", 2)
    plan = StagingCopyPlan((0, 7, 0, 0, 7, 0), (6, 5, 4, 3, 2, 1), (0, 1, 2, 3, 4, 5))
    fake.log.clear()
    copier.gather(plan).wait()
    launches = [e[2] for e in fake.log if e[0] == "launch"]
    assert [g[1] for g in launches] == [2, 2, 2]  # group 0: 4 blocks in 2 launches; group 7: 1
    assert sum(1 for e in fake.log if e[0] == "record") == 2  # one ready, one done event
    ref = StagingPool(tmpl.object_size, 6 * tmpl.object_size)
    TorchBlockCopier(caches, templates, ref, planner.num_blocks).gather(plan)
    assert torch.equal(pool.buffer, ref.buffer)


def test_bad_entries_are_refused_before_anything_is_launched(fake: FakeCuda) -> None:
    _, _, _, _, copier = _setup("mla_3d")
    fake.log.clear()
    with pytest.raises(ValueError, match="block id 6"):
        copier.gather(StagingCopyPlan((0, 0), (1, 6), (0, 1)))
    with pytest.raises(ValueError, match="slot 9"):
        copier.scatter(StagingCopyPlan((0,), (1,), (9,)))
    with pytest.raises(ValueError, match="group 2"):
        copier.gather(StagingCopyPlan((2,), (1,), (0,)))
    assert not [e for e in fake.log if e[0] in ("launch", "wait")]


def test_unusable_kernel_or_staging_means_unavailable(fake: FakeCuda) -> None:
    cfg, caches = CASES["mla_3d"]("cpu")
    planner = KVLayoutPlanner(cfg)
    templates = {0: planner.range_template(0, planner.register_kv_caches(caches))}
    pool = PinnedPool(StagingPool(templates[0].object_size, templates[0].object_size))
    fake.fail_build = True
    with pytest.raises(CopyBackendUnavailable, match="did not build"):
        CupyBlockCopier(_on_cuda(caches), templates, pool, 6)  # type: ignore[arg-type]
    fake.fail_build = False
    fake.memory_type = 2  # device memory: not a mapped host buffer
    with pytest.raises(CopyBackendUnavailable, match="not mapped"):
        CupyBlockCopier(_on_cuda(caches), templates, pool, 6)  # type: ignore[arg-type]
    fake.memory_type = 1
    unpinned = StagingPool(templates[0].object_size, templates[0].object_size)
    with pytest.raises(CopyBackendUnavailable, match="not pinned"):
        CupyBlockCopier(_on_cuda(caches), templates, unpinned, 6)
    mixed = {**_on_cuda(caches), "extra": SimpleNamespace(device=torch.device("cuda", 1))}
    with pytest.raises(CopyBackendUnavailable, match="one CUDA device"):
        CupyBlockCopier(mixed, templates, pool, 6)  # type: ignore[arg-type]
    assert CupyBlockCopier(_on_cuda(caches), templates, pool, 6).name == "cupy"  # type: ignore[arg-type]


def test_auto_falls_back_to_torch_copies_with_a_warning_and_cupy_refuses(
    fake: FakeCuda, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import umbp_redis.engine.copy.torch_copy as cpu_copy

    cfg, caches = CASES["mla_3d"]("cpu")
    planner = KVLayoutPlanner(cfg)
    templates = {0: planner.range_template(0, planner.register_kv_caches(caches))}
    pool = PinnedPool(StagingPool(templates[0].object_size, templates[0].object_size))
    monkeypatch.setattr(cpu_copy, "TorchBlockCopier", lambda *a: SimpleNamespace(name="torch"))
    assert make_block_copier("auto", _on_cuda(caches), templates, pool, 6).name == "cupy"  # type: ignore[arg-type]
    fake.fail_build = True
    with caplog.at_level(logging.WARNING, logger="umbp_redis.engine.copy.factory"):
        assert make_block_copier("auto", _on_cuda(caches), templates, pool, 6).name == "torch"  # type: ignore[arg-type]
    assert "GPU copy kernel unavailable" in caplog.text and "did not build" in caplog.text
    with pytest.raises(ConfigError, match=r"copy_backend.*'cupy'.*did not build"):
        make_block_copier("cupy", _on_cuda(caches), templates, pool, 6)  # type: ignore[arg-type]


def test_scatter_as_loaded_launches_each_window_and_blocks_only_in_wait(fake: FakeCuda) -> None:
    """The worker's overlap of copies with the receive (issue 17 part 1) on the kernel
    copier: each reported window is one launch on the load stream after the engine
    point, nothing waits on the host until ``wait``, which then waits for every launch;
    the blocks get the reference bytes."""
    from umbp_redis.engine.load_scatter import ScatterAsLoaded

    planner, templates, caches, pool, copier = _setup("kv_outer_5d")
    copier.gather(StagingCopyPlan((0,) * 4, (2, 4, 1, 5), (0, 1, 2, 3))).wait()
    other = zeroed_clone(caches)
    p2 = KVLayoutPlanner(planner.kv_cache_config)
    t2 = {0: p2.range_template(0, p2.register_kv_caches(other))}
    dst = CupyBlockCopier(_on_cuda(other), t2, PinnedPool(pool), p2.num_blocks)  # type: ignore[arg-type]
    dest = (5, 1, 3, 0)
    fake.log.clear()
    point: Any = dst.engine_point()
    scatters = ScatterAsLoaded(
        dst,
        lambda ii: StagingCopyPlan((0,) * len(ii), tuple(dest[i] for i in ii), tuple(ii)),
        point,
    )
    scatters.launch([0, 1])  # the first window is in; the next ones are still arriving
    scatters.launch([2])
    scatters.launch([3, 2])  # 2 again: already started, not copied twice
    load = fake.stream_named("load")
    launches = [e for e in fake.log if e[0] == "launch"]
    assert [e[1] for e in launches] == [load] * 3 and scatters.launches == 3
    assert [e for e in fake.log if e[0] == "wait"] == [("wait", load, point.name)] * 3
    assert not any(e[0] == "host_wait" for e in fake.log)  # no launch waited on the host
    scatters.wait()
    assert sum(e[0] == "host_wait" for e in fake.log) == 3 and scatters.failed == set()

    want = zeroed_clone(caches)
    p3 = KVLayoutPlanner(planner.kv_cache_config)
    t3 = {0: p3.range_template(0, p3.register_kv_caches(want))}
    TorchBlockCopier(want, t3, pool, p3.num_blocks).scatter(
        StagingCopyPlan((0,) * 4, dest, (0, 1, 2, 3))
    )
    for got, ref in zip(storages(other), storages(want), strict=True):
        assert torch.equal(got, ref)
