"""Shared planning and the block copiers on CPU: range templates, the torch executor,
and the GPU kernel's own source run through a CPU emulation of its grid.

The emulated kernel is driven by the same host code as the GPU copier
(``chunk_table``, ``launch_entries``), so a wrong chunk table, index or alignment
choice fails here without a GPU. ``test_gpu_copy.py`` runs the kernel on a device.
"""

from __future__ import annotations

import ctypes
import dataclasses
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import kernel_emulation
import numpy as np
import pytest
import torch
from kv_fixtures import vllm_layout_caches
from layout_cases import CASES, fill_random, page_bytes, storages, zeroed_clone
from vllm.v1.kv_cache_layout import KVCacheLayout

from umbp_redis.data import (
    KVLayoutPlanner,
    KVRange,
    KVRangeRun,
    KVRangeTemplate,
    StagingCopyPlan,
)
from umbp_redis.engine.copy.cuda_copy import KERNEL_NAME, chunk_table, kernel_source, launch_entries
from umbp_redis.engine.copy.factory import make_block_copier
from umbp_redis.engine.copy.interface import CopyBackendUnavailable
from umbp_redis.engine.copy.torch_copy import (
    PlanOutOfBounds,
    TorchBlockCopier,
    consecutive_sequences,
)
from umbp_redis.engine.options import EngineOptions, parse_connector_options
from umbp_redis.engine.staging import StagingPool, staging_budget
from umbp_redis.store.errors import ConfigError

REPO = Path(__file__).resolve().parent.parent
PKG = REPO / "umbp_redis" / "engine" / "copy"


def _vllm_case(layout: KVCacheLayout) -> Callable[[str], tuple]:  # type: ignore[type-arg]
    def build(device: str) -> tuple:  # type: ignore[type-arg]
        assert device == "cpu"
        return vllm_layout_caches(layout, num_blocks=6)

    return build


ALL_CASES = {**CASES, **{f"vllm_{lay.name}": _vllm_case(lay) for lay in KVCacheLayout}}


def _setup(case: str) -> tuple[KVLayoutPlanner, dict[int, KVRangeTemplate], dict, StagingPool]:  # type: ignore[type-arg]
    cfg, caches = ALL_CASES[case]("cpu")
    fill_random(caches, seed=11)
    planner = KVLayoutPlanner(cfg)
    bases = planner.register_kv_caches(caches)
    templates = {g: planner.range_template(g, bases) for g in planner.layouts}
    pool = StagingPool(planner.layout(0).object_size, 4 * planner.layout(0).object_size)
    return planner, templates, caches, pool


def _expected_object(caches: dict, planner: KVLayoutPlanner, block: int) -> torch.Tensor:  # type: ignore[type-arg]
    names = planner.group_layers[0]
    return torch.cat([page_bytes(caches[n], block) for n in names])


# -- range templates ----------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(ALL_CASES))
def test_template_is_the_plan_of_every_block(case: str) -> None:
    planner, templates, caches, _ = _setup(case)
    tmpl = templates[0]
    assert tmpl.object_size == planner.layout(0).object_size
    assert tmpl.layout_fingerprint == planner.layout(0).fingerprint
    for b in range(planner.num_blocks):
        plan = planner.plan_for_block("k", b, planner.base_addresses)
        assert plan.ranges == tmpl.ranges_for(b)
    assert planner.plan_for_block("k", 1, planner.base_addresses, lower=False).ranges == ()


def test_template_coalesces_adjacent_pages_and_keeps_apart_runs() -> None:
    assert len(_setup("shared_strided")[1][0]) == 1  # all layers of a block side by side
    assert len(_setup("kv_outer_5d")[1][0]) == 6  # K and V of each of 3 layers apart
    assert len(_setup("odd_byte_runs")[1][0]) == 6  # 2 heads a layer, a byte apart


