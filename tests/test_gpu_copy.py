"""The CuPy copier on a CUDA device: byte-equal to the torch reference on every layout,
and ordered against the engine's stream. Marked ``gpu``: skipped where there is no CUDA
device. Needs torch and CuPy only (no vLLM, no Redis), so ``scripts/gpu_check.sh`` runs
it on a bare GPU machine.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from layout_cases import CASES, LAYERS, fill_random, storages, zeroed_clone

from umbp_redis.data import KVLayoutPlanner, KVRangeTemplate, StagingCopyPlan
from umbp_redis.engine.copy.factory import make_block_copier
from umbp_redis.engine.copy.torch_copy import TorchBlockCopier
from umbp_redis.engine.staging import StagingPool

pytestmark = pytest.mark.gpu

# ~0.1 s of one SM spinning at ~2 GHz. The GPU sleeps below create a condition (a
# stream still busy with earlier work); the tests then wait on the copies' handles.
# One reads a gather's handle not done as its stream still spins: ~1 s of GPU time
# against the microseconds of host work between its launch and that read.
SLEEP_CYCLES = 200_000_000


@pytest.fixture(scope="module")
def cupy() -> Any:
    return pytest.importorskip("cupy", reason="CuPy is not installed")


def _planned(
    caches: dict[str, torch.Tensor], cfg: Any
) -> tuple[KVLayoutPlanner, dict[int, KVRangeTemplate]]:
    planner = KVLayoutPlanner(cfg)
    bases = planner.register_kv_caches(caches)
    return planner, {g: planner.range_template(g, bases) for g in planner.layouts}


def _gpu_copier(caches, cfg, slots, pool=None, **kw):  # type: ignore[no-untyped-def]
    """A CuPy copier over ``caches`` with a pinned pool of ``slots`` slots (or ``pool``)."""
    from umbp_redis.engine.copy.cuda_copy import CupyBlockCopier

    planner, templates = _planned(caches, cfg)
    size = templates[0].object_size
    if pool is None:
        pool = StagingPool(size, slots * size, pin_memory=True)
    return CupyBlockCopier(caches, templates, pool, planner.num_blocks, **kw), pool, size


@pytest.mark.parametrize("chunk_bytes,threads", [(16 * 1024, 256), (48, 32)])
@pytest.mark.parametrize("case", sorted(CASES))
def test_gpu_gather_and_scatter_equal_the_cpu_reference(
    cupy: Any, case: str, chunk_bytes: int, threads: int
) -> None:
    cfg, gpu = CASES[case]("cuda")
    _, cpu = CASES[case]("cpu")
    fill_random(gpu, seed=21)
    fill_random(cpu, seed=21)
    copier, pool, size = _gpu_copier(gpu, cfg, 4, chunk_bytes=chunk_bytes, threads_per_cta=threads)
    planner, templates = _planned(cpu, cfg)
    ref_pool = StagingPool(size, 4 * size)
    ref = TorchBlockCopier(cpu, templates, ref_pool, planner.num_blocks)

    plan = StagingCopyPlan((0,) * 4, (5, 1, 0, 3), (1, 3, 0, 2))
    pool.buffer.fill_(0xA5)
    copier.gather(plan).wait()
    ref.gather(plan)
    for s in range(4):
        assert torch.equal(pool.tensor(s)[:size], ref_pool.tensor(s)[:size]), f"slot {s}"
        assert bool((pool.tensor(s)[size:] == 0xA5).all())

    scatter = StagingCopyPlan((0,) * 3, (2, 4, 0), (1, 3, 2))
    gpu_dst, cpu_dst = zeroed_clone(gpu), zeroed_clone(cpu)
    dst_copier, _, _ = _gpu_copier(
        gpu_dst, cfg, 0, pool, chunk_bytes=chunk_bytes, threads_per_cta=threads
    )  # scatters from the slots gathered above
    dst_copier.scatter(scatter, after=dst_copier.engine_point()).wait()
    p2, t2 = _planned(cpu_dst, cfg)
    TorchBlockCopier(cpu_dst, t2, ref_pool, p2.num_blocks).scatter(scatter)
    for got, want in zip(storages(gpu_dst), storages(cpu_dst), strict=True):
        assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("case", sorted(CASES))
def test_torch_executor_on_cuda_equals_it_on_cpu(case: str) -> None:
    """The fallback without CuPy: strided-run copies between CUDA tensors and pinned
    staging, with a batch of consecutive blocks (one copy call) and a lone block."""
    cfg, gpu = CASES[case]("cuda")
    _, cpu = CASES[case]("cpu")
    fill_random(gpu, seed=23)
    fill_random(cpu, seed=23)
    gp, gt = _planned(gpu, cfg)
    cp, ct = _planned(cpu, cfg)
    size = gt[0].object_size
    pool = StagingPool(size, 4 * size, pin_memory=True)
    ref_pool = StagingPool(size, 4 * size)
    plan = StagingCopyPlan((0,) * 4, (2, 1, 3, 5), (1, 0, 2, 3))
    TorchBlockCopier(gpu, gt, pool, gp.num_blocks).gather(plan)
    TorchBlockCopier(cpu, ct, ref_pool, cp.num_blocks).gather(plan)
    assert torch.equal(pool.buffer[:, :size], ref_pool.buffer[:, :size])

    gpu_dst, cpu_dst = zeroed_clone(gpu), zeroed_clone(cpu)
    scatter = StagingCopyPlan((0,) * 3, (0, 1, 4), (1, 2, 3))
    g2, gt2 = _planned(gpu_dst, cfg)
    c2, ct2 = _planned(cpu_dst, cfg)
    TorchBlockCopier(gpu_dst, gt2, pool, g2.num_blocks).scatter(scatter)
    TorchBlockCopier(cpu_dst, ct2, ref_pool, c2.num_blocks).scatter(scatter)
    for got, want in zip(storages(gpu_dst), storages(cpu_dst), strict=True):
        assert torch.equal(got.cpu(), want)


def test_two_mib_objects_of_many_blocks_in_one_batch(cupy: Any) -> None:
    """A production-sized layout: 32 layers of (2, blocks, 16, 8, 128) bf16, 2 MiB objects."""
    nb, names = 96, [f"model.layers.{i}.attn" for i in range(32)]
    caches = {n: torch.randn(2, nb, 16, 8, 128, device="cuda").to(torch.bfloat16) for n in names}
    spec = SimpleNamespace(page_size_bytes=2 * 16 * 8 * 128 * 2, dtype=torch.bfloat16)
    group = SimpleNamespace(layer_names=names, kv_cache_spec=spec, enable_kv_transfer=True)
    cfg = SimpleNamespace(num_blocks=nb, kv_cache_groups=[group], kv_cache_tensors=[])
    copier, pool, size = _gpu_copier(caches, cfg, 64)
    assert size == 2 << 20
    blocks = tuple(torch.randperm(nb)[:64].tolist())
    copier.gather(StagingCopyPlan((0,) * 64, blocks, tuple(range(64)))).wait()
    for slot in (0, 31, 63):
        b = blocks[slot]
        want = torch.cat(
            [torch.cat([t[0, b].flatten(), t[1, b].flatten()]) for t in caches.values()]
        )
        assert torch.equal(pool.tensor(slot)[:size], want.view(torch.uint8).cpu())


def _fill_all(caches: dict[str, torch.Tensor], value: int) -> None:
    for flat in storages(caches):
        flat.fill_(value)


def test_gather_reads_what_the_engine_stream_wrote_before_it(cupy: Any) -> None:
    cfg, caches = CASES["packed_4d"]("cuda")
    copier, pool, size = _gpu_copier(caches, cfg, 2)
    _fill_all(caches, 0x00)
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)  # the "forward pass" is still running ...
    _fill_all(caches, 0x5A)  # ... and writes the KV last
    copier.gather(StagingCopyPlan((0, 0), (1, 4), (0, 1))).wait()
    assert bool((pool.buffer[:, :size] == 0x5A).all())


def test_engine_stream_does_not_wait_for_the_gather_and_done_says_when_it_read(
    cupy: Any,
) -> None:
    cfg, caches = CASES["packed_4d"]("cuda")
    copier, pool, size = _gpu_copier(caches, cfg, 2)
    # The "next step" kernel and the gather run once first: with CUDA's lazy module
    # loading, a kernel's first launch loads its module, which waits for the whole
    # device (on an H200 that made the engine's fill wait for the sleeping copy stream;
    # seen 2026-12-04). vLLM's forward kernels are loaded by its warm-up long before.
    copier.gather(StagingCopyPlan((0,), (2,), (0,))).wait()
    torch.empty(1024, device="cuda").fill_(1.0)
    _fill_all(caches, 0x5A)
    torch.cuda.synchronize()
    with torch.cuda.stream(copier._streams["store"]):
        torch.cuda._sleep(10 * SLEEP_CYCLES)  # the copy stream is busy with earlier work
    handle = copier.gather(StagingCopyPlan((0, 0), (1, 4), (0, 1)))
    # The next forward pass runs at once: work queued on the engine's stream after
    # the gather completes while the gather is still waiting for its stream.
    next_step = torch.cuda.Event()
    torch.empty(1024, device="cuda").fill_(1.0)
    next_step.record()
    next_step.synchronize()
    assert not handle.done()
    handle.wait()
    assert handle.done()
    assert bool((pool.buffer[:, :size] == 0x5A).all())


def test_scatter_runs_after_the_engine_point_and_wait_returns_when_it_is_in(cupy: Any) -> None:
    cfg, caches = CASES["packed_4d"]("cuda")
    copier, pool, size = _gpu_copier(caches, cfg, 1)
    pool.buffer.fill_(0x77)
    _fill_all(caches, 0x00)
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    _fill_all(caches, 0x11)  # a pending write by the block's previous owner
    point = copier.engine_point()
    copier.scatter(StagingCopyPlan((0,), (2,), (0,)), after=point).wait()
    # Read on a fresh stream that does not wait for the engine's stream.
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        pages = [caches[n][2].contiguous().view(torch.uint8).to("cpu") for n in LAYERS]
        others = [caches[n][3].contiguous().view(torch.uint8).to("cpu") for n in LAYERS]
    side.synchronize()
    assert all(bool((p == 0x77).all()) for p in pages)
    assert all(bool((p == 0x11).all()) for p in others)


def test_auto_backend_picks_the_kernel_on_cuda(cupy: Any) -> None:
    cfg, caches = CASES["mla_3d"]("cuda")
    planner, templates = _planned(caches, cfg)
    pool = StagingPool(templates[0].object_size, templates[0].object_size, pin_memory=True)
    for backend in ("auto", "cupy"):
        assert (
            make_block_copier(backend, caches, templates, pool, planner.num_blocks).name == "cupy"
        )
    assert make_block_copier("torch", caches, templates, pool, planner.num_blocks).name == "torch"
