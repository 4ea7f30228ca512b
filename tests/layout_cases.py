"""KV layouts built without vLLM, on any device, for the copy-executor tests.

The GPU check machine has torch and CuPy but no vLLM, so these cases describe their
KV cache configs with plain namespaces carrying the attributes ``KVLayoutPlanner``
reads (``num_blocks``, ``kv_cache_groups``, ``kv_cache_tensors``).
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

LAYERS = ("layers.0.attn", "layers.1.attn", "layers.2.attn")
Case = tuple[Any, dict[str, torch.Tensor]]  # (a KVCacheConfig look-alike, caches)


def _config(
    num_blocks: int, page_bytes: int | None, dtype: torch.dtype, block_stride: int | None = None
) -> Any:
    spec = SimpleNamespace(page_size_bytes=page_bytes, dtype=dtype)
    tensors = []
    if block_stride is not None:
        tensors = [SimpleNamespace(layers=list(LAYERS), block_stride=block_stride)]
    return SimpleNamespace(
        num_blocks=num_blocks,
        kv_cache_groups=[
            SimpleNamespace(layer_names=list(LAYERS), kv_cache_spec=spec, enable_kv_transfer=True)
        ],
        kv_cache_tensors=tensors,
    )


def kv_outer_5d(device: str, nb: int = 6) -> Case:
    """(2, blocks, block_size, heads, head_size) per layer: K and V of a block lie apart."""
    bs, h, hs = 16, 2, 64
    caches = {n: torch.empty(2, nb, bs, h, hs, dtype=torch.bfloat16, device=device) for n in LAYERS}
    return _config(nb, 2 * bs * h * hs * 2, torch.bfloat16), caches


def packed_4d(device: str, nb: int = 7) -> Case:
    """(blocks, heads, block_size, 2*head_size) per layer (vLLM 0.32's CPU layout)."""
    bs, h, hs = 16, 4, 64
    caches = {
        n: torch.empty(nb, h, bs, 2 * hs, dtype=torch.bfloat16, device=device) for n in LAYERS
    }
    return _config(nb, h * bs * 2 * hs * 2, torch.bfloat16), caches


def mla_3d(device: str, nb: int = 6) -> Case:
    """(blocks, block_size, latent) per layer: one latent vector per token."""
    bs, latent = 16, 576
    caches = {n: torch.empty(nb, bs, latent, dtype=torch.bfloat16, device=device) for n in LAYERS}
    return _config(nb, bs * latent * 2, torch.bfloat16), caches


def shared_strided(device: str, nb: int = 6) -> Case:
    """Layers interleaved block by block in one buffer (block stride = all layers' pages)."""
    bs, h, hs = 16, 2, 64
    page = h * bs * 2 * hs
    shared = torch.empty(nb * len(LAYERS) * page, dtype=torch.bfloat16, device=device)
    caches = {
        n: torch.as_strided(
            shared,
            (nb, h, bs, 2 * hs),
            (len(LAYERS) * page, bs * 2 * hs, 2 * hs, 1),
            storage_offset=i * page,
        )
        for i, n in enumerate(LAYERS)
    }
    return _config(nb, page * 2, torch.bfloat16, block_stride=len(LAYERS) * page * 2), caches


def odd_byte_runs(device: str, nb: int = 6) -> Case:
    """Byte elements, heads padded one byte apart, views at odd offsets: runs whose
    addresses and lengths share no word size (the kernel's narrowest copies)."""
    bs, h, hs = 3, 2, 7
    head = bs * hs + 1  # one byte of padding between heads
    per_layer = nb * h * head
    base = torch.empty(1 + len(LAYERS) * per_layer, dtype=torch.uint8, device=device)
    caches = {
        n: torch.as_strided(
            base, (nb, bs, h, hs), (h * head, hs, head, 1), storage_offset=1 + i * per_layer
        )
        for i, n in enumerate(LAYERS)
    }
    return _config(nb, None, torch.uint8), caches


CASES: dict[str, Callable[[str], Case]] = {
    "kv_outer_5d": kv_outer_5d,
    "packed_4d": packed_4d,
    "mla_3d": mla_3d,
    "shared_strided": shared_strided,
    "odd_byte_runs": odd_byte_runs,
}


def _flat(t: torch.Tensor) -> torch.Tensor:
    st = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(st, 0, (st.nbytes(),), (1,))


def storages(caches: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Every distinct storage behind ``caches`` as a flat uint8 tensor, in layer order."""
    out: dict[int, torch.Tensor] = {}
    for t in caches.values():
        out.setdefault(t.untyped_storage().data_ptr(), _flat(t))
    return list(out.values())


def fill_random(caches: dict[str, torch.Tensor], seed: int = 0) -> None:
    """Random bytes in every storage behind ``caches`` (generated on the CPU)."""
    g = torch.Generator().manual_seed(seed)
    for flat in storages(caches):
        flat.copy_(torch.randint(0, 256, (flat.numel(),), dtype=torch.uint8, generator=g))


def zeroed_clone(caches: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Zeroed tensors with the same shapes, strides and sharing (a second engine)."""
    buffers: dict[int, torch.Tensor] = {}
    out = {}
    for name, t in caches.items():
        st = t.untyped_storage()
        if st.data_ptr() not in buffers:
            buffers[st.data_ptr()] = torch.zeros(st.nbytes(), dtype=torch.uint8, device=t.device)
        buf = buffers[st.data_ptr()]
        out[name] = torch.empty(0, dtype=t.dtype, device=t.device).set_(
            buf.untyped_storage(), t.storage_offset(), t.shape, t.stride()
        )
    return out


def page_bytes(tensor: torch.Tensor, block: int, num_blocks: int | None = None) -> torch.Tensor:
    """Reference: the page of ``block`` as bytes in memory order (on the CPU), computed
    independently of the planner. The block dim is 0, or 1 for 5-D K/V-outer tensors;
    with ``num_blocks``, a block spans ``shape[dim] // num_blocks`` kernel blocks."""
    bdim = 1 if tensor.dim() == 5 and tensor.shape[0] == 2 else 0
    ratio = tensor.shape[bdim] // num_blocks if num_blocks else 1
    page = tensor.narrow(bdim, block * ratio, ratio)
    order = sorted(range(page.dim()), key=lambda d: page.stride(d), reverse=True)
    return page.permute(order).contiguous().view(-1).view(torch.uint8).cpu()