@pytest.mark.parametrize("max_bytes", [16, 48, 1000, 1 << 20])
def test_chunked_template_moves_the_same_bytes(max_bytes: int) -> None:
    _, templates, _, _ = _setup("kv_outer_5d")
    tmpl = templates[0]
    chunks = tmpl.chunked(max_bytes)
    assert max(chunks.lengths) <= max_bytes
    assert sum(chunks.lengths) == tmpl.object_size
    # Every piece lies where the unsplit range puts the same object bytes.
    for b in (0, 3):
        whole = {r.object_offset: r for r in tmpl.ranges_for(b)}
        starts = sorted(whole)
        for piece in chunks.ranges_for(b):
            owner = whole[max(s for s in starts if s <= piece.object_offset)]
            delta = piece.object_offset - owner.object_offset
            assert piece.engine_address == owner.engine_address + delta
            assert delta + piece.length <= owner.length
            if max_bytes % 16 == 0:
                assert delta % max_bytes == 0  # pieces keep their range's alignment


def test_template_and_copy_plan_validation() -> None:
    with pytest.raises(ValueError, match="tile"):
        KVRangeTemplate(0, 8, b"", (0, 100), (8, 8), (0, 2), (4, 4))
    with pytest.raises(ValueError, match="cover"):
        KVRangeTemplate(0, 9, b"", (0,), (8,), (0,), (8,))
    with pytest.raises(ValueError, match="differ"):
        KVRangeTemplate(0, 8, b"", (0,), (), (0,), (8,))
    with pytest.raises(ValueError, match="positive"):
        KVRangeTemplate(0, 8, b"", (0,), (8,), (0,), (8,)).chunked(0)
    with pytest.raises(ValueError, match="distinct"):
        StagingCopyPlan((0, 0), (1, 2), (3, 3))
    with pytest.raises(ValueError, match="differ"):
        StagingCopyPlan((0,), (1, 2), (3, 4))
    plan = StagingCopyPlan((1, 0, 1), (5, 6, 7), (0, 1, 2))
    assert plan.by_group() == {1: ((5, 7), (0, 2)), 0: ((6,), (1,))}


# -- the torch executor -------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(ALL_CASES))
def test_torch_copier_round_trips_every_layout(case: str) -> None:
    planner, templates, caches, pool = _setup(case)
    copier = TorchBlockCopier(caches, templates, pool, planner.num_blocks)
    blocks, slots = (3, 0, 2), (2, 0, 3)
    copier.gather(StagingCopyPlan((0,) * 3, blocks, slots)).wait()
    size = templates[0].object_size
    for b, s in zip(blocks, slots, strict=True):
        assert torch.equal(pool.tensor(s)[:size], _expected_object(caches, planner, b))

    other = zeroed_clone(caches)
    planner2 = KVLayoutPlanner(planner.kv_cache_config)
    bases2 = planner2.register_kv_caches(other)
    copier2 = TorchBlockCopier(
        other, {0: planner2.range_template(0, bases2)}, pool, planner.num_blocks
    )
    copier2.scatter(StagingCopyPlan((0, 0), (1, 4), (2, 3)), after=copier2.engine_point()).wait()
    for name in planner.group_layers[0]:
        assert torch.equal(page_bytes(other[name], 1), page_bytes(caches[name], 3))
        assert torch.equal(page_bytes(other[name], 4), page_bytes(caches[name], 2))
        for b in (0, 2, 3, 5):
            assert not page_bytes(other[name], b).any(), f"block {b} was touched"


