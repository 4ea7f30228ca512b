"""Run one vLLM engine through a list of phases (a subprocess of the engine tests).

Usage: ``python engine_runner.py SPEC.json``. The spec names the model, the connector
config (or none), the prompts and the phases; the results go to ``spec["out"]``.
Phases: ``generate`` (greedy; ``logprobs`` records each token's), ``chat``
(conversations through the model's chat template), ``reset`` (drop vLLM's local prefix
cache), ``corrupt`` (flip a byte in every stored body), ``swap`` (move each value to
another key), ``strip_checksum`` (rewrite headers as a writer without checksums),
``validate`` (inspect every value), ``delete`` (remove every stored key),
``limit_memory`` (make the server a small LRU cache), ``lru_tick`` (wait for a new
second of its LRU clock), ``evicted``, ``shutdown_redis``
and ``start_redis`` (a private server on a given port), ``kill_pid`` (SIGKILL a Redis
node), ``cluster_failover`` (wait for a replica's promotion), ``node_keys`` (stored
keys per node), ``load_totals`` (the worker's load counters), ``abort_after_one_step``
(a request aborted after one engine step), ``scheduler_counters`` (the scheduler's
counters and load-or-compute estimates), ``kv_events`` (every KV event published).

The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the
runner can read the connector's scheduler half: after every ``generate`` or ``chat``
phase it waits until every store the connector issued has been reported by every worker
and its stored markers are written (``_settle_stores``), instead of sleeping. A spec
with ``"engine_core_process": true`` runs it in its own process, as vLLM does by
default; the runner then cannot see the connector, so such a spec's checks must not
depend on stores having landed.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from typing import Any, cast

from typed_redis import raw
from waiting import wait_until

from umbp_redis.data import value_pattern

# A prompt shorter than one block: steps that carry the workers' last store reports,
# storing and loading nothing themselves.
FLUSH_PROMPT = "flush"
SETTLE_TIMEOUT_S = 60.0


def _leak_check(llm) -> dict[str, int]:  # type: ignore[no-untyped-def]
    """Pinned blocks and staging slots in use, read from the in-process engine.

    Needs VLLM_ENABLE_V1_MULTIPROCESSING=0 (engine core in this process) and one worker.
    """
    sched = _connector_scheduler(llm)
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    worker: Any = cast(Any, get_kv_transfer_group())._worker
    wait_until(worker.idle, 10.0, what="the worker's transfers to finish")
    return {
        "pinned_blocks": sched.pinned_blocks,
        "staging_in_use": worker.staging.num_slots - worker.staging.free_slots,
        "tracked_requests": len(sched.requests),
        # Lazy store mode: blocks of finished requests pinned for the next step's store.
        "lazy_pending": len(sched.lazy.early) if sched.lazy is not None else 0,
    }


def _connector_scheduler(llm) -> Any:  # type: ignore[no-untyped-def]
    """The connector's scheduler half in this process's engine core (None without a
    connector); needs the engine core in this process."""
    connector = getattr(llm.llm_engine.engine_core.engine_core.scheduler, "connector", None)
    return getattr(connector, "_scheduler", None)


def _unreported_stores(sched: Any) -> int:
    """Store events some worker has not reported yet, and (lazy store mode) finished
    requests' blocks waiting for the next step's store."""
    lazy = len(sched.lazy.early) if sched.lazy is not None else 0
    return int(sched.markers.awaiting_reports) + lazy


def _settle_stores(llm, sched: Any, flush_params: Any) -> None:  # type: ignore[no-untyped-def]
    """Return once every store the connector issued so far was reported by every worker
    and the stored markers of its blocks are written. Workers report in the engine's
    steps, so while reports are due the engine runs one-token requests of a prompt
    shorter than a block; fails after ``SETTLE_TIMEOUT_S``."""
    if sched is None:
        return

    def settled() -> bool:
        if _unreported_stores(sched) == 0:
            return True
        llm.generate([FLUSH_PROMPT], flush_params, use_tqdm=False)
        return _unreported_stores(sched) == 0

    wait_until(
        settled,
        SETTLE_TIMEOUT_S,
        what=lambda: f"store reports ({_unreported_stores(sched)} events unreported)",
        poll_s=0.02,
    )
    assert sched.markers.flush(SETTLE_TIMEOUT_S), "the stored markers were not written"


def _redis_answers_again(sched: Any) -> bool:
    """Whether the connector's data plane (of ``sched``, the scheduler half) uses Redis
    again: a plane still asking what the server is (Redis was away at startup) has had
    its answer, the plane has left its fail-fast window, and its lookup connection is
    made again (until then its lookups are misses)."""
    plane = getattr(sched, "plane", None)
    if plane is None:
        return True
    if plane.lookup_mode == "pending":
        return False
    plane = getattr(plane, "inner", None) or plane
    if not hasattr(plane, "pool"):  # a cluster's nodes keep their own windows
        return True
    conn = plane.lookup_conn  # healthy, and its socket re-made after the outage
    conn.start()  # a re-make that failed while Redis was away: another, off this thread
    return bool(plane.pool.healthy and conn.health.healthy and not conn.reconnecting)


def _published_events(llm, replay_port: int) -> list[dict[str, Any]]:  # type: ignore[no-untyped-def]
    """Every KV event the engine published so far, read back through the publisher's
    replay socket once its queue is empty, as dicts of the fields the tests read."""
    import msgspec
    import zmq
    from vllm.distributed.kv_events import KVEventBatch

    publisher = llm.llm_engine.engine_core.engine_core.scheduler.kv_event_publisher
    wait_until(
        lambda: publisher._event_queue.unfinished_tasks == 0,
        30.0,
        what="the event publisher's queue to empty",
    )
    sock: Any = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(f"tcp://127.0.0.1:{replay_port}")
    sock.send_multipart((b"", (0).to_bytes(8, "big")))
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    fields = (
        "token_ids",
        "block_size",
        "extra_keys",
        "group_idx",
        "kv_cache_spec_kind",
        "kv_cache_spec_sliding_window",
        "locality",
        "lora_name",
        "ownership",
    )
    events: list[dict[str, Any]] = []
    while True:
        assert sock.poll(30_000), "the publisher's replay did not answer"
        _empty, _topic, seq, payload = sock.recv_multipart()
        if int.from_bytes(seq, "big", signed=True) < 0:  # the end of the replay
            break
        for ev in decoder.decode(payload).events:
            hashes = getattr(ev, "block_hashes", [])
            parent = getattr(ev, "parent_block_hash", None)
            events.append(
                {
                    "type": type(ev).__name__,
                    "medium": getattr(ev, "medium", None),
                    "hashes": [h.hex() if isinstance(h, bytes) else h for h in hashes],
                    "parent": parent.hex() if isinstance(parent, bytes) else parent,
                    **{f: getattr(ev, f, None) for f in fields},
                }
            )
    sock.close()
    return events


def _failed_over(ports: list[int], victim: int, masters: int) -> bool:
    """Whether every live node of a cluster (``ports``) reports ``cluster_state:ok``
    and ``masters`` live masters serve the slots without the node at ``victim``."""
    import redis

    live_masters = 0
    for port in ports:
        if port == victim:
            continue
        c = redis.Redis(port=port, socket_timeout=2)
        try:
            if "cluster_state:ok" not in c.execute_command("CLUSTER", "INFO").decode():
                return False
            live_masters += c.info("replication")["role"] == "master"
        except redis.ConnectionError:
            continue
        finally:
            c.close()
    return live_masters == masters


def _outputs(outs: list[Any]) -> list[dict[str, Any]]:
    """Tokens, text, cached prompt tokens, prompt length and (when asked) the logprob
    of every generated token, per request output."""
    rows = []
    for o in outs:
        c = o.outputs[0]
        row: dict[str, Any] = {
            "tokens": list(c.token_ids),
            "text": c.text,
            "cached": o.num_cached_tokens,
            "prompt_tokens": len(o.prompt_token_ids or []),
        }
        if c.logprobs is not None:
            row["logprobs"] = [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs, strict=True)]
        rows.append(row)
    return rows


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
    in_process = not spec.get("engine_core_process", False)  # see the module's doc
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"
    import redis
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kw: dict[str, Any] = {}
    if spec.get("connector") is not None:
        kw["kv_transfer_config"] = KVTransferConfig(**spec["connector"])
    extra = spec.get("engine_args", {})
    replay_port = None
    if spec.get("kv_events_port"):
        from vllm.config import KVEventsConfig

        from umbp_redis.testing.embedded_redis import free_port

        # Events are read back through the publisher's replay socket (every batch
        # since the start, as a router that joins late asks for them): no subscriber
        # has to be connected before the engine publishes.
        replay_port = free_port()
        kw["kv_events_config"] = KVEventsConfig(
            enable_kv_cache_events=True,
            publisher="zmq",
            endpoint=f"tcp://*:{spec['kv_events_port']}",
            replay_endpoint=f"tcp://*:{replay_port}",
            topic="kv",
        )
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
    flush_params = SamplingParams(max_tokens=1, temperature=0.0)
    load_totals = _count_loads() if spec.get("connector") and spec.get("tp", 1) == 1 else {}
    sched: Any = _connector_scheduler(llm) if in_process else None
    results: dict[str, object] = {}
    servers = []
    for phase in spec["phases"]:
        op = phase["op"]
        if op in ("generate", "chat"):
            t0 = time.perf_counter()
            phase_params = SamplingParams(
                max_tokens=phase.get("max_tokens", spec.get("max_tokens", 8)),
                temperature=0.0,
                logprobs=phase.get("logprobs"),
            )
            if op == "chat":
                outs = llm.chat(phase["conversations"], phase_params, use_tqdm=False)
            else:
                prompts = phase.get("prompts", spec["prompts"])
                if phase.get("cache_salt"):  # every prompt of the phase salted (a tenant)
                    prompts = [{"prompt": p, "cache_salt": phase["cache_salt"]} for p in prompts]
                outs = llm.generate(prompts, phase_params, use_tqdm=False)
            results[phase["name"]] = {
                "seconds": time.perf_counter() - t0,
                "outputs": _outputs(outs),
            }
            _settle_stores(llm, sched, flush_params)
        elif op == "reset":
            llm.reset_prefix_cache()
        elif op in ("corrupt", "delete"):
            r = redis.Redis.from_url(phase["url"])
            keys = list(r.scan_iter(match=value_pattern(), count=1000))
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
            from umbp_redis.testing.embedded_redis import EmbeddedRedis

            servers.append(EmbeddedRedis(port=phase["port"]).start())
            wait_until(
                lambda: _redis_answers_again(sched), 30.0, what="the fail-fast window to end"
            )
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
            keys = sorted(r.scan_iter(match=value_pattern(), count=1000))
            dumps = [raw(r.dump(k)) for k in keys]
            for k, d in zip(keys, dumps[1:] + dumps[:1], strict=True):
                r.restore(k, 0, d, replace=True)
            results[phase["name"]] = len(keys)
        elif op == "strip_checksum":  # as written by a writer with checksum off
            import struct

            from umbp_redis.store.value_format import HEADER

            r = redis.Redis.from_url(phase["url"])
            keys = list(r.scan_iter(match=value_pattern(), count=1000))
            for k in keys:
                h = bytearray(raw(r.hget(k, "h") or b""))
                fields = list(HEADER.unpack_from(h))
                fields[2], fields[6] = 0, 0  # flags, checksum
                h[: HEADER.size] = struct.pack(HEADER.format, *fields)
                r.hset(k, "h", bytes(h))
            results[phase["name"]] = len(keys)
        elif op == "validate":  # every stored value, checked as `umbp-redis inspect` does
            from umbp_redis.cli.admin import inspect_value

            r = redis.Redis.from_url(phase["url"])
            keys = [k.decode() for k in r.scan_iter(match=value_pattern(), count=1000)]
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
        elif op == "lru_tick":  # the server's LRU clock (1 s resolution) moves on
            r = redis.Redis.from_url(phase["url"])
            start = int(r.info("server")["lru_clock"])
            wait_until(
                lambda: int(r.info("server")["lru_clock"]) > start + 1,  # noqa: B023
                10.0,
                what="the LRU clock to tick",
                poll_s=0.05,
            )
        elif op == "evicted":
            r = redis.Redis.from_url(phase["url"])
            results[phase["name"]] = int(r.info("stats")["evicted_keys"])
        elif op == "kv_events":  # every KV event batch published so far
            assert replay_port is not None, "spec needs kv_events_port"
            llm.generate([FLUSH_PROMPT], flush_params, use_tqdm=False)  # the last events
            results[phase["name"]] = _published_events(llm, replay_port)
        elif op == "wrongtype":  # one stored key now holds a string: loads get WRONGTYPE
            r = redis.Redis.from_url(phase["url"])
            key = sorted(r.scan_iter(match=value_pattern(), count=1000))[0]
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
            blocks = phase.get("blocks", 3)
            results[phase["name"]] = {
                **sched._counter_totals(),
                "expected_load_s": sched.benefit.expected_load_s(blocks),
                "expected_compute_s": sched.benefit.expected_compute_s(blocks * sched.block_size),
            }
        elif op == "kill_pid":  # a crash of a Redis node (SIGKILL)
            import signal

            os.kill(phase["pid"], signal.SIGKILL)
        elif op == "cluster_failover":  # a killed master's replica took over
            wait_until(
                functools.partial(_failed_over, phase["ports"], phase["victim"], phase["masters"]),
                60.0,
                what="the replica's promotion (cluster_state:ok on every live node)",
                poll_s=0.1,
            )
        elif op == "node_keys":  # stored keys per node (ports on 127.0.0.1)
            results[phase["name"]] = [
                len(list(redis.Redis(port=p).scan_iter(match=value_pattern(), count=1000)))
                for p in phase["ports"]
            ]
        elif op == "count_keys":
            r = redis.Redis.from_url(phase["url"])
            pattern = phase.get("pattern", value_pattern())
            results[phase["name"]] = len(list(r.scan_iter(match=pattern, count=1000)))
    json.dump(results, open(spec["out"], "w"))
    del llm
    for s in servers:
        s.cleanup()


if __name__ == "__main__":
    main(sys.argv[1])
