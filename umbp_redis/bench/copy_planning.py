"""CPU-side cost of moving one batch of blocks, measured on any machine (no GPU):

- host planning per batch: lowering every block to its ranges in Python (what a
  per-block plan costs) against the executors' host work before their copies (the GPU
  copier's ``by_group`` + ``launch_entries``, the torch executor's ``by_group`` +
  ``consecutive_sequences``);
- the torch executor's gather/scatter (strided runs, consecutive blocks batched) and
  plain per-range copies on CPU tensors, against one contiguous copy of the same bytes
  (the memory-bandwidth ceiling of this machine).

Layouts: 32 layers of (2, blocks, 16, 8, 128) bf16 (vLLM's GPU layout: 64 ranges a
block) and of vLLM 0.32's CPU layout (one shared tensor; 32 ranges a block, one run);
2 MiB objects, 64-block batches. Usage: .venv/bin/python -m umbp_redis.bench.copy_planning
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

from umbp_redis.data import KVLayoutPlanner, StagingCopyPlan
from umbp_redis.engine.copy.cuda_copy import chunk_table, launch_entries
from umbp_redis.engine.copy.torch_copy import (
    KVStorageRanges,
    TorchBlockCopier,
    consecutive_sequences,
)
from umbp_redis.engine.staging import StagingPool


def timed(fn: Callable[[], object], reps: int = 15) -> float:
    """Median wall seconds of ``fn`` after two warm-up calls."""
    fn()
    fn()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def main() -> None:
    layers, nb, batch = 32, 128, 64
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    caches = {n: torch.empty(2, nb, 16, 8, 128, dtype=torch.bfloat16) for n in names}
    for t in caches.values():
        t.view(torch.int16).random_()
    planner = registered_planner(caches, 2 * 16 * 8 * 128 * 2, nb)
    bases = planner.base_addresses
    template = planner.range_template(0, bases)
    size = template.object_size
    blocks = tuple(sorted(torch.randperm(nb)[:batch].tolist()))
    slots = tuple(range(batch))
    print(
        f"layout: {layers} layers, {size >> 20} MiB objects, {len(template)} ranges/block, "
        f"{len(chunk_table(template).T)} kernel chunks/block; batch {batch} blocks"
    )

    per_block = timed(lambda: [template.ranges_for(b) for b in blocks])
    planned = timed(lambda: [planner.plan_for_block("k", b, bases) for b in blocks])
    launch = timed(
        lambda: [
            launch_entries(b, s)
            for b, s in StagingCopyPlan((0,) * batch, blocks, slots).by_group().values()
        ]
    )
    print(f"host planning per batch: plan_for_block x{batch} {planned * 1e3:8.3f} ms")
    print(f"                         ranges_for x{batch}     {per_block * 1e3:8.3f} ms")
    print(
        f"                         GPU launch entries  {launch * 1e3:8.3f} ms"
        f"  ({planned / launch:.0f}x less than plan_for_block)"
    )
    sequences = timed(
        lambda: [
            consecutive_sequences(b, s)
            for b, s in StagingCopyPlan((0,) * batch, blocks, slots).by_group().values()
        ]
    )
    print(
        f"                         torch sequences     {sequences * 1e3:8.3f} ms"
        f"  ({planned / sequences:.0f}x less than plan_for_block)"
    )

    print("CPU copies of one batch (GB/s; ratio to one contiguous copy of the same bytes):")
    copy_rates("GPU layout, random blocks", caches, planner, batch, blocks)
    cpu_caches, cpu_planner = cpu_layout(layers, nb)
    copy_rates("vLLM CPU layout, random blocks", cpu_caches, cpu_planner, batch, blocks)
    run_of_blocks = tuple(range(32, 32 + batch))
    copy_rates("vLLM CPU layout, consecutive blocks", cpu_caches, cpu_planner, batch, run_of_blocks)


def cpu_layout(layers: int, nb: int) -> tuple[dict[str, torch.Tensor], KVLayoutPlanner]:
    """vLLM 0.32's CPU layout: every layer a (blocks, 8, 16, 2 * 128) bf16 view into one
    shared tensor, one layer stride apart (2 MiB objects, one range a layer)."""
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    shape = (nb, 8, 16, 2 * 128)
    per_layer = nb * 8 * 16 * 2 * 128
    shared = torch.empty(layers * per_layer, dtype=torch.bfloat16)
    shared.view(torch.int16).random_()
    caches = {
        n: shared[i * per_layer : (i + 1) * per_layer].view(shape) for i, n in enumerate(names)
    }
    return caches, registered_planner(caches, 8 * 16 * 2 * 128 * 2, nb)


def registered_planner(
    caches: dict[str, torch.Tensor], page_bytes: int, nb: int
) -> KVLayoutPlanner:
    """A planner of one bf16 attention group over ``caches``, registered."""
    spec = SimpleNamespace(page_size_bytes=page_bytes, dtype=torch.bfloat16)
    cfg: Any = SimpleNamespace(
        num_blocks=nb,
        kv_cache_groups=[
            SimpleNamespace(layer_names=list(caches), kv_cache_spec=spec, enable_kv_transfer=True)
        ],
        kv_cache_tensors=[],
    )
    planner = KVLayoutPlanner(cfg)
    planner.register_kv_caches(caches)
    return planner


def copy_rates(
    label: str,
    caches: dict[str, torch.Tensor],
    planner: KVLayoutPlanner,
    batch: int,
    blocks: tuple[int, ...],
) -> None:
    """Print the torch executor's and per-range copies' gather and scatter rates for one
    batch of ``blocks`` into consecutive slots, against one contiguous copy."""
    bases = planner.base_addresses
    template = planner.range_template(0, bases)
    size = template.object_size
    pool = StagingPool(size, batch * size)
    copier = TorchBlockCopier(caches, {0: template}, pool, planner.num_blocks)
    reference = KVStorageRanges(caches)
    slots = tuple(range(batch))
    plan = StagingCopyPlan((0,) * batch, blocks, slots)
    ranges = [template.ranges_for(b) for b in blocks]
    nbytes = batch * size
    src = torch.empty(nbytes, dtype=torch.uint8)
    src.random_()
    flat = pool.buffer.view(-1)[:nbytes]
    ceiling = timed(lambda: flat.copy_(src))

    def per_range(gather: bool) -> None:
        for s, rs in zip(slots, ranges, strict=True):
            if gather:
                reference.gather_ranges(rs, pool.tensor(s))
            else:
                reference.scatter_ranges(rs, pool.tensor(s))

    rows = [
        ("torch executor", lambda: copier.gather(plan), lambda: copier.scatter(plan)),
        ("per-range copies", lambda: per_range(True), lambda: per_range(False)),
    ]
    calls = len(template.runs()) * len(consecutive_sequences(blocks, slots))
    print(
        f"  {label}: {len(template)} ranges/block, {len(template.runs())} runs/block, "
        f"{calls} executor copy calls/batch; contiguous copy {nbytes / ceiling / 1e9:.2f} GB/s"
    )
    for name, gather, scatter in rows:
        g, sc = timed(gather), timed(scatter)
        print(
            f"    {name:17s} gather {nbytes / g / 1e9:6.2f} ({ceiling / g:.2f}x)"
            f"  scatter {nbytes / sc / 1e9:6.2f} ({ceiling / sc:.2f}x)"
        )


if __name__ == "__main__":
    main()