@pytest.mark.parametrize("case", sorted(ALL_CASES))
def test_torch_copier_batches_consecutive_blocks_exactly(case: str) -> None:
    planner, templates, caches, pool = _setup(case)
    copier = TorchBlockCopier(caches, templates, pool, planner.num_blocks)
    size = templates[0].object_size
    # Blocks 1-3 go to slots 0-2 (one sequence), block 5 to slot 3 (another).
    blocks, slots = (2, 5, 1, 3), (1, 3, 0, 2)
    assert consecutive_sequences(blocks, slots) == [(1, 0, 3), (5, 3, 1)]
    pool.buffer.fill_(0xA5)
    copier.gather(StagingCopyPlan((0,) * 4, blocks, slots))
    for b, s in zip(blocks, slots, strict=True):
        assert torch.equal(pool.tensor(s)[:size], _expected_object(caches, planner, b))
        assert bool((pool.tensor(s)[size:] == 0xA5).all())  # nothing past the object

    other = zeroed_clone(caches)
    planner2 = KVLayoutPlanner(planner.kv_cache_config)
    t2 = {0: planner2.range_template(0, planner2.register_kv_caches(other))}
    # Slots 0-2 land in blocks 2-4, slot 3 in block 0.
    TorchBlockCopier(other, t2, pool, planner.num_blocks).scatter(
        StagingCopyPlan((0,) * 4, (3, 0, 4, 2), (1, 3, 2, 0))
    )
    moved = {2: 1, 3: 2, 4: 3, 0: 5}  # destination block: source block
    for name in planner.group_layers[0]:
        for b in range(planner.num_blocks):
            got = page_bytes(other[name], b)
            if b in moved:
                assert torch.equal(got, page_bytes(caches[name], moved[b])), f"block {b}"
            else:
                assert not got.any(), f"block {b} was touched"


def _expand(runs: tuple[KVRangeRun, ...], block: int) -> tuple[KVRange, ...]:
    return tuple(
        KVRange(
            r.engine_base + block * r.block_stride + k * r.step,
            r.object_offset + k * r.length,
            r.length,
        )
        for r in runs
        for k in range(r.count)
    )


@pytest.mark.parametrize("case", sorted(ALL_CASES))
def test_runs_are_the_template_ranges(case: str) -> None:
    planner, templates, _, _ = _setup(case)
    tmpl = templates[0]
    runs = tmpl.runs()
    assert sum(r.count for r in runs) == len(tmpl)
    assert all(r.step >= r.length for r in runs)
    for b in (0, planner.num_blocks - 1):
        assert _expand(runs, b) == tmpl.ranges_for(b)
    assert all(p.count == 1 for r in runs for p in r.pieces())
    assert tuple(p for r in runs for p in r.pieces()) == tuple(
        KVRangeRun(x.engine_address, s, x.length, 1, x.length, x.object_offset)
        for x, s in zip(tmpl.ranges_for(0), tmpl.block_strides, strict=True)
    )


def test_runs_merge_equally_spaced_ranges_only() -> None:
    # Ranges at 0, 100, 200 (step 100), then 250 (a new step), then 300 of another length.
    t = KVRangeTemplate(
        0, 40, b"", (0, 100, 200, 250, 300), (1000,) * 5, (0, 8, 16, 24, 32), (8, 8, 8, 8, 8)
    )
    assert [(r.engine_base, r.step, r.count) for r in t.runs()] == [(0, 100, 3), (250, 50, 2)]
    overlapping = KVRangeTemplate(0, 16, b"", (0, 4), (100, 100), (0, 8), (8, 8))
    assert [r.count for r in overlapping.runs()] == [1, 1]  # 4 apart: would overlap
    strides = KVRangeTemplate(0, 16, b"", (0, 100), (100, 200), (0, 8), (8, 8))
    assert [r.count for r in strides.runs()] == [1, 1]
    # vLLM's CPU layout: every layer of a block one layer stride apart, one run.
    assert len(_setup("vllm_LBHNC")[1][0].runs()) == 1


def test_consecutive_sequences() -> None:
    assert consecutive_sequences((), ()) == []
    assert consecutive_sequences((7, 5, 6), (2, 0, 1)) == [(5, 0, 3)]
    assert consecutive_sequences((5, 6, 8), (0, 2, 3)) == [(5, 0, 1), (6, 2, 1), (8, 3, 1)]


