"""Micro-benchmark of the GPU block copies: gather (device KV -> pinned staging) and
scatter (pinned staging -> device KV) GB/s, against two baselines measured in the same
run on the same bytes:

- ceiling: one plain contiguous copy of the batch's bytes (device <-> pinned host),
  the bandwidth the bus allows;
- torch: per layer, ``index_select`` of the batch's blocks into a device buffer and
  ``copy_`` to pinned staging (scatter: ``copy_`` to the device, then ``index_copy_``).

Besides the CuPy kernel (which uses SMs), a copy-engine variant moves the same ranges with
``cudaMemcpy2DAsync`` (one call per block and merged strided run of the template, DMA
engines, no SMs), to show which of the two ``copy_backend: auto`` should prefer.

The KV cache is vLLM's GPU layout, (2, num_blocks, block_size, kv_heads, head_size) per
layer in bf16: K and V of a block lie apart, so each layer adds two ranges per block.
Usage (on a CUDA machine with CuPy; no Redis, no vLLM, no downloads):

    PYTHONPATH=. python3 -m umbp_redis.bench.gpu_copy [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

from umbp_redis.data import KVLayoutPlanner, StagingCopyPlan
from umbp_redis.engine.copy.cuda_copy import CHUNK_BYTES, THREADS_PER_CTA, CupyBlockCopier
from umbp_redis.engine.staging import StagingPool

GB = 1e9


def timed(fn: Callable[[], object], reps: int, warmup: int = 3) -> float:
    """Median wall seconds of ``fn`` (each call is complete on return)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def build_cache(  # type: ignore[no-untyped-def]
    layers: int,
    num_blocks: int,
    block_size: int,
    heads: int,
    head_size: int,
    device: str = "cuda",
):
    """vLLM's GPU layout on ``device``, random bytes; the KV cache config a planner reads."""
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    caches = {
        n: torch.empty(
            2, num_blocks, block_size, heads, head_size, dtype=torch.bfloat16, device=device
        )
        for n in names
    }
    for t in caches.values():
        t.view(torch.int16).random_()
    spec = SimpleNamespace(
        page_size_bytes=2 * block_size * heads * head_size * 2, dtype=torch.bfloat16
    )
    cfg: Any = SimpleNamespace(
        num_blocks=num_blocks,
        kv_cache_groups=[
            SimpleNamespace(layer_names=names, kv_cache_spec=spec, enable_kv_transfer=True)
        ],
        kv_cache_tensors=[],
    )
    return cfg, caches


def runs_within(runs: Any, spans: list[tuple[int, int]]) -> list[Any]:
    """``runs`` split so that no run's pieces lie in two allocations (``spans``:
    (start, end) of each KV tensor's storage). A 2D copy whose rows cross from one
    ``cudaMalloc`` allocation into the next is refused (invalid argument), even when
    the two allocations are adjacent and the step is equal."""

    def span_of(address: int) -> int:
        return next(i for i, (a, b) in enumerate(spans) if a <= address < b)

    out: list[Any] = []
    for run in runs:
        group: list[Any] = []
        for piece in run.pieces():
            if group and span_of(piece.engine_base) != span_of(group[0].engine_base):
                out.append(_joined(group))
                group = []
            group.append(piece)
        out.append(_joined(group))
    return out


def _joined(pieces: list[Any]) -> Any:
    first = pieces[0]
    step = pieces[1].engine_base - first.engine_base if len(pieces) > 1 else first.length
    return dataclasses.replace(first, step=step, count=len(pieces))


def dma_copy(runs: list[Any], pool: StagingPool, plan: StagingCopyPlan, *, gather: bool) -> None:
    """The plan's blocks moved by the copy engines: one ``cudaMemcpy2DAsync`` per block
    and run (``count`` pieces ``step`` apart in the engine, back to back in the object),
    all on the current stream; complete on return."""
    import cupy

    rt = cupy.cuda.runtime
    stream = torch.cuda.current_stream().cuda_stream
    for block, slot in zip(plan.block_ids, plan.slots, strict=True):
        host_base = pool.tensor(slot).data_ptr()
        for r in runs:
            dev = r.engine_base + block * r.block_stride
            host = host_base + r.object_offset
            if gather:
                rt.memcpy2DAsync(
                    host, r.length, dev, r.step, r.length, r.count, rt.memcpyDeviceToHost, stream
                )
            else:
                rt.memcpy2DAsync(
                    dev, r.step, host, r.length, r.length, r.count, rt.memcpyHostToDevice, stream
                )
    torch.cuda.synchronize()


