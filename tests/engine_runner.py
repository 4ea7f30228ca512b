"""Run one vLLM engine through a list of phases (a subprocess of the engine tests).

Usage: ``python engine_runner.py SPEC.json``. The spec names the model, the connector
config (or none), the prompts and the phases; the results go to ``spec["out"]``.
Phases: ``generate`` (greedy), ``reset`` (drop vLLM's local prefix cache), ``corrupt``
(flip a byte in every stored body), ``swap`` (move each value to another key),
``strip_checksum`` (rewrite headers as a writer without checksums), ``validate``
(inspect every value), ``delete`` (remove every stored key), ``limit_memory`` (make
the server a small LRU cache), ``evicted``, ``shutdown_redis`` and ``start_redis`` (a
private server on a given port), ``kill_pid`` (SIGKILL a Redis node), ``sleep`` and
``node_keys`` (stored keys per node), ``load_totals`` (the worker's load counters),
``abort_after_one_step`` (a request aborted after one engine step),
``scheduler_counters`` (the in-process scheduler's counters and load-or-compute
estimates).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, cast

from typed_redis import raw


def _leak_check(llm) -> dict[str, int]:  # type: ignore[no-untyped-def]
    """Pinned blocks and staging slots in use, read from the in-process engine.

    Needs VLLM_ENABLE_V1_MULTIPROCESSING=0 (engine core in this process) and one worker.
    """
    import time

    core = llm.llm_engine.engine_core.engine_core
    sched = core.scheduler.connector._scheduler
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    worker: Any = cast(Any, get_kv_transfer_group())._worker
    deadline = time.time() + 10
    while not worker.idle() and time.time() < deadline:
        time.sleep(0.05)
    return {
        "pinned_blocks": sched.pinned_blocks,
        "staging_in_use": worker.staging.num_slots - worker.staging.free_slots,
        "tracked_requests": len(sched.requests),
        # Lazy store mode: blocks of finished requests pinned for the next step's store.
        "lazy_pending": len(sched.lazy.early) if sched.lazy is not None else 0,
    }


def _count_loads() -> dict[str, float]:
    """Totals of the in-process worker's load counters from now on (vLLM takes and
    resets the worker's own counters for its periodic log)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    try:
        worker: Any = cast(Any, get_kv_transfer_group())._worker
    except Exception:  # the engine core runs in another process
        return {}
    totals: dict[str, float] = {}
    add = worker.stats.add

    def counted(**values: float) -> None:
        for k in ("loads", "sync_loads", "blocks_loaded", "load_failures"):
            totals[k] = totals.get(k, 0) + values.get(k, 0)
        add(**values)

    worker.stats.add = counted
    return totals