def test_torch_copier_splits_a_run_that_spans_two_storages() -> None:
    nb, page = 4, 8
    a, b = (torch.arange(nb * page, dtype=torch.uint8) + 64 * i for i in range(2))
    lo, hi = sorted((a, b), key=lambda t: t.data_ptr())
    assert hi.data_ptr() - lo.data_ptr() >= page
    # One range in each tensor: equally spaced, so runs() merges them into one run.
    tmpl = KVRangeTemplate(
        0, 2 * page, b"", (lo.data_ptr(), hi.data_ptr()), (page, page), (0, page), (page, page)
    )
    assert len(tmpl.runs()) == 1
    pool = StagingPool(2 * page, nb * 2 * page)
    copier = TorchBlockCopier({"a": a, "b": b}, {0: tmpl}, pool, nb)
    copier.gather(StagingCopyPlan((0,) * nb, tuple(range(nb)), tuple(range(nb))))
    for blk in range(nb):
        want = torch.cat([lo[blk * page : (blk + 1) * page], hi[blk * page : (blk + 1) * page]])
        assert torch.equal(pool.tensor(blk), want)
    outside = dataclasses.replace(tmpl, block_strides=(page, 2 * page))
    with pytest.raises(PlanOutOfBounds, match="outside the KV storage"):
        TorchBlockCopier({"a": a, "b": b}, {0: outside}, pool, nb)


def test_copiers_reject_blocks_and_slots_outside_their_bounds() -> None:
    planner, templates, caches, pool = _setup("packed_4d")
    copier = TorchBlockCopier(caches, templates, pool, planner.num_blocks)
    with pytest.raises(ValueError, match="block id 7"):
        copier.gather(StagingCopyPlan((0,), (7,), (0,)))
    with pytest.raises(ValueError, match="slot 4"):
        copier.scatter(StagingCopyPlan((0,), (1,), (4,)))
    with pytest.raises(ValueError, match="group 3"):
        copier.gather(StagingCopyPlan((3,), (1,), (0,)))
    small = StagingPool(16, 64)
    with pytest.raises(ValueError, match="does not fit"):
        TorchBlockCopier(caches, templates, small, planner.num_blocks).gather(
            StagingCopyPlan((0,), (1,), (0,))
        )


def _pow2_ceil(n: int) -> int:
    """What torch's pinned allocator reserves for an n-byte request."""
    return 1 << (n - 1).bit_length()


@pytest.mark.parametrize("max_bytes", [1 << 28, 3 << 30, (1 << 28) + 1, 10**9])
@pytest.mark.parametrize("slot_bytes", [640 << 10, 2 << 20, 3 * 98304])
def test_pinned_staging_stays_within_max_staging_bytes(max_bytes: int, slot_bytes: int) -> None:
    budget = staging_budget(max_bytes, pinned=True)
    slots = budget // slot_bytes
    assert _pow2_ceil(slots * slot_bytes) <= max_bytes  # what is really pinned
    assert budget > max_bytes // 2  # and at least half of what was allowed is used
    assert staging_budget(max_bytes, pinned=False) == max_bytes
    with pytest.raises(ValueError):
        staging_budget(0, pinned=True)


def test_staging_pool_never_exceeds_its_bytes() -> None:
    assert StagingPool(100, 399).num_slots == 3
    assert StagingPool(100, 100).num_slots == 1
    with pytest.raises(ValueError, match="hold no 100-byte staging slot"):
        StagingPool(100, 99)


# -- backend selection --------------------------------------------------------------


def test_backend_selection_on_cpu() -> None:
    planner, templates, caches, pool = _setup("packed_4d")
    for backend in ("auto", "torch"):
        assert make_block_copier(backend, caches, templates, pool, 7).name == "torch"
    with pytest.raises(ConfigError, match=r"copy_backend.*'cupy'.*not a CUDA device"):
        make_block_copier("cupy", caches, templates, pool, 7)
    with pytest.raises(ConfigError, match="copy_backend"):
        make_block_copier("cuda", caches, templates, pool, 7)
    with pytest.raises(ConfigError, match=r"copy_backend.*one of \['auto', 'cupy', 'torch'\]"):
        parse_connector_options({"copy_backend": "fast"})
    assert EngineOptions().copy_backend == "auto"


def test_gpu_copier_without_cupy_is_unavailable_not_an_import_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from umbp_redis.engine.copy.cuda_copy import CupyBlockCopier

    planner, templates, caches, pool = _setup("packed_4d")
    monkeypatch.setitem(sys.modules, "cupy", None)
    with pytest.raises(CopyBackendUnavailable, match="CuPy is not importable"):
        CupyBlockCopier(caches, templates, pool, planner.num_blocks)


