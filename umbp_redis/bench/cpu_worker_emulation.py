"""Shared by the CPU-worker benchmarks: a vLLM CPU worker's binding, a forward-like
torch loop and a private Redis server on the reserved CPUs.

The forward is 8 layers of a hidden-1024 Llama computing 56 new tokens over a 3000-token
prefix (projections, attention, MLP): the remaining prefill of a warm 3000-token prompt
in ``bench/warm_ttft.py``.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

LAYERS, HIDDEN, INTER, NEW_TOKENS, PREFIX = 8, 1024, 2816, 56, 3000


def omp_binding_env(cpus: list[int]) -> dict[str, str]:
    """The environment with which vLLM's CPU executor binds a worker's OpenMP threads to
    ``cpus`` (libgomp without ``LD_PRELOAD``: ``OMP_PLACES`` and ``OMP_PROC_BIND``)."""
    return {
        "OMP_NUM_THREADS": str(len(cpus)),
        "OMP_PLACES": "{" + ",".join(map(str, cpus)) + "}",
        "OMP_PROC_BIND": "true",
    }


def bind_like_vllm() -> tuple[int, list[int]]:
    """Re-exec this script with its OpenMP threads bound to the first CPU (1 thread, as
    vLLM's executor binds a worker with the other cores reserved); returns (forward CPU,
    reserved CPUs) once bound. Exits where there are fewer than 2 CPUs."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        sys.exit("needs at least 2 CPUs (one for the forward pass, one reserved)")
    forward_cpu, reserved = cpus[0], cpus[1:]
    binding = omp_binding_env([forward_cpu])
    if os.environ.get("OMP_PLACES") != binding["OMP_PLACES"]:
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **binding})
    return forward_cpu, reserved


def start(doc: str) -> tuple[argparse.Namespace, int, list[int]]:
    """Parse ``--reps`` (default 7) and bind as ``bind_like_vllm``: (args, forward CPU,
    reserved CPUs)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    return (args, *bind_like_vllm())


@contextmanager
def redis_on(cpus: list[int]) -> Iterator[str]:
    """A private redis-server bound to ``cpus``; yields its URL."""
    from umbp_redis.testing.embedded_redis import find_redis_server, free_port

    port = free_port()
    server = subprocess.Popen(
        [find_redis_server(), "--port", str(port), "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        preexec_fn=lambda: os.sched_setaffinity(0, cpus),
    )
    try:
        for _ in range(100):  # until it accepts connections
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        server.terminate()
        server.wait()


def forward_layers() -> Callable[[int, Any], Any]:
    """``layer(j, x)``: layer ``j`` of the forward-like model; ``x`` starts as
    ``initial_hidden()``."""
    import torch

    torch.manual_seed(0)
    h, inter, t = HIDDEN, INTER, NEW_TOKENS
    weights = [
        (
            torch.randn(h, 1536) / 32,
            torch.randn(h, h) / 32,
            torch.randn(h, 2 * inter) / 32,
            torch.randn(inter, h) / 32,
        )
        for _ in range(LAYERS)
    ]
    k_cache, v_cache = torch.randn(1, 16, PREFIX, 64), torch.randn(1, 16, PREFIX, 64)

    def layer(j: int, x: Any) -> Any:
        wqkv, wo, wup, wdown = weights[j]
        q = (x @ wqkv)[:, :h].reshape(1, t, 16, 64).transpose(1, 2)
        a = torch.nn.functional.scaled_dot_product_attention(q, k_cache, v_cache)
        x = x + a.transpose(1, 2).reshape(t, h) @ wo
        g = x @ wup
        return x + (torch.nn.functional.silu(g[:, :inter]) * g[:, inter:]) @ wdown

    return layer


def initial_hidden() -> Any:
    """The hidden states the forward starts from."""
    import torch

    return torch.randn(NEW_TOKENS, HIDDEN)


class Forward:
    """The forward-like loop, timed; with ``ready``, layer j first waits for its event."""

    def __init__(self) -> None:
        self.layer, self.x0 = forward_layers(), initial_hidden()

    def __call__(self, ready: list[threading.Event] | None = None) -> float:
        start = time.perf_counter()
        x = self.x0
        for j in range(LAYERS):
            if ready is not None:
                ready[j].wait()
            x = self.layer(j, x)
        return time.perf_counter() - start