def run_case(
    label: str, layers: int, batch: int, num_blocks: int, reps: int, sweep: bool
) -> dict[str, Any]:
    cfg, caches = build_cache(layers, num_blocks, 16, 8, 128)
    planner = KVLayoutPlanner(cfg)
    bases = planner.register_kv_caches(caches)
    template = planner.range_template(0, bases)
    size = template.object_size
    pool = StagingPool(size, batch * size, pin_memory=True)
    blocks = tuple(sorted(torch.randperm(num_blocks)[:batch].tolist()))
    plan = StagingCopyPlan((0,) * batch, blocks, tuple(range(batch)))
    nbytes = batch * size
    ids = torch.tensor(blocks, device="cuda")

    # Ceiling: the same bytes as one contiguous copy each way.
    dev_buf = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = pool.buffer.view(-1)[:nbytes]

    def plain_d2h() -> None:
        host.copy_(dev_buf, non_blocking=True)
        torch.cuda.synchronize()

    def plain_h2d() -> None:
        dev_buf.copy_(host, non_blocking=True)
        torch.cuda.synchronize()

    d2h = timed(plain_d2h, reps)
    h2d = timed(plain_h2d, reps)

    # torch baseline: per layer, index_select + copy_ to pinned (and back).
    layer_bytes = nbytes // layers
    tensors = list(caches.values())
    tmp = torch.empty((2, batch) + tuple(tensors[0].shape[2:]), dtype=torch.bfloat16, device="cuda")

    def torch_gather() -> None:
        for i, t in enumerate(tensors):
            torch.index_select(t, 1, ids, out=tmp)
            host[i * layer_bytes : (i + 1) * layer_bytes].copy_(
                tmp.view(-1).view(torch.uint8), non_blocking=True
            )
        torch.cuda.synchronize()

    def torch_scatter() -> None:
        for i, t in enumerate(tensors):
            tmp.view(-1).view(torch.uint8).copy_(
                host[i * layer_bytes : (i + 1) * layer_bytes], non_blocking=True
            )
            t.index_copy_(1, ids, tmp)
        torch.cuda.synchronize()

    base_g = timed(torch_gather, reps)
    base_s = timed(torch_scatter, reps)

    def kernel_times(chunk: int, threads: int) -> tuple[float, float]:
        copier = CupyBlockCopier(
            caches, {0: template}, pool, num_blocks, chunk_bytes=chunk, threads_per_cta=threads
        )
        g = timed(lambda: copier.gather(plan).wait(), reps)
        s = timed(lambda: copier.scatter(plan).wait(), reps)
        return g, s

    gather_s, scatter_s = kernel_times(CHUNK_BYTES, THREADS_PER_CTA)
    storages = [t.untyped_storage() for t in tensors]
    spans = [(st.data_ptr(), st.data_ptr() + st.nbytes()) for st in storages]
    runs = runs_within(template.runs(), spans)
    dma_g = timed(lambda: dma_copy(runs, pool, plan, gather=True), reps)
    dma_s = timed(lambda: dma_copy(runs, pool, plan, gather=False), reps)
    dma_copy(runs, pool, plan, gather=True)
    b0 = blocks[0]
    want0 = torch.cat([torch.cat([t[0, b0].flatten(), t[1, b0].flatten()]) for t in tensors])
    assert torch.equal(pool.tensor(0)[:size], want0.view(torch.uint8).cpu()), (
        "copy-engine gather bytes differ"
    )

    # Correctness of what was timed: a block's object is each layer's K then V page.
    copier = CupyBlockCopier(caches, {0: template}, pool, num_blocks)
    copier.gather(plan).wait()
    b = blocks[-1]
    want = torch.cat([torch.cat([t[0, b].flatten(), t[1, b].flatten()]) for t in tensors])
    assert torch.equal(pool.tensor(batch - 1)[:size], want.view(torch.uint8).cpu()), (
        "gather bytes differ"
    )

    out: dict[str, Any] = {
        "case": label,
        "object_bytes": size,
        "ranges_per_block": len(template),
        "batch_blocks": batch,
        "batch_bytes": nbytes,
        "ceiling_d2h_GBps": nbytes / d2h / GB,
        "ceiling_h2d_GBps": nbytes / h2d / GB,
        "torch_gather_GBps": nbytes / base_g / GB,
        "torch_scatter_GBps": nbytes / base_s / GB,
        "kernel_gather_GBps": nbytes / gather_s / GB,
        "kernel_scatter_GBps": nbytes / scatter_s / GB,
        "dma_gather_GBps": nbytes / dma_g / GB,
        "dma_scatter_GBps": nbytes / dma_s / GB,
        "dma_calls_per_block": len(runs),
    }
    out["gather_vs_ceiling"] = out["kernel_gather_GBps"] / out["ceiling_d2h_GBps"]
    out["scatter_vs_ceiling"] = out["kernel_scatter_GBps"] / out["ceiling_h2d_GBps"]
    out["gather_vs_torch"] = out["kernel_gather_GBps"] / out["torch_gather_GBps"]
    out["scatter_vs_torch"] = out["kernel_scatter_GBps"] / out["torch_scatter_GBps"]
    out["dma_gather_vs_ceiling"] = out["dma_gather_GBps"] / out["ceiling_d2h_GBps"]
    out["dma_scatter_vs_ceiling"] = out["dma_scatter_GBps"] / out["ceiling_h2d_GBps"]
    if sweep:
        grid = {}
        for chunk in (8 << 10, 16 << 10, 64 << 10):
            for threads in (128, 256, 512):
                g, s = kernel_times(chunk, threads)
                grid[f"{chunk >> 10}KiB/{threads}t"] = (nbytes / g / GB, nbytes / s / GB)
        out["sweep_gather_scatter_GBps"] = grid
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--no-sweep", action="store_true", help="skip the chunk/threads sweep")
    args = ap.parse_args()
    torch.cuda.init()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    cases = [
        # label, layers, batch blocks, engine blocks
        ("2 MiB objects (32 layers), 64-block batch", 32, 64, 1024, not args.no_sweep),
        ("2 MiB objects (32 layers), 1-block batch", 32, 1, 1024, False),
        ("256 KiB objects (4 layers), 64-block batch", 4, 64, 4096, False),
    ]
    results = [
        run_case(label, layers, batch, nb, args.reps, sweep)
        for label, layers, batch, nb, sweep in cases
    ]
    print(
        f"{'case':45} {'ceil d2h':>9} {'torch g':>8} {'kernel g':>9} {'g/ceil':>7} {'g/torch':>8}"
        f" | {'ceil h2d':>9} {'torch s':>8} {'kernel s':>9} {'s/ceil':>7} {'s/torch':>8}"
    )
    for r in results:
        g = (r["ceiling_d2h_GBps"], r["torch_gather_GBps"], r["kernel_gather_GBps"])
        sc = (r["ceiling_h2d_GBps"], r["torch_scatter_GBps"], r["kernel_scatter_GBps"])
        cells = [
            f"{g[0]:9.1f} {g[1]:8.1f} {g[2]:9.1f}",
            f"{r['gather_vs_ceiling']:6.2f}x {r['gather_vs_torch']:7.2f}x",
            f"| {sc[0]:9.1f} {sc[1]:8.1f} {sc[2]:9.1f}",
            f"{r['scatter_vs_ceiling']:6.2f}x {r['scatter_vs_torch']:7.2f}x",
        ]
        print(f"{r['case']:45} " + " ".join(cells))
    for r in results:
        print(
            f"copy engine {r['case'][:33]:33} ({r['dma_calls_per_block']} calls/block):"
            f" gather {r['dma_gather_GBps']:6.1f} GB/s ({r['dma_gather_vs_ceiling']:.2f}x ceil),"
            f" scatter {r['dma_scatter_GBps']:6.1f} GB/s ({r['dma_scatter_vs_ceiling']:.2f}x ceil)"
        )
    for r in results:
        for k, (g, s) in r.get("sweep_gather_scatter_GBps", {}).items():
            print(f"sweep {r['case'][:20]} {k:>12}: gather {g:6.1f} GB/s, scatter {s:6.1f} GB/s")
    print("GB/s = 1e9 bytes per second; goal: kernel >= 0.8x ceiling for 2 MiB objects")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
