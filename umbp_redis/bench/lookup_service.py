"""The prefix-lookup service: hashing plus the marker round trip, for prompts of 1k, 32k
and 128k tokens, against the engine's own lookup of the same prompt.

A private redis-server holds a namespace record and the stored marker of every block of
each prompt (every block hits: the longest answer). For each prompt length and block
size (128: vLLM's CPU block size; 16: its usual GPU one), in one run:

- ``service``: ``CacheLookup.lookup(model, token_ids=...)``: the prompt's block hashes
  (vLLM's sha256 over pickled tokens, as the engines compute them), the markers' commands
  and one pipelined round trip;
- ``hashing``: the block hashes alone (``PromptHasher``);
- ``engine``: what an engine's scheduler does for the same prompt, whose hashes vLLM
  computed when the request arrived: the markers' commands built (``PrefixLookup`` keeps
  them per request) and the same round trip (``lookup_blocks``), timed the same way.

Prints p50 and p99 in ms and the service's p50 against the engine's.
Usage: .venv/bin/python -m umbp_redis.bench.lookup_service [--runs N]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import redis

from umbp_redis.data import BlockIdentityCodec, CacheGroupReach
from umbp_redis.data.lookup_record import NamespaceRecord, record_key
from umbp_redis.router.prefix_lookup import CacheLookup, PromptHasher
from umbp_redis.testing.embedded_redis import EmbeddedRedis


def _record(ns: str, bs: int) -> NamespaceRecord:
    import hashlib

    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import resolve_none_hash_seed

    digest = hashlib.sha256(bytes(sha256(resolve_none_hash_seed(sha256)))).hexdigest()[:16]
    return NamespaceRecord(
        namespace=ns,
        model=f"bench-{bs}",
        tokenizer="none",
        served_names=(),
        block_size=bs,
        hash_block_size=bs,
        hash_algo="sha256",
        reproducible=True,
        none_hash_digest=digest,
        groups=(CacheGroupReach(0, "full_attention", bs, 0),),
    )


def _times(fn: Callable[[], Any], runs: int) -> tuple[float, float]:
    fn()
    samples = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    samples.sort()
    return statistics.median(samples), samples[min(len(samples) - 1, int(0.99 * len(samples)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=200)
    args = ap.parse_args()
    rows = []
    with EmbeddedRedis() as srv:
        r = redis.Redis.from_url(srv.url)
        lookup = CacheLookup(srv.url)
        plane = lookup._plane
        for bs in (128, 16):  # both records before the service first reads them
            r.set(record_key(f"bench{bs}"), _record(f"bench{bs}", bs).to_json())
        for bs in (128, 16):
            rec = _record(f"bench{bs}", bs)
            hasher = PromptHasher(rec)
            codec = BlockIdentityCodec(rec.namespace)
            for n_tokens in (1024, 32 * 1024, 128 * 1024):
                tokens = list(range(5, 5 + n_tokens + 1))
                hashes = hasher.block_hashes(tokens)[: n_tokens // bs]
                pipe = r.pipeline(transaction=False)
                for h in hashes:
                    pipe.set(codec.marker_key(h, 0), b"1")
                pipe.execute()
                ans = lookup.lookup(rec.model, token_ids=tokens)
                assert ans.cached_tokens == len(hashes) * bs, ans
                service = _times(lambda: lookup.lookup(rec.model, token_ids=tokens), args.runs)  # noqa: B023
                hashing = _times(lambda: hasher.block_hashes(tokens), args.runs)  # noqa: B023

                def engine() -> None:
                    enc = plane.lookup_encoder(
                        [codec.marker_prefix(0).encode()],  # noqa: B023
                        refresh_ttl=False,
                        hash_hex_len=64,
                    )
                    cmds = [enc.encode(h.hex().encode()) for h in hashes]  # noqa: B023
                    replies = plane.lookup_blocks(cmds, len(cmds))
                    assert replies is not None and sum(replies) == len(cmds)

                eng = _times(engine, args.runs)
                rows.append((bs, n_tokens, len(hashes), service, hashing, eng))
        lookup.close()
        r.close()
    print(
        f"{'block':>5} {'tokens':>7} {'blocks':>6} | {'service p50':>11} {'p99':>7} | "
        f"{'hashing p50':>11} | {'engine p50':>10} {'p99':>7} | service/engine"
    )
    for bs, n, blocks, svc, hsh, eng in rows:
        print(
            f"{bs:>5} {n:>7} {blocks:>6} | {svc[0]:>9.2f}ms {svc[1]:>5.2f}ms | "
            f"{hsh[0]:>9.2f}ms | {eng[0]:>8.2f}ms {eng[1]:>5.2f}ms | {svc[0] / eng[0]:.1f}x"
        )


if __name__ == "__main__":
    main()