def main(spec_path: str) -> None:
    spec = json.load(open(spec_path))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(spec.get("kv_cache_gb", 1)))
    if spec.get("tp", 1) > 1:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    import redis
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kw: dict[str, Any] = {}
    if spec.get("connector") is not None:
        kw["kv_transfer_config"] = KVTransferConfig(**spec["connector"])
    extra = spec.get("engine_args", {})
    sub: Any = None
    if spec.get("kv_events_port"):
        import zmq
        from vllm.config import KVEventsConfig

        kw["kv_events_config"] = KVEventsConfig(
            enable_kv_cache_events=True,
            publisher="zmq",
            endpoint=f"tcp://*:{spec['kv_events_port']}",
            topic="kv",
        )
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.connect(f"tcp://127.0.0.1:{spec['kv_events_port']}")
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    llm = LLM(
        model=spec["model"],
        max_model_len=spec.get("max_model_len", 2048),
        dtype=spec.get("dtype", "bfloat16"),
        enforce_eager=spec.get("enforce_eager", True),
        tensor_parallel_size=spec.get("tp", 1),
        seed=0,
        **extra,
        **kw,
    )
    params = SamplingParams(max_tokens=spec.get("max_tokens", 8), temperature=0.0)
    load_totals = _count_loads() if spec.get("connector") and spec.get("tp", 1) == 1 else {}
    results: dict[str, object] = {}
    servers = []
    for phase in spec["phases"]:
        op = phase["op"]
        if op == "generate":
            t0 = time.perf_counter()
            prompts = phase.get("prompts", spec["prompts"])
            if phase.get("cache_salt"):  # every prompt of the phase salted (a tenant)
                prompts = [{"prompt": p, "cache_salt": phase["cache_salt"]} for p in prompts]
            phase_params = params
            if "max_tokens" in phase:  # this phase's own output length
                phase_params = SamplingParams(max_tokens=phase["max_tokens"], temperature=0.0)
            outs = llm.generate(prompts, phase_params, use_tqdm=False)
            results[phase["name"]] = {
                "seconds": time.perf_counter() - t0,
                "outputs": [
                    {
                        "tokens": list(o.outputs[0].token_ids),
                        "cached": o.num_cached_tokens,
                        "prompt_tokens": len(o.prompt_token_ids or []),
                    }
                    for o in outs
                ],
            }
            time.sleep(phase.get("settle_s", 1.0))  # async stores land
        elif op == "reset":
            llm.reset_prefix_cache()
        elif op in ("corrupt", "delete"):
            r = redis.Redis.from_url(phase["url"])
            keys = list(r.scan_iter(match="umbp:vllm:v2:*:tp*", count=1000))
            for k in keys:
                if op == "delete":
                    r.delete(k)
                else:
                    body = bytearray(raw(r.hget(k, "b") or b""))
                    body[len(body) // 2] ^= 0xFF
                    r.hset(k, "b", bytes(body))
            results[phase.get("name", op)] = len(keys)
        elif op == "delete_pattern":
            r = redis.Redis.from_url(phase["url"])
            keys = list(r.scan_iter(match=phase["pattern"], count=1000))
            if keys:
                r.delete(*keys)
            results[phase["name"]] = len(keys)
        elif op == "shutdown_redis":
            try:
                redis.Redis.from_url(phase["url"]).shutdown(nosave=True)
            except redis.ConnectionError:
                pass
        elif op == "start_redis":
            from umbp_redis.ops.embedded_redis import EmbeddedRedis

            servers.append(EmbeddedRedis(port=phase["port"]).start())
            time.sleep(phase.get("wait_s", 1.5))  # past the fail-fast window
        elif op == "abort_after_one_step":  # a request aborted after its first step
            # (one engine step per call needs VLLM_ENABLE_V1_MULTIPROCESSING=0)
            engine = llm.llm_engine
            rid = f"aborted-{len(results)}"
            engine.add_request(rid, spec["prompts"][phase.get("prompt", 0)], params)
            engine.step()
            engine.abort_request([rid])
            while engine.has_unfinished_requests():
                engine.step()
            results[phase["name"]] = rid
        elif op == "leak_check":
            results[phase["name"]] = _leak_check(llm)
        elif op == "swap":  # each value moves to the next key: well formed, wrong block
            r = redis.Redis.from_url(phase["url"])
            keys = sorted(r.scan_iter(match="umbp:vllm:v2:*:tp*", count=1000))
            dumps = [raw(r.dump(k)) for k in keys]
            for k, d in zip(keys, dumps[1:] + dumps[:1], strict=True):
                r.restore(k, 0, d, replace=True)
            results[phase["name"]] = len(keys)
        elif op == "strip_checksum":  # as written by a writer with checksum off
            import struct

            from umbp_redis.store.value_format import HEADER

            r = redis.Redis.from_url(phase["url"])
            keys = list(r.scan_iter(match="umbp:vllm:v2:*:tp*", count=1000))
            for k in keys:
                h = bytearray(raw(r.hget(k, "h") or b""))
                fields = list(HEADER.unpack_from(h))
                fields[2], fields[6] = 0, 0  # flags, checksum
                h[: HEADER.size] = struct.pack(HEADER.format, *fields)
                r.hset(k, "h", bytes(h))
            results[phase["name"]] = len(keys)
        elif op == "validate":  # every stored value, checked as `umbp-redis inspect` does
            from umbp_redis.ops.admin import inspect_value

            r = redis.Redis.from_url(phase["url"])
            keys = [k.decode() for k in r.scan_iter(match="umbp:vllm:v2:*:tp*", count=1000)]
            infos = [inspect_value(r, k) for k in keys]
            results[phase["name"]] = {
                "keys": len(keys),
                "valid": sum(bool(i.get("valid")) for i in infos),
                "namespaces": sorted({k.split(":")[3] for k in keys}),
            }
        elif op == "limit_memory":  # an LRU cache with room for about `objects` objects
            r = redis.Redis.from_url(phase["url"])
            r.flushall()
            r.config_set("maxmemory-policy", "allkeys-lru")
            r.config_set("maxmemory-samples", 10)
            used = int(r.info("memory")["used_memory"])
            r.config_set("maxmemory", used + phase["objects"] * phase["object_bytes"])
        elif op == "evicted":
            r = redis.Redis.from_url(phase["url"])
            results[phase["name"]] = int(r.info("stats")["evicted_keys"])
        elif op == "kv_events":  # every KV event batch published so far (ZMQ subscriber)
            import msgspec
            import zmq
            from vllm.distributed.kv_events import KVEventBatch

            assert sub is not None, "spec needs kv_events_port"
            decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
            events = []
            deadline = time.time() + phase.get("wait_s", 3.0)
            while time.time() < deadline:
                if not sub.poll(100):
                    continue
                _topic, _seq, payload = sub.recv_multipart(flags=zmq.NOBLOCK)
                for ev in decoder.decode(payload).events:
                    hashes = getattr(ev, "block_hashes", [])
                    parent = getattr(ev, "parent_block_hash", None)
                    events.append(
                        {
                            "type": type(ev).__name__,
                            "medium": getattr(ev, "medium", None),
                            "hashes": [h.hex() if isinstance(h, bytes) else h for h in hashes],
                            "parent": parent.hex() if isinstance(parent, bytes) else parent,
                            **{
                                f: getattr(ev, f, None)
                                for f in (
                                    "token_ids",
                                    "block_size",
                                    "extra_keys",
                                    "group_idx",
                                    "kv_cache_spec_kind",
                                    "kv_cache_spec_sliding_window",
                                    "locality",
                                    "lora_name",
                                )
                            },
                        }
                    )
            results[phase["name"]] = events
        elif op == "wrongtype":  # one stored key now holds a string: loads get WRONGTYPE
            r = redis.Redis.from_url(phase["url"])
            key = sorted(r.scan_iter(match="umbp:vllm:v2:*:tp*", count=1000))[0]
            r.set(key, b"not a KV object")
            results[phase["name"]] = key.decode()
        elif op == "load_totals":  # the worker's load counters since the engine started
            results[phase["name"]] = dict(load_totals)
        elif op == "plane_counters":  # the in-process engine's data-plane counters
            from vllm.distributed.kv_transfer import get_kv_transfer_group

            worker = cast(Any, get_kv_transfer_group())._worker
            results[phase["name"]] = worker.plane.counters()
        elif op == "scheduler_counters":  # the in-process scheduler's counters and
            # its load-or-compute estimates for a hit of `blocks` blocks
            core: Any = llm.llm_engine.engine_core
            sched = core.engine_core.scheduler.connector._scheduler
            blocks = phase.get("blocks", 3)
            results[phase["name"]] = {
                **sched._counter_totals(),
                "expected_load_s": sched.benefit.expected_load_s(blocks),
                "expected_compute_s": sched.benefit.expected_compute_s(blocks * sched.block_size),
            }
        elif op == "kill_pid":  # a crash of a Redis node (SIGKILL)
            import signal

            os.kill(phase["pid"], signal.SIGKILL)
        elif op == "sleep":
            time.sleep(phase["seconds"])
        elif op == "node_keys":  # stored keys per node (ports on 127.0.0.1)
            results[phase["name"]] = [
                len(list(redis.Redis(port=p).scan_iter(match="umbp:vllm:v2:*:tp*", count=1000)))
                for p in phase["ports"]
            ]
        elif op == "count_keys":
            r = redis.Redis.from_url(phase["url"])
            pattern = phase.get("pattern", "umbp:vllm:v2:*:tp*")
            results[phase["name"]] = len(list(r.scan_iter(match=pattern, count=1000)))
    json.dump(results, open(spec["out"], "w"))
    del llm
    for s in servers:
        s.cleanup()


if __name__ == "__main__":
    main(sys.argv[1])
