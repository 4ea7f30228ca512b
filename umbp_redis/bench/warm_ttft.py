"""Warm time to first token: a fresh engine loading a prompt's prefix from Redis against
vLLM's own local prefix cache, and the engine's load rate against the data plane's.

Two vLLM CPU engines run side by side (one process each, alive together, driven in turn
so the machine's drift hits both): ``local`` without the connector, its prefix cache
warm; ``redis`` with the connector, its local prefix cache reset before every prompt so
the prefix comes from Redis. Each runs its worker in its own process, where vLLM binds no
OpenMP threads, so the bench binds them as vLLM's multiprocess executor would with one
reserved core (``--bind vllm``, the default: every core but the last), the same for
every engine (vLLM would reserve one more core for the engine with a connector, none
left on 2 cores). The model is random and
prefill-bound: Llama, hidden 1024, 8 layers, 4 KV heads of 64, fp32, so an object (one
block of 128 tokens, every layer) is 2 MiB.

Prints, per prompt and as medians over interleaved repetitions: warm TTFT of both
engines and their ratio (goal <= 1.1x), and the in-engine load GB/s (bytes loaded over
load time, from the worker's counters) against ``umbp_gbps`` of the data-plane
benchmark on 2 MiB objects in the same run (goal >= 0.8x).

Usage: .venv/bin/python -m umbp_redis.bench.warm_ttft [--prompts 3] [--words 3000] [--reps 5]
       [--compare {staging,staging-batch,python-gil,async,sync,whole-sync,two-connections}]
       [--busy N] [--executor {inproc,mp}] [--bind {vllm,none}]

``--compare staging-batch`` makes ``redis`` load through staging too (copying each
window into the engine as it arrives) and the third engine copy after the whole batch.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from umbp_redis.bench.cpu_worker_emulation import omp_binding_env
from umbp_redis.testing.tiny_model import PREFILL_BOUND_SPEC

MODEL = PREFILL_BOUND_SPEC
OBJECT_BYTES = 8 * 2 * 4 * 64 * 128 * 4  # layers x (K, V) x heads x head size x tokens x fp32
RESERVED_CPUS = 1
ENGINE_ENV: dict[str, str] = {}  # set by main: the OpenMP binding of every engine
EXECUTOR = {"name": "inproc"}  # set by main: --executor


def vllm_omp_binding(reserved: int) -> dict[str, str]:
    """The OpenMP binding vLLM's multiprocess executor gives a single CPU worker with
    ``reserved`` cores kept free (the last ones): the engines here run in-process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), where vLLM binds nothing and torch would use
    every core."""
    cpus = sorted(os.sched_getaffinity(0))
    return omp_binding_env(cpus[:-reserved] if len(cpus) > reserved else cpus)


def _setup_worker(
    self: Any, direct: bool, overlap: bool | None, attrs: dict[str, Any] | None = None
) -> None:
    """Run in the worker process (``collective_rpc``; ``self`` is vLLM's worker): set the
    connector worker's load path (and ``attrs``, internal settings of the worker) and
    count its load counters from now on."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    worker: Any = get_kv_transfer_group()._worker  # type: ignore[attr-defined]
    worker.loader.direct_loads = direct
    worker.loader.scatter_as_loaded = overlap
    for name, value in (attrs or {}).items():
        setattr(worker, name, value)
    totals: dict[str, float] = {}
    add = worker.stats.add

    def counted(**values: float) -> None:
        for k, v in values.items():
            totals[k] = totals.get(k, 0) + v
        add(**values)

    worker.stats.add = counted
    worker.bench_totals = totals


def _take_totals(self: Any) -> dict[str, float]:
    """Run in the worker process: the load counters since the last call."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    totals: dict[str, float] = get_kv_transfer_group()._worker.bench_totals  # type: ignore[attr-defined]
    out = dict(totals)
    totals.clear()
    return out


def serve(spec: dict[str, Any]) -> None:
    """One engine; reads JSON commands on stdin, answers one JSON line each."""
    if spec.get("executor") == "mp":
        # vLLM's default: engine core and worker in processes of their own, the worker's
        # OpenMP threads bound by vLLM; the bench reaches the worker by collective_rpc.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # functions sent by rpc
    else:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the worker is in this process
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kw: dict[str, Any] = {}
    if spec.get("redis_url"):
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="UMBPRedisConnector",
            kv_connector_module_path="umbp_redis.connector",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={"redis_url": spec["redis_url"], **spec.get("extra", {})},
        )
    llm = LLM(
        model=spec["model"],
        max_model_len=4096,
        dtype="float32",
        enforce_eager=True,
        seed=0,
        max_num_batched_tokens=4096,
        **kw,
    )
    if kw:
        llm.collective_rpc(
            _setup_worker,
            args=(
                bool(spec.get("direct", True)),
                spec.get("scatter_as_loaded"),
                spec.get("worker_attrs"),
            ),
        )
    one = SamplingParams(max_tokens=1, temperature=0.0)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "ttft":
            t0 = time.perf_counter()
            out = llm.generate([cmd["prompt"]], one, use_tqdm=False)[0]
            dt = time.perf_counter() - t0
            reply: dict[str, Any] = {
                "s": dt,
                "cached": out.num_cached_tokens,
                "token": out.outputs[0].token_ids[0],
            }
        elif cmd["op"] == "busy_ttft":
            reply = _busy_ttft(llm, cmd, one)
        elif cmd["op"] == "reset":
            deadline = time.time() + 30
            while not llm.reset_prefix_cache() and time.time() < deadline:
                time.sleep(0.05)  # blocks still pinned by stores in flight
            reply = {"ok": True}
        elif cmd["op"] == "stats":
            reply = llm.collective_rpc(_take_totals)[0] if kw else {}
        elif cmd["op"] == "scheduler":  # the scheduler's counters (in-process engine core)
            core = getattr(llm.llm_engine.engine_core, "engine_core", None)
            sched = getattr(getattr(core, "scheduler", None), "connector", None)
            reply = sched._scheduler._counter_totals() if kw and sched is not None else {}
        else:
            break
        print(json.dumps(reply), flush=True)


def _busy_ttft(llm: Any, cmd: dict[str, Any], one: Any) -> dict[str, Any]:
    """TTFT of ``cmd["prompt"]`` sent while ``cmd["background"]`` prompts are decoding
    (each step of the engine then takes the decode batch's time)."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    tag = f"{time.monotonic_ns()}"
    bg = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
    bg_ids = [f"bg-{tag}-{i}" for i in range(len(cmd["background"]))]
    for rid, p in zip(bg_ids, cmd["background"], strict=True):
        engine.add_request(rid, p, bg)
    for _ in range(8):  # prefills done, every background request decoding
        engine.step()
    steps_t0 = time.perf_counter()
    for _ in range(4):
        engine.step()
    step_s = (time.perf_counter() - steps_t0) / 4
    rid = f"t-{tag}"
    t0 = time.perf_counter()
    engine.add_request(rid, cmd["prompt"], one)
    reply: dict[str, Any] = {}
    steps = 0
    while not reply:
        steps += 1
        for out in engine.step():
            if out.request_id == rid and out.outputs and out.outputs[0].token_ids:
                reply = {
                    "s": time.perf_counter() - t0,
                    "cached": out.num_cached_tokens,
                    "token": out.outputs[0].token_ids[0],
                    "step_s": step_s,
                    # Steps until the first token, the background decoding meanwhile.
                    "steps": steps,
                }
    engine.abort_request(bg_ids)
    while engine.has_unfinished_requests():
        engine.step()
    return reply


class Engine:
    """An engine process of ``serve``."""

    def __init__(
        self,
        model: Path,
        redis_url: str | None,
        log: Path,
        direct: bool = True,
        extra: dict[str, Any] | None = None,
        overlap: bool | None = None,
        worker_attrs: dict[str, Any] | None = None,
    ) -> None:
        spec = json.dumps(
            {
                "model": str(model),
                "redis_url": redis_url,
                "direct": direct,
                "scatter_as_loaded": overlap,
                "extra": extra or {},
                "worker_attrs": worker_attrs or {},
                "executor": EXECUTOR["name"],
            }
        )
        env = {
            **os.environ,
            **ENGINE_ENV,
            "VLLM_CPU_NUM_OF_RESERVED_CPU": str(RESERVED_CPUS),
            "PYTHONUNBUFFERED": "1",
        }
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--serve", spec],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(log, "w"),
            text=True,
            env=env,
        )

    def ready(self) -> None:
        self._read()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError("engine process ended; see its log")
            if line.startswith("{"):
                return json.loads(line)  # type: ignore[no-any-return]

    def ask(self, op: str, **kw: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        try:
            self.ask("quit")
        except Exception:
            pass
        self.proc.wait(timeout=60)


def _wait_for_markers(url: str, quiet_s: float = 5.0, limit_s: float = 600.0) -> None:
    """Wait until the count of stored markers has not grown for ``quiet_s`` (the cold
    pass's stores are done), at most ``limit_s``."""
    import redis as redis_py

    from umbp_redis.data import namespace_pattern
    from umbp_redis.data.keys import is_marker_key

    client = redis_py.Redis.from_url(url)
    last, since, deadline = -1, time.monotonic(), time.monotonic() + limit_s
    while time.monotonic() < deadline:
        keys = client.scan_iter(match=namespace_pattern(), count=1000)
        n = sum(1 for k in keys if is_marker_key(k))
        if n != last:
            last, since = n, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            break
        time.sleep(0.5)
    print(f"{last} blocks stored in Redis")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--words", type=int, default=3000)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--work", default=".umbp-bench-cache")
    ap.add_argument(
        "--compare",
        choices=(
            "none",
            "staging",
            "staging-batch",
            "python-gil",
            "async",
            "sync",
            "whole-sync",
            "two-connections",
            "recompute",
            "always-load",
        ),
        default="none",
        help="also run a third engine: one that loads through staging and scatter (the "
        "path before loads received straight into host KV caches), or one that leaves "
        "Python's 5 ms thread switch interval (the worker's load_switch_interval_ms set "
        "to 0), or one that loads every "
        "hit async (load_async: true) or sync (false: by layer where it can) where the "
        "default (auto) chooses by size; whole-sync: every hit sync and whole, before the "
        "forward pass (the worker's load_by_layer off); staging-batch: redis loads through "
        "staging copying each window as it arrives, the third engine through staging "
        "copying after the whole batch; "
        "two-connections: loads spread over two connections (transfer_connections: 2; "
        "auto takes 1 below 4 CPUs); recompute: no connector, its local prefix cache reset "
        "before every prompt (what the prompt costs without any cache); always-load: the "
        "connector with decline_slow_loads false (every hit loads, however slow)",
    )
    ap.add_argument(
        "--link-mbit",
        type=float,
        default=0.0,
        help="put Redis behind a link of this many Mbit/s each way (a network namespace "
        "and a tc token bucket; needs root); 0 (default): a local server",
    )
    ap.add_argument(
        "--executor",
        choices=("inproc", "mp"),
        default="inproc",
        help="inproc (default): each engine's worker in the engine's process, reached "
        "directly; mp: vLLM's default multiprocess executor (engine core and worker in "
        "processes of their own, the worker's OpenMP threads bound by vLLM itself with "
        "VLLM_CPU_NUM_OF_RESERVED_CPU=1; --bind does not apply)",
    )
    ap.add_argument(
        "--bind",
        choices=("vllm", "none"),
        default="vllm",
        help="with --executor inproc: vllm (default): every engine's OpenMP threads bound "
        "as vLLM's multiprocess executor binds a worker's with one reserved core; none: "
        "torch's own threads on every core (what runs 1-6 and part 1's runs in "
        "docs/performance.md had)",
    )
    ap.add_argument(
        "--busy",
        type=int,
        default=0,
        help="measure each TTFT while this many other requests are decoding (steps then "
        "take a decode batch's time)",
    )
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(json.loads(args.serve))
        return
    EXECUTOR["name"] = args.executor
    if args.executor == "mp":
        print("engines: vLLM's multiprocess executor, OpenMP binding by vLLM")
    else:
        if args.bind == "vllm":
            ENGINE_ENV.update(vllm_omp_binding(RESERVED_CPUS))
        print(f"engine OpenMP binding: {ENGINE_ENV or 'none (torch threads on every core)'}")
    from umbp_redis.bench.dataplane import umbp_gbps
    from umbp_redis.store.plane import RedisDataPlane
    from umbp_redis.store.settings import RedisSettings
    from umbp_redis.testing.embedded_redis import EmbeddedRedis
    from umbp_redis.testing.slow_link import slow_link_redis
    from umbp_redis.testing.tiny_model import build_tiny_llama, sample_prompts

    work = Path(args.work)
    work.mkdir(exist_ok=True)
    model = build_tiny_llama(work / "prefill-bound-llama", MODEL)
    prompts = sample_prompts(args.prompts, args.words, seed=11)
    with ExitStack() as servers:
        if args.link_mbit > 0:
            link = servers.enter_context(slow_link_redis(args.link_mbit))
            url = link.slow_url  # the engines' way in
            print(f"Redis behind a {args.link_mbit:g} Mbit/s link (each way)")
        else:
            url = servers.enter_context(EmbeddedRedis()).url
        plane = RedisDataPlane(RedisSettings.from_url(url))
        local = Engine(model, None, work / "local.log")
        # staging-batch: both connector engines load through staging; "redis" copies
        # each window as it arrives, the other after the whole batch.
        batch = args.compare == "staging-batch"
        redis = Engine(
            model, url, work / "redis.log", direct=not batch, overlap=True if batch else None
        )
        staged: Engine | None = None
        if args.compare == "staging-batch":
            staged = Engine(model, url, work / "other.log", direct=False, overlap=False)
        elif args.compare == "staging":
            staged = Engine(model, url, work / "other.log", direct=False)
        elif args.compare == "python-gil":
            staged = Engine(
                model, url, work / "other.log", worker_attrs={"load_switch_interval_ms": 0}
            )
        elif args.compare in ("async", "sync"):
            mode = {"load_async": args.compare == "async"}
            staged = Engine(model, url, work / "other.log", extra=mode)
        elif args.compare == "whole-sync":
            staged = Engine(
                model,
                url,
                work / "other.log",
                extra={"load_async": False},
                worker_attrs={"load_by_layer": False},
            )
        elif args.compare == "two-connections":
            staged = Engine(model, url, work / "other.log", extra={"transfer_connections": 2})
        elif args.compare == "recompute":
            staged = Engine(model, None, work / "other.log")
        elif args.compare == "always-load":
            staged = Engine(model, url, work / "other.log", extra={"decline_slow_loads": False})
        local.ready()
        redis.ready()
        if staged is not None:
            staged.ready()
        try:
            # Cold pass: the redis engine stores every prompt, the local one fills its cache.
            cold = [redis.ask("ttft", prompt=p)["s"] for p in prompts]
            for p in prompts:
                local.ask("ttft", prompt=p)
            time.sleep(2)
            if args.link_mbit > 0:
                _wait_for_markers(link.fast_url)  # the stores cross the slow link
            redis.ask("stats")
            if staged is not None:
                for p in prompts:
                    staged.ask("ttft", prompt=p)
                staged.ask("stats")
            rows: list[list[dict[str, Any]]] = [[] for _ in prompts]
            plane_load: list[float] = []
            engine_load: list[float] = []
            staged_load: list[float] = []
            sync_counts: dict[int, list[float]] = {}  # engine -> [sync loads, loads, layer wait ms]
            background = sample_prompts(args.busy, 64, seed=12) if args.busy else []

            def measure(eng: Engine, prompt: str) -> dict[str, Any]:
                if background:
                    return eng.ask("busy_ttft", prompt=prompt, background=background)
                return eng.ask("ttft", prompt=prompt)

            for _ in range(args.reps):
                if not args.link_mbit:
                    plane_load.append(umbp_gbps(plane, OBJECT_BYTES, 24, 1)["load"])
                for i, p in enumerate(prompts):
                    a = measure(local, p)
                    redis.ask("reset")
                    b = measure(redis, p)
                    row = {"local": a, "redis": b}
                    if staged is not None:
                        staged.ask("reset")
                        row["staged"] = measure(staged, p)
                    rows[i].append(row)
                for eng, out in ((redis, engine_load), (staged, staged_load)):
                    if eng is not None:
                        st = eng.ask("stats")
                        counts = sync_counts.setdefault(id(eng), [0, 0, 0.0])
                        counts[0] += int(st.get("sync_loads", 0))
                        counts[1] += int(st.get("loads", 0))
                        counts[2] += float(st.get("layer_wait_ms", 0.0))
                        if st.get("load_ms_total"):
                            out.append(st["bytes_loaded"] / (st["load_ms_total"] / 1e3) / 1e9)
            declines = {
                name: eng.ask("scheduler")
                for name, eng in (("redis", redis), (args.compare, staged))
                if eng is not None
            }
        finally:
            for eng in (local, redis, staged):
                if eng is not None:
                    eng.close()
    print(f"model: {MODEL}, fp32, objects of {OBJECT_BYTES >> 20} MiB; {args.reps} repetitions")
    print(
        f"{'prompt':>6} {'tokens hit':>10} {'cold s':>8} {'local s':>8} {'redis s':>8} {'ratio':>6}"
    )
    ratios = []
    for i, reps in enumerate(rows):
        loc = statistics.median(r["local"]["s"] for r in reps)
        red = statistics.median(r["redis"]["s"] for r in reps)
        hit = reps[-1]["redis"]["cached"]
        same = all(r["local"]["token"] == r["redis"]["token"] for r in reps)
        ratios.append(red / loc)
        staged_s = (
            f"  {args.compare} {statistics.median(r['staged']['s'] for r in reps):.3f} s"
            if staged is not None
            else ""
        )
        print(
            f"{i:>6} {hit:>10} {cold[i]:8.3f} {loc:8.3f} {red:8.3f} {red / loc:5.2f}x"
            + staged_s
            + ("" if same else "  (first tokens differ!)")
        )
    if background:
        steps = [r[k]["step_s"] for reps in rows for r in reps for k in ("local", "redis")]
        print(
            f"{args.busy} other requests decoding: one engine step took "
            f"{statistics.median(steps) * 1e3:.1f} ms (median)"
        )
        for k in ("local", "redis", "staged"):
            per = [r[k]["s"] / r[k]["steps"] for reps in rows for r in reps if k in r]
            if per:
                print(
                    f"  {k}: {statistics.median(per) * 1e3:.1f} ms a step until the first "
                    "token (the load in flight)"
                )
    print(
        f"warm TTFT, redis / local prefix cache (median over prompts): "
        f"{statistics.median(ratios):.2f}x (goal <= 1.1x on a fast link)"
    )
    if staged is not None and args.compare in ("recompute", "always-load"):
        over = [
            statistics.median(r["redis"]["s"] for r in reps)
            / statistics.median(r["staged"]["s"] for r in reps)
            for reps in rows
        ]
        goal = " (goal <= 1.05x on a slow link)" if args.compare == "recompute" else ""
        print(
            f"warm TTFT, redis / {args.compare} (median over prompts): "
            f"{statistics.median(over):.2f}x{goal}"
        )
        firsts = [reps[0]["redis"]["s"] for reps in rows]
        print("redis's first warm TTFT of each prompt: " + ", ".join(f"{t:.3f}" for t in firsts))
    for name, counters in declines.items():
        if counters:
            print(
                f"hits declined by the {name} engine: {counters.get('loads_declined', 0)} "
                f"({counters.get('tokens_declined', 0)} tokens), "
                f"probes {counters.get('load_probes', 0)}"
            )
    if engine_load and plane_load:
        e, d = statistics.median(engine_load), statistics.median(plane_load)
        print(
            f"load GB/s: in the engine {e:.2f}, data-plane bench {d:.2f} (2 MiB objects): "
            f"{e / d:.2f}x (goal >= 0.8x)"
        )
    if staged_load:
        print(f"load GB/s in the {args.compare} engine: {statistics.median(staged_load):.2f}")
    for name, eng in (("redis", redis), (args.compare, staged)):
        if eng is not None and id(eng) in sync_counts:
            n_sync, n_all, waited = sync_counts[id(eng)]
            print(f"sync loads in the {name} engine: {n_sync} of {n_all}")
            if waited:
                print(
                    f"  its forward passes waited {waited / max(1, n_sync):.1f} ms a sync load "
                    "for their layers (loads by layer)"
                )


if __name__ == "__main__":
    main()
