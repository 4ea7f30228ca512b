"""A cheap fingerprint of the model's weights, part of the derived key namespace.

The namespace already covers the model path, revision and effective config; this
covers the weights themselves, so new weights written to the same path (a new
fine-tune, a re-quantisation) never load KV computed with the old ones.

* A local folder or file: every weight file's name and size, plus an xxh3-128 of
  ``SAMPLES`` evenly spaced 64 KiB windows of each (``weights_fingerprint: sampled``,
  a few MiB read at startup), or of the whole file (``full``).
* A model id from the Hugging Face hub cache: the commit the cached snapshot resolves
  to (a new upload is a new commit).
* ``load_format: dummy``: random weights, named as such with the seed.

What it cannot see: with ``sampled``, an in-place edit confined to bytes between the
windows (same file names and sizes). Use ``full``, a new ``revision``, or an explicit
``key_namespace`` when weights are patched that way.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import xxhash

log = logging.getLogger(__name__)

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz", ".msgpack", ".h5")
SAMPLES = 16
WINDOW = 64 << 10
_FULL_CHUNK = 8 << 20


def _weight_files(root: Path) -> list[Path]:
    if root.is_file():
        return [root]
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))


def _file_digest(path: Path, full: bool) -> str:
    h = xxhash.xxh3_128()
    size = path.stat().st_size
    with open(path, "rb") as f:
        if full:
            while chunk := f.read(_FULL_CHUNK):
                h.update(chunk)
        else:
            step = max(1, (size - WINDOW) // max(1, SAMPLES - 1)) if size > WINDOW else 0
            offsets = sorted({min(max(0, size - WINDOW), i * step) for i in range(SAMPLES)})
            for off in offsets:
                f.seek(off)
                h.update(f.read(WINDOW))
    return h.hexdigest()


def local_fingerprint(root: Path, *, full: bool = False) -> str | None:
    """Digest of the weight files under ``root`` (None if there are none)."""
    files = _weight_files(root)
    if not files:
        return None
    h = xxhash.xxh3_128()
    for p in files:
        rel = p.name if root.is_file() else str(p.relative_to(root))
        h.update(f"{rel}\0{p.stat().st_size}\0{_file_digest(p, full)}\0".encode())
    return ("full:" if full else "sampled:") + h.hexdigest()


def _hub_commit(model: str, revision: str | None) -> str | None:
    try:
        from huggingface_hub import snapshot_download

        path = snapshot_download(repo_id=model, revision=revision, local_files_only=True)
    except Exception:
        return None
    return Path(path).name or None


def weights_fingerprint(model_config: Any, mode: str = "sampled", load_format: str = "auto") -> str:
    """The weights part of the namespace for ``model_config`` (``mode``: sampled, full,
    off), loaded with ``load_format`` (vLLM's ``LoadConfig.load_format``): ``dummy``
    weights are random, never those of the files at the model's path.

    Never raises: weights it cannot read are named ``unknown`` (with one warning), so
    the namespace still separates models by path, revision and config.
    """
    if mode == "off":
        return "off"
    if str(load_format) == "dummy":
        return f"dummy:seed={getattr(model_config, 'seed', None)}"
    model = str(model_config.model or "")
    try:
        if model and os.path.exists(model):
            fp = local_fingerprint(Path(model), full=mode == "full")
            if fp is not None:
                return fp
        commit = _hub_commit(model, model_config.revision)
        if commit is not None:
            return f"hub:{commit}"
    except OSError as e:
        log.warning("umbp-redis: cannot fingerprint the weights of %s: %s", model, e)
        return "unknown"
    log.warning(
        "umbp-redis: found no weight files for %s; the key namespace covers its path, "
        "revision and config but not its weights (set key_namespace when weights change)",
        model,
    )
    return "unknown"
