"""CPU-side cost of moving one batch of blocks, measured on any machine (no GPU):

- host planning per batch: lowering every block to its ranges in Python (what a
  per-block plan costs; the torch executor still does this) against the GPU copier's
  host work before a launch (``StagingCopyPlan.by_group`` + ``launch_entries``);
- the torch executor's gather/scatter on CPU tensors against one contiguous copy of
  the same bytes (the memory-bandwidth ceiling of this machine).

Layout: 32 layers of (2, blocks, 16, 8, 128) bf16 (vLLM's GPU layout), 2 MiB objects of
64 ranges. Usage: .venv/bin/python benchmarks/copy_planning_bench.py
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

from umbp_redis.cpu_copy import TorchBlockCopier
from umbp_redis.data import KVLayoutPlanner, StagingCopyPlan
from umbp_redis.gpu_copy import chunk_table, launch_entries
from umbp_redis.staging import StagingPool


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
    spec = SimpleNamespace(page_size_bytes=2 * 16 * 8 * 128 * 2, dtype=torch.bfloat16)
    cfg: Any = SimpleNamespace(
        num_blocks=nb,
        kv_cache_groups=[SimpleNamespace(layer_names=names, kv_cache_spec=spec)],
        kv_cache_tensors=[],
    )
    planner = KVLayoutPlanner(cfg)
    bases = planner.register_kv_caches(caches)
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

    pool = StagingPool(size, batch * size)
    copier = TorchBlockCopier(caches, {0: template}, pool, nb)
    plan = StagingCopyPlan((0,) * batch, blocks, slots)
    nbytes = batch * size
    src = torch.empty(nbytes, dtype=torch.uint8)
    src.random_()
    flat = pool.buffer.view(-1)[:nbytes]
    ceiling = timed(lambda: flat.copy_(src))
    gather = timed(lambda: copier.gather(plan))
    scatter = timed(lambda: copier.scatter(plan))
    gbps = lambda t: nbytes / t / 1e9  # noqa: E731
    print(f"CPU copies of {nbytes >> 20} MiB: one contiguous copy {gbps(ceiling):6.2f} GB/s")
    print(
        f"  torch executor gather {gbps(gather):6.2f} GB/s ({ceiling / gather:.2f}x of it), "
        f"scatter {gbps(scatter):6.2f} GB/s ({ceiling / scatter:.2f}x)"
    )


if __name__ == "__main__":
    main()