def test_kernel_source_ships_with_the_package() -> None:
    src = kernel_source()
    assert src == (PKG / "block_copy.cu").read_text()
    assert f'extern "C" __global__ void {KERNEL_NAME}(' in src


# -- the kernel's source, compiled -------------------------------------------------


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc (CUDA toolkit) on PATH")
def test_kernel_compiles_with_nvcc_for_hopper(tmp_path: Path) -> None:
    out = tmp_path / "block_copy.cubin"
    res = subprocess.run(
        ["nvcc", "-arch=sm_90", "-cubin", "-Werror", "all-warnings", "-o", str(out)]
        + [str(PKG / "block_copy.cu")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    assert KERNEL_NAME.encode() in out.read_bytes()


class EmulatedKernelCopier:
    """The GPU copier's host side (chunk tables, launch entries, one launch per group,
    the kernel's argument tuple) with the kernel run by the CPU emulation."""

    def __init__(
        self,
        lib: ctypes.CDLL,
        templates: dict[int, KVRangeTemplate],
        pool: StagingPool,
        chunk_bytes: int,
        threads: int,
    ) -> None:
        self.lib, self.pool, self.threads = lib, pool, threads
        self.tables = {
            g: np.ascontiguousarray(chunk_table(t, chunk_bytes)) for g, t in templates.items()
        }
        self.launches = 0

    def run(self, plan: StagingCopyPlan, to_staging: bool) -> None:
        for gid, (blocks, slots) in plan.by_group().items():
            table = self.tables[gid]
            entries = np.ascontiguousarray(launch_entries(blocks, slots))
            args = (
                np.uint64(table.ctypes.data),
                np.int32(table.shape[1]),
                np.uint64(entries.ctypes.data),
                np.int32(len(blocks)),
                np.uint64(self.pool.buffer.data_ptr()),
                np.int64(self.pool.slot_bytes),
                np.int32(int(to_staging)),
            )
            kernel_emulation.launch(self.lib, (table.shape[1], len(blocks)), (self.threads,), args)
            self.launches += 1


@pytest.mark.parametrize("chunk_bytes,threads", [(16 * 1024, 256), (48, 32), (1024, 7)])
@pytest.mark.parametrize("case", sorted(ALL_CASES))
def test_kernel_equals_torch_reference_byte_for_byte(
    emulated_kernel: ctypes.CDLL, case: str, chunk_bytes: int, threads: int
) -> None:
    planner, templates, caches, ref_pool = _setup(case)
    size = templates[0].object_size
    plan = StagingCopyPlan((0,) * 4, (5, 1, 0, 3), (1, 3, 0, 2))
    TorchBlockCopier(caches, templates, ref_pool, planner.num_blocks).gather(plan)

    pool = StagingPool(size, 4 * size)
    pool.buffer.fill_(0xA5)  # bytes past each object stay as they were
    kernel = EmulatedKernelCopier(emulated_kernel, templates, pool, chunk_bytes, threads)
    kernel.run(plan, to_staging=True)
    assert kernel.launches == 1  # the whole batch in one launch
    for s in range(4):
        assert torch.equal(pool.tensor(s)[:size], ref_pool.tensor(s)[:size]), f"slot {s}"
        assert bool((pool.tensor(s)[size:] == 0xA5).all())

    # Scatter into a zeroed second engine, then compare every byte of its storage with
    # what the torch executor writes into a third.
    scatter = StagingCopyPlan((0,) * 3, (2, 4, 0), (1, 3, 2))
    targets = []
    for use_kernel in (True, False):
        other = zeroed_clone(caches)
        p2 = KVLayoutPlanner(planner.kv_cache_config)
        t2 = {0: p2.range_template(0, p2.register_kv_caches(other))}
        if use_kernel:
            EmulatedKernelCopier(emulated_kernel, t2, pool, chunk_bytes, threads).run(
                scatter, to_staging=False
            )
        else:
            TorchBlockCopier(other, t2, ref_pool, planner.num_blocks).scatter(scatter)
        targets.append(storages(other))
    for got, want in zip(*targets, strict=True):
        assert torch.equal(got, want)
    assert any(t.any() for t in targets[0])  # something was written
