"""``umbp-redis bench fleet``: several OpenAI-server engines behind a router, many
conversations at once, configurations side by side in one run.

Configurations (each starts its own engines and its own private Redis, in an order
rotated every repeat so the machine's drift hits all of them):

- ``no-connector``: the chosen router, ``--blocks`` KV blocks per engine, no connector;
- ``umbp-redis``: the same with the connector on every engine, one shared Redis;
- ``ideal``: sticky routing and a KV cache large enough that nothing is evicted;
- ``ideal-umbp`` (only when named in ``--configs``): ``ideal`` with the connector on;
- ``sticky`` / ``sticky-umbp``: sticky routing with ``--blocks`` blocks, without and
  with the connector;
- ``small-redis`` (``--small-redis``): as ``umbp-redis`` with Redis ``maxmemory`` at half
  of what ``umbp-redis`` stored in the same repeat (``allkeys-lru``);
- ``--variant NAME[@ROUTER]:key=value,...``: as ``umbp-redis`` (with ``ROUTER``'s routing
  if given) with connector options changed; a key ``env.VAR`` sets an environment
  variable of the configuration's engines instead (``env.PYTHONPATH=DIR`` runs another
  tree's connector, for a before-and-after in one run), ``ktc.FIELD`` a field of
  ``--kv-transfer-config`` (``ktc.kv_role=kv_consumer``: lookups and loads, no stores),
  ``connector=false`` leaves the connector off (another routing without it), and
  ``router.FLAG=value`` passes ``--FLAG value`` to vllm-router.

Routings: this package's own (``round-robin``, ``sticky``, ``random``, ``least-loaded``:
the client picks the engine), or the vLLM project's router, ``vllm-router:kv_aware``,
``vllm-router:round_robin``, ``vllm-router:cache_aware`` (``vllm_router``: the binary runs
in front of the engines, which publish their KV events to it under ``kv_aware``, and the
client sends every request to it; ``--router-arg`` flags go to it). Behind vllm-router
the engine that served each request is read back from the engines' request logs by its
``x-request-id``. "Moved" is the share of turns (rounds 2 and later) served by another
engine than the conversation's previous round, the one holding its history.

``--join-late K``: the last engine starts cold once every conversation has finished K
rounds; the conversations wait for it to serve (and, behind vllm-router, for the router to
count it healthy), a wait left out of the throughput; until then this package's routers
use the other engines and vllm-router's attempts to reach it fail over to them.

Workloads: multi-turn conversations (``fleet_workload``; TTFT is measured over rounds 2
and later, the first round of a conversation has no history to hit), or vLLM's own
client (``fleet_vllm_client``, ``--workload vllm-prefix-repetition``): one pass of its
``prefix_repetition`` dataset warms engine 0, and the same prompts then measure engine 1
(under sticky routing, engine 0 again: vLLM's local prefix cache); its passes are
recorded as rounds 1 and 2, and the counters, CPU and Redis figures cover the measured
pass only. "Share of the ideal gain" is (TTFT no-connector - TTFT umbp-redis) /
(TTFT no-connector - TTFT ideal), per repeat; figures are medians over repeats with
their spread.

``--faults SPEC`` (conversations only; ``fleet_faults``): Redis faults on a schedule
timed from the start of the measured workload, the same in every configuration, each
against the configuration's own Redis; the result's ``faults`` part splits each fault
into phases (before, during, after) per configuration.
"""

from __future__ import annotations

import asyncio
import json
import math
import statistics
import sys
import tempfile
import textwrap
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from umbp_redis.bench.fleet_engines import (
    EXTERNAL_HITS,
    EXTERNAL_QUERIES,
    PREFIX_HITS,
    PREFIX_QUERIES,
    EngineSpec,
    RunningEngine,
    start_engines,
    stop_engines,
)
from umbp_redis.bench.fleet_faults import Fault, FaultInjector, fault_summary
from umbp_redis.bench.fleet_vllm_client import ClientRequest, run_client_pass
from umbp_redis.bench.fleet_workload import (
    FIRST_TOKEN_ID,
    ROUTINGS,
    VLLM_ROUTER,
    ConversationScript,
    ConversationShape,
    LatencySummary,
    RepetitionShape,
    Router,
    routed_away_share,
    share_of_ideal_gain,
    vllm_router_policy,
)
from umbp_redis.testing.embedded_redis import free_port

BASE_CONFIGS = ("no-connector", "umbp-redis", "ideal", "sticky", "sticky-umbp")
# Configurations run only when --configs names them.
OPTIONAL_CONFIGS = ("ideal-umbp",)
WORKLOADS = ("conversations", "vllm-prefix-repetition")
# The connector's Prometheus counters summed into each configuration's result.
CONNECTOR_COUNTERS = (
    "vllm:umbp_blocks_loaded_total",
    "vllm:umbp_blocks_stored_total",
    "vllm:umbp_bytes_stored_total",
    "vllm:umbp_load_failures_total",
    "vllm:umbp_sync_loads_total",
    "vllm:umbp_layer_wait_ms_total",
    "vllm:umbp_store_failures_total",
    "vllm:umbp_stores_dropped_total",
)
# vLLM's own request-phase histograms (seconds), summed into each result.
ENGINE_HISTOGRAMS = (
    "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:time_to_first_token_seconds",
)


@dataclass(frozen=True)
class FleetConfig:
    """One configuration: routing, KV cache size, connector and Redis memory."""

    name: str
    router: str
    num_blocks: int
    connector: bool
    connector_options: tuple[tuple[str, Any], ...] = ()
    redis_maxmemory_share: float = 0.0  # of umbp-redis's stored bytes; 0: unlimited
    engine_env: tuple[tuple[str, str], ...] = ()
    transfer_fields: tuple[tuple[str, Any], ...] = ()
    router_args: tuple[str, ...] = ()  # vllm-router's extra flags

    @property
    def vllm_router_policy(self) -> str | None:
        """The vllm-router policy this configuration runs behind; None for this
        package's own routers."""
        return vllm_router_policy(self.router)


@dataclass
class RequestRecord:
    """One request's outcome; ``engine`` -1 where it is not known."""

    conversation: int
    round_index: int
    engine: int
    ttft_s: float
    latency_s: float
    prompt_tokens: int
    cached_tokens: int
    text: str
    error: str = ""
    sent_at_s: float = 0.0  # since the workload started
    request_id: str = ""  # sent as x-request-id


@dataclass
class ConfigRun:
    """One configuration in one repeat."""

    config: str
    repeat: int
    requests: list[RequestRecord] = field(default_factory=list)
    wall_s: float = 0.0
    counters: dict[str, float] = field(default_factory=dict)
    redis_used_bytes: int = 0
    redis_keys: int = 0
    redis_maxmemory: int = 0
    redis_cpu_s: float = 0.0  # the server's CPU time during the workload
    engine_cpu_s: dict[str, float] = field(default_factory=dict)  # by process name
    hits_from_counters: bool = False  # requests carry no cached-token count
    join_wait_s: float = 0.0  # --join-late: waiting for the late engine, not in wall_s
    connector: bool = True  # the configuration's engines run the connector
    faults: list[dict[str, Any]] = field(default_factory=list)  # FaultInjector.report
    engine_rss_bytes: dict[str, list[int]] = field(default_factory=dict)  # with --faults

    def ttfts(self, first_round: int = 1) -> list[float]:
        """TTFTs of successful requests of rounds >= ``first_round`` (0-based)."""
        return [r.ttft_s for r in self.requests if r.round_index >= first_round and not r.error]

    def engine_load(self, first_round: int = 1) -> float:
        """Mean count of other requests in flight on the same engine when each request
        of rounds >= ``first_round`` was sent: how evenly the router spread the work."""
        done = [q for q in self.requests if not q.error]
        counts = [
            sum(
                1
                for o in done
                if o is not q
                and o.engine == q.engine
                and o.sent_at_s <= q.sent_at_s < o.sent_at_s + o.latency_s
            )
            for q in done
            if q.round_index >= first_round
        ]
        return statistics.fmean(counts) if counts else math.nan

    def routed_away_share(self) -> float:
        """Share of successful requests of rounds after the first served by another
        engine than their conversation's previous round (NaN where engines are unknown)."""
        return routed_away_share(
            (q.conversation, q.round_index, q.engine) for q in self.requests if not q.error
        )

    def prefill_account(self) -> tuple[float, float, float]:
        """(vLLM's prefill seconds, prompt tokens computed, prompt tokens loaded from
        the external cache), summed over the measured requests from the counters."""
        queried = self.counters.get(PREFIX_QUERIES, 0.0)
        local = self.counters.get(PREFIX_HITS, 0.0)
        loaded = self.counters.get(EXTERNAL_HITS, 0.0)
        prefill = self.counters.get("vllm:request_prefill_time_seconds_sum", 0.0)
        return prefill, max(0.0, queried - local - loaded), loaded

    def hit_tokens(self, first_round: int = 1) -> int:
        """Prompt tokens served from a cache (local or external), rounds >= ``first_round``;
        from the engines' counters (which cover the measured requests only) where the
        requests carry no count."""
        if self.hits_from_counters:
            return int(self.counters.get(PREFIX_HITS, 0.0) + self.counters.get(EXTERNAL_HITS, 0.0))
        return sum(r.cached_tokens for r in self.requests if r.round_index >= first_round)


def build_configs(
    router: str,
    blocks: int,
    ideal_blocks: int,
    *,
    small_redis: bool = False,
    variants: Sequence[Variant] = (),
    router_args: Sequence[str] = (),
) -> list[FleetConfig]:
    """The configurations of a run, the base five and ``ideal-umbp`` first;
    ``router_args`` go to every configuration routed by vllm-router (a variant's own
    after them)."""
    vllm_router_policy(router)  # a ValueError for an unknown routing

    def args_for(routing: str, own: Sequence[str] = ()) -> tuple[str, ...]:
        return (*router_args, *own) if vllm_router_policy(routing) else ()

    base = args_for(router)
    configs = [
        FleetConfig("no-connector", router, blocks, False, router_args=base),
        FleetConfig("umbp-redis", router, blocks, True, router_args=base),
        FleetConfig("ideal", "sticky", ideal_blocks, False),
        FleetConfig("ideal-umbp", "sticky", ideal_blocks, True),
        FleetConfig("sticky", "sticky", blocks, False),
        FleetConfig("sticky-umbp", "sticky", blocks, True),
    ]
    if small_redis:
        configs.append(FleetConfig("small-redis", router, blocks, True, (), 0.5, router_args=base))
    for v in variants:
        if any(c.name == v.name for c in configs):
            raise ValueError(f"--variant name {v.name!r} is taken by another configuration")
        routing = v.router or router
        configs.append(
            FleetConfig(
                v.name,
                routing,
                blocks,
                v.connector,
                tuple(sorted(v.options.items())),
                v.redis_maxmemory_share,
                engine_env=tuple(sorted(v.env.items())),
                transfer_fields=tuple(sorted(v.transfer_fields.items())),
                router_args=args_for(routing, v.router_args),
            )
        )
    return configs


@dataclass(frozen=True)
class Variant:
    """A configuration added with ``--variant``."""

    name: str
    router: str | None
    options: dict[str, Any]
    env: dict[str, str]
    transfer_fields: dict[str, Any] = field(default_factory=dict)
    redis_maxmemory_share: float = 0.0
    connector: bool = True
    router_args: tuple[str, ...] = ()


def parse_variant(text: str) -> Variant:
    """``NAME[@ROUTER]:key=value,key=value`` to a ``Variant``; ``ROUTER`` is one of
    ``ROUTINGS`` (``NAME@vllm-router:kv_aware:key=value``); values are JSON where they
    parse (numbers, true/false), else strings; ``env.VAR=value`` keys are environment
    variables of the engines, ``ktc.FIELD=value`` fields of the KV transfer config,
    ``redis.maxmemory_share=S`` gives Redis a ``maxmemory`` of S times what umbp-redis
    stored (as small-redis does with 0.5), ``connector=false`` runs without the
    connector, and ``router.FLAG=value`` passes ``--FLAG value`` to vllm-router."""
    head, sep, rest = text.partition(":")
    name, _, router = head.partition("@")
    if router == VLLM_ROUTER:  # NAME@vllm-router:POLICY:options
        policy, sep, rest = rest.partition(":")
        router = f"{router}:{policy}"
    if not sep or not name:
        raise ValueError(f"--variant expects NAME[@ROUTER]:key=value[,key=value], got {text!r}")
    if router and router not in ROUTINGS:
        raise ValueError(f"--variant {name}: router must be one of {', '.join(ROUTINGS)}")
    options: dict[str, Any] = {}
    env: dict[str, str] = {}
    fields: dict[str, Any] = {}
    router_args: list[str] = []
    connector = True
    share = 0.0
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ValueError(f"--variant option {item!r} is not key=value")
        if key.startswith("env."):
            env[key[4:]] = value
            continue
        if key.startswith("router."):
            if not router.startswith(VLLM_ROUTER + ":"):
                raise ValueError(f"--variant {name}: router.* options need a vllm-router routing")
            router_args += [f"--{key[7:]}", value]
            continue
        if key == "connector":
            if value.lower() not in ("true", "false", "on", "off"):
                raise ValueError(f"--variant {name}: connector must be true or false")
            connector = value.lower() in ("true", "on")
            continue
        if key == "redis.maxmemory_share":
            try:
                share = float(value)
            except ValueError:
                share = -1.0
            if not 0 < share <= 1:
                raise ValueError(f"--variant {name}: redis.maxmemory_share must be in (0, 1]")
            continue
        target, key = (fields, key[4:]) if key.startswith("ktc.") else (options, key)
        try:
            target[key] = json.loads(value)
        except json.JSONDecodeError:
            target[key] = value
    if not connector and (options or fields or share):
        raise ValueError(f"--variant {name}: connector=false takes no connector options")
    return Variant(name, router or None, options, env, fields, share, connector, tuple(router_args))


def ideal_block_count(shape: ConversationShape, engines: int, block_size: int, blocks: int) -> int:
    """KV blocks per engine for which sticky routing evicts nothing: every conversation
    an engine serves at its longest, plus its answer, and at least 4x ``blocks``."""
    per_engine = -(-shape.conversations // engines)
    blocks_each = -(-shape.longest_request_tokens // block_size)
    need = per_engine * blocks_each + 2 + engines  # 2 + engines: the warm-up requests
    return max(4 * blocks, need)


def repetition_ideal_block_count(shape: RepetitionShape, block_size: int, blocks: int) -> int:
    """KV blocks for which one engine evicts nothing of the dataset: every prefix once,
    every prompt's own suffix and answer, and at least 4x ``blocks``."""
    prefix_blocks = shape.prefixes * -(-shape.prefix_tokens // block_size)
    tail = shape.suffix_tokens + shape.answer_tokens + shape.RETOKENIZE_SLACK
    need = prefix_blocks + shape.prompts * (-(-tail // block_size) + 1) + 4  # 4: warm-ups
    return max(4 * blocks, need)


async def _stream_completion(
    session: Any,
    base_url: str,
    model: str,
    prompt: Sequence[int],
    max_tokens: int,
    headers: dict[str, str] | None = None,
) -> tuple[float, float, int, int, str]:
    """(TTFT, latency, prompt tokens, cached tokens, text) of one streamed completion."""
    body = {
        "model": model,
        "prompt": list(prompt),
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    ttft = math.nan
    text: list[str] = []
    prompt_tokens = cached = 0
    async with session.post(base_url + "/v1/completions", json=body, headers=headers) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            choices = chunk.get("choices") or []
            if choices:
                if math.isnan(ttft):
                    ttft = time.perf_counter() - t0
                text.append(choices[0].get("text") or "")
            usage = chunk.get("usage")
            if usage:
                prompt_tokens = int(usage.get("prompt_tokens") or 0)
                details = usage.get("prompt_tokens_details") or {}
                cached = int(details.get("cached_tokens") or 0)
    return ttft, time.perf_counter() - t0, prompt_tokens, cached, "".join(text)


def request_id(conversation: int, round_index: int) -> str:
    """The ``x-request-id`` of a conversation's round: unique within a configuration's
    run, so the engine logs can say which engine served it."""
    return f"fleet-c{conversation}-r{round_index}"


@dataclass(frozen=True)
class Routing:
    """Where each request goes: this package's router picking among the engines (the
    first ``engines_before_join`` of them before ``join_round``), or one URL (a
    vllm-router) that picks by itself."""

    router: Router | None
    urls: tuple[str, ...]
    join_round: int = 0  # 0: every engine from the start
    engines_before_join: int = 0

    def target(self, conversation: int, round_index: int, in_flight: list[int]) -> int:
        """The engine index of this request, or -1 where the router URL picks."""
        if self.router is None:
            return -1
        n = self.router.engines
        if self.join_round and round_index < self.join_round:
            n = self.engines_before_join
        router = self.router if n == self.router.engines else Router(self.router.policy, n)
        return router.engine_for(conversation, round_index, in_flight[:n])


async def _run_conversations(
    urls: Callable[[], Sequence[str]],
    model: str,
    script: ConversationScript,
    routing: Routing,
    conversation_rate: float,
    think_time_s: float,
    on_request: Callable[[], None],
    timeout_s: float,
    join: Callable[[], Awaitable[None]] | None = None,
    on_start: Callable[[float], None] | None = None,
) -> list[RequestRecord]:
    """Every conversation at once; ``urls()`` are the engines' base URLs now (the late
    engine's appear after ``join``), and ``join``, where given, runs once every
    conversation has finished ``routing.join_round`` rounds, all of them waiting for it.
    ``on_start`` is called with the ``time.perf_counter()`` the send times count from."""
    import aiohttp

    shape = script.shape
    records: list[RequestRecord] = []
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    start = time.perf_counter()
    if on_start is not None:
        on_start(start)
    in_flight = [0] * max(len(routing.urls), routing.router.engines if routing.router else 0)
    arrived = 0
    joined = asyncio.Event()

    async def barrier() -> None:
        nonlocal arrived
        arrived += 1
        if arrived < shape.conversations:
            await joined.wait()
            return
        try:
            if join is not None:
                await join()
        finally:
            joined.set()

    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def conversation(c: int) -> None:
            if conversation_rate > 0:
                await asyncio.sleep(c / conversation_rate)
            for r in range(shape.rounds):
                if join is not None and r == routing.join_round:
                    await barrier()
                if r and think_time_s > 0:
                    await asyncio.sleep(think_time_s)  # the user reads the answer
                turn = script.turn(c, r)
                e = routing.target(c, r, in_flight)
                url = urls()[e] if e >= 0 else routing.urls[0]
                rid = request_id(c, r)
                headers = {"x-request-id": rid, "x-session-id": f"fleet-c{c}"}
                sent = time.perf_counter() - start
                if e >= 0:
                    in_flight[e] += 1
                try:
                    ttft, lat, pt, cached, text = await _stream_completion(
                        session, url, model, turn.prompt, shape.answer_tokens, headers
                    )
                    records.append(
                        RequestRecord(c, r, e, ttft, lat, pt, cached, text, "", sent, rid)
                    )
                except Exception as exc:
                    records.append(
                        RequestRecord(
                            c, r, e, math.nan, math.nan, 0, 0, "", repr(exc)[:300], sent, rid
                        )
                    )
                finally:
                    if e >= 0:
                        in_flight[e] -= 1
                on_request()

        await asyncio.gather(*(conversation(c) for c in range(shape.conversations)))
    return records


async def _warm_up(engines: Sequence[RunningEngine], model: str, vocab: int) -> None:
    """One short request per engine (tokens no workload uses), so one-time costs of a
    fresh engine are not charged to the first measured request."""
    import random

    import aiohttp

    rng = random.Random(99)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        for e in engines:
            prompt = [rng.randrange(FIRST_TOKEN_ID, vocab) for _ in range(150)]
            await _stream_completion(session, e.base_url, model, prompt, 2)


# The connector's counters of stores: a store is counted in the engine step after it
# lands, so they are read again once the last stores have landed and every engine stepped.
STORE_COUNTERS = (
    "vllm:umbp_blocks_stored_total",
    "vllm:umbp_bytes_stored_total",
    "vllm:umbp_store_failures_total",
    "vllm:umbp_stores_dropped_total",
)


async def _step_engines(engines: Sequence[RunningEngine], model: str, vocab: int) -> None:
    """One request per engine shorter than a block (nothing to look up or store), so
    that each engine steps and its workers report the stores finished since."""
    import random

    import aiohttp

    rng = random.Random(7)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        for e in engines:
            prompt = [rng.randrange(FIRST_TOKEN_ID, vocab) for _ in range(16)]
            await _stream_completion(session, e.base_url, model, prompt, 1)


def _settled_store_counters(
    engines: Sequence[RunningEngine],
    before: list[dict[str, float]],
    r: Any,
    model: str,
    vocab: int,
    rounds: int = 10,
) -> dict[str, float]:
    """The store counters' growth since ``before`` once the stores issued so far have
    landed in Redis and been reported: the engines are stepped until the stored-blocks
    count stays the same over two steps of every engine (``rounds`` at most)."""
    _wait_until_redis_settles(r)
    last: float | None = None
    for _ in range(rounds):
        asyncio.run(_step_engines(engines, model, vocab))
        now = [e.metrics() for e in engines]
        stored = sum(m.get(STORE_COUNTERS[0], 0.0) for m in now)
        if stored == last:
            break
        last = stored
    return {
        n: sum(m.get(n, 0.0) - b.get(n, 0.0) for m, b in zip(now, before, strict=True))
        for n in STORE_COUNTERS
    }


def _counter_delta(
    engines: Sequence[RunningEngine], before: list[dict[str, float]]
) -> dict[str, float]:
    names = (
        PREFIX_HITS,
        PREFIX_QUERIES,
        EXTERNAL_HITS,
        EXTERNAL_QUERIES,
        *CONNECTOR_COUNTERS,
        *(f"{h}_{s}" for h in ENGINE_HISTOGRAMS for s in ("sum", "count")),
    )
    from umbp_redis.engine.stats import STEP_OBSERVATIONS  # the per-step account

    hist = [f"{h}_{s}" for h, _, _ in STEP_OBSERVATIONS.values() for s in ("sum", "count")]
    out: dict[str, float] = {}
    for e, b in zip(engines, before, strict=True):
        now = e.metrics()
        for n in (*names, *hist):
            out[n] = out.get(n, 0.0) + now.get(n, 0.0) - b.get(n, 0.0)
    return out


@dataclass(frozen=True)
class FleetPlan:
    """Everything one run needs besides its configurations."""

    model: str
    engines: int
    shape: ConversationShape
    block_size: int
    conversation_rate: float = 0.0
    think_time_s: float = 0.0  # between an answer and the conversation's next turn
    request_timeout_s: float = 600.0
    log_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="umbp-fleet-")))
    # Set: the workload is vLLM's client on this dataset instead of the conversations.
    repetition: RepetitionShape | None = None
    # > 0: the last engine starts once every conversation has finished this many rounds.
    join_late_round: int = 0
    # Redis faults during the measured conversations, the same in every configuration.
    faults: tuple[Fault, ...] = ()

    @property
    def longest_request_tokens(self) -> int:
        """Tokens of the workload's longest request, prompt and answer."""
        if self.repetition is not None:
            return self.repetition.longest_request_tokens
        return self.shape.longest_request_tokens

    @property
    def max_model_len(self) -> int:
        """The longest request, prompt and answer, rounded up to whole blocks."""
        return -(-self.longest_request_tokens // self.block_size) * self.block_size

    @property
    def requests_per_run(self) -> int:
        """Requests one configuration sends in one repeat (both passes of the client)."""
        if self.repetition is not None:
            return 2 * self.repetition.prompts
        return self.shape.conversations * self.shape.rounds


def run_config(
    plan: FleetPlan,
    config: FleetConfig,
    repeat: int,
    maxmemory: int,
    on_request: Callable[[], None],
    status: Callable[[str], None],
) -> ConfigRun:
    """Run one configuration once: its own Redis, its engines (and vllm-router where
    the configuration routes by it), the workload."""
    import functools

    import redis

    from umbp_redis.bench.vllm_router import (
        RouterWorker,
        RunningRouter,
        kv_events_config,
        served_by,
        start_vllm_router,
        wait_until_routable,
    )
    from umbp_redis.testing.embedded_redis import EmbeddedRedis

    out = ConfigRun(config.name, repeat, redis_maxmemory=maxmemory, connector=config.connector)
    policy = config.vllm_router_policy
    late = 1 if plan.join_late_round else 0
    redis_args: list[str] = []
    if maxmemory:
        redis_args += ["--maxmemory", str(maxmemory), "--maxmemory-policy", "allkeys-lru"]
    if any(f.kind == "sleep" for f in plan.faults):
        redis_args += ["--enable-debug-command", "yes"]  # DEBUG SLEEP
    server = EmbeddedRedis(redis_args).start()
    engines: list[RunningEngine] = []
    router: RunningRouter | None = None
    try:
        ktc: dict[str, object] | None = None
        if config.connector:
            ktc = {
                "kv_connector": "UMBPRedisConnector",
                "kv_connector_module_path": "umbp_redis.connector",
                "kv_role": "kv_both",
                "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {
                    "redis_url": server.url,
                    **dict(config.connector_options),
                },
                **dict(config.transfer_fields),
            }
        specs: list[EngineSpec] = []
        event_ports: list[tuple[int, int]] = []
        for i in range(plan.engines):
            # Behind vllm-router's kv_aware policy every engine publishes its KV events
            # on ports of its own (the other policies take no event sources), and the
            # late engine's URL is known before it starts.
            if policy:
                event_ports.append((free_port(), free_port()))
            events = kv_events_config(*event_ports[i]) if policy == "kv_aware" else None
            specs.append(
                EngineSpec(
                    plan.model,
                    config.num_blocks,
                    str(i % _cpu_count()),
                    ktc,
                    max_model_len=plan.max_model_len,
                    extra_env=config.engine_env,
                    port=free_port() if policy and i >= plan.engines - late else 0,
                    block_size=plan.block_size if policy else None,
                    behind_router=policy is not None,
                    kv_events_config=events,
                )
            )
        early, late_specs = specs[: plan.engines - late], specs[plan.engines - late :]
        status(f"{config.name}: starting {len(early)} engines")
        run_dir = plan.log_dir / f"r{repeat}-{config.name}"
        engines = start_engines(early, run_dir)
        if policy:
            urls = [e.base_url for e in engines]
            urls += [f"http://127.0.0.1:{spec.port}" for spec in late_specs]
            workers = [
                RouterWorker(url, f"tcp://127.0.0.1:{ev}", f"tcp://127.0.0.1:{replay}")
                for url, (ev, replay) in zip(urls, event_ports, strict=True)
            ]
            status(f"{config.name}: starting vllm-router ({policy})")
            router = start_vllm_router(
                workers,
                policy,
                plan.block_size,
                plan.model,
                run_dir / "router.log",
                config.router_args,
            )
        asyncio.run(_warm_up(engines, plan.model, plan.shape.vocab_size))
        r = redis.Redis.from_url(server.url)
        base_mem = int(r.info("memory")["used_memory"])
        origin = time.perf_counter()
        if plan.repetition is not None:
            status(f"{config.name}: vLLM's client warming engine 0")
            warm = run_client_pass(
                plan.repetition, engines[0].base_url, plan.model, run_dir / "client.log"
            )
            out.requests += _client_records(warm, 0, 0, origin, on_request)
            if config.connector:
                _wait_until_redis_settles(r)
        # Everything below covers the measured requests only.
        before = [e.metrics() for e in engines]
        cpu_before = [e.cpu_seconds() for e in engines]
        base_cpu = _server_cpu_s(r)
        t0 = time.perf_counter()
        if plan.repetition is None:
            status(f"{config.name}: {plan.shape.conversations} conversations")

            async def join() -> None:
                t = time.perf_counter()
                status(f"{config.name}: engine {len(engines)} joins")
                loop = asyncio.get_running_loop()
                start = functools.partial(start_engines, first_index=len(engines))
                new = await loop.run_in_executor(None, start, late_specs, run_dir)
                engines.extend(new)
                await _warm_up(new, plan.model, plan.shape.vocab_size)
                for e in new:
                    before.append(e.metrics())
                    cpu_before.append(e.cpu_seconds())
                    if router is not None:
                        await loop.run_in_executor(None, wait_until_routable, router, e.base_url)
                out.join_wait_s += time.perf_counter() - t
                status(f"{config.name}: {plan.shape.conversations} conversations")

            routing = Routing(
                None if router else Router(config.router, plan.engines),
                (router.base_url,) if router else (),
                plan.join_late_round,
                plan.engines - late,
            )
            injector = None
            if plan.faults:
                injector = FaultInjector(server, lambda: list(engines), plan.faults)
            try:
                out.requests = asyncio.run(
                    _run_conversations(
                        lambda: [e.base_url for e in engines],
                        plan.model,
                        ConversationScript(plan.shape),
                        routing,
                        plan.conversation_rate,
                        plan.think_time_s,
                        on_request,
                        plan.request_timeout_s,
                        join if late else None,
                        injector.start if injector else None,
                    )
                )
            finally:
                if injector is not None:
                    injector.stop()  # a fault in progress is lifted: Redis runs again
            if injector is not None:
                out.faults = injector.report(out.requests)
                out.engine_rss_bytes = injector.rss_bytes
                r.close()
                r = redis.Redis.from_url(server.url)  # a fresh connection after the faults
            if router is not None:
                engine_of = served_by(
                    [e.log_path for e in engines], [q.request_id for q in out.requests]
                )
                for q in out.requests:
                    q.engine = engine_of.get(q.request_id, -1)
        else:
            # Sticky routing measures vLLM's own prefix cache on the warmed engine;
            # every other routing measures the other engine.
            target = 0 if config.router == "sticky" else 1 % len(engines)
            status(f"{config.name}: vLLM's client measuring engine {target}")
            measured = run_client_pass(
                plan.repetition, engines[target].base_url, plan.model, run_dir / "client.log"
            )
            out.requests += _client_records(measured, 1, target, origin, on_request)
            out.hits_from_counters = True
        out.wall_s = time.perf_counter() - t0 - out.join_wait_s
        out.counters = _counter_delta(engines, before)
        if config.connector:
            out.counters.update(
                _settled_store_counters(engines, before, r, plan.model, plan.shape.vocab_size)
            )
        for e, b in zip(engines, cpu_before, strict=True):
            for name, now in e.cpu_seconds().items():
                out.engine_cpu_s[name] = out.engine_cpu_s.get(name, 0.0) + now - b.get(name, 0.0)
        out.redis_used_bytes = max(0, int(r.info("memory")["used_memory"]) - base_mem)
        out.redis_keys = int(r.dbsize())
        out.redis_cpu_s = _server_cpu_s(r) - base_cpu
        if any(f["kind"].startswith("kill") and f["started_s"] is not None for f in out.faults):
            out.redis_cpu_s = math.nan  # the restarted server counts its own CPU only
        r.close()
    finally:
        if router is not None:
            router.stop()
        stop_engines(engines)
        server.cleanup()
    return out


def _client_records(
    requests: Sequence[ClientRequest],
    round_index: int,
    engine: int,
    origin: float,
    on_request: Callable[[], None],
) -> list[RequestRecord]:
    """A client pass as records: the request's index as its conversation, the pass
    (0: warming, 1: measured) as its round, send times since ``origin`` (perf_counter)."""
    out = []
    for q in requests:
        out.append(
            RequestRecord(
                q.index,
                round_index,
                engine,
                q.ttft_s,
                q.latency_s,
                q.prompt_tokens,
                0,
                q.text,
                q.error,
                q.sent_at - origin,
            )
        )
        on_request()
    return out


def _wait_until_redis_settles(r: Any, quiet_s: float = 1.0, timeout_s: float = 60.0) -> None:
    """Return once Redis's key count and memory stayed unchanged for ``quiet_s``: the
    warming engine's stores, written after its requests finished, have all landed."""
    deadline = time.monotonic() + timeout_s
    last: tuple[int, int] | None = None
    since = time.monotonic()
    while time.monotonic() < deadline:
        now = (int(r.dbsize()), int(r.info("memory")["used_memory"]))
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return
        time.sleep(0.1)


def _server_cpu_s(r: Any) -> float:
    info = r.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


def _cpu_count() -> int:
    import os

    return len(os.sched_getaffinity(0))


def run_fleet_bench(
    plan: FleetPlan,
    configs: Sequence[FleetConfig],
    repeats: int,
    progress: bool = True,
) -> dict[str, Any]:
    """Run every configuration ``repeats`` times (order rotated per repeat) and return
    the runs and their summary."""
    from tqdm import tqdm

    total = len(configs) * repeats * plan.requests_per_run
    bar = tqdm(total=total, unit="req", disable=not progress, file=sys.stderr)
    runs: list[ConfigRun] = []
    try:
        for rep in range(repeats):
            order = list(configs[rep % len(configs) :]) + list(configs[: rep % len(configs)])
            # small-redis needs the bytes umbp-redis stored in the same repeat.
            order.sort(key=lambda c: c.redis_maxmemory_share > 0)
            stored = 0
            for config in order:
                maxmemory = 0
                if config.redis_maxmemory_share > 0:
                    maxmemory = max(1 << 20, int(stored * config.redis_maxmemory_share))

                def status(text: str, rep: int = rep) -> None:
                    bar.set_description(f"repeat {rep + 1}/{repeats} {text}")

                run = run_config(plan, config, rep, maxmemory, lambda: bar.update(1), status)
                if config.name == "umbp-redis":
                    stored = run.redis_used_bytes
                runs.append(run)
    finally:
        bar.close()
    summary = summarize([c.name for c in configs], runs)
    return {
        "plan": {
            "model": plan.model,
            "engines": plan.engines,
            "block_size": plan.block_size,
            "shape": asdict(plan.shape),
            "conversation_rate": plan.conversation_rate,
            "think_time_s": plan.think_time_s,
            "repetition": asdict(plan.repetition) if plan.repetition else None,
            "join_late_round": plan.join_late_round,
            "log_dir": str(plan.log_dir),
            "faults": [f.label for f in plan.faults],
        },
        "configs": [asdict(c) for c in configs],
        "runs": [asdict(r) for r in runs],
        "summary": summary,
        **({"faults": fault_summary(plan.faults, runs, summary)} if plan.faults else {}),
    }


def _median_spread(values: Sequence[float]) -> dict[str, float]:
    finite = [v for v in values if not math.isnan(v)]
    if not finite:
        return {"median": math.nan, "min": math.nan, "max": math.nan}
    return {"median": statistics.median(finite), "min": min(finite), "max": max(finite)}


def summarize(names: Sequence[str], runs: Sequence[ConfigRun]) -> dict[str, Any]:
    """Per configuration: TTFT mean/p50/p90/p99, throughput, hit tokens, Redis bytes,
    outputs equal to no-connector's (medians over repeats with min and max), and the
    share of the ideal gain and the ratio to its connector-less twin."""
    by_rep: dict[int, dict[str, ConfigRun]] = {}
    for r in runs:
        by_rep.setdefault(r.repeat, {})[r.config] = r
    out: dict[str, Any] = {}
    for name in names:
        per: dict[str, list[float]] = {}

        def add(key: str, value: float, per: dict[str, list[float]] = per) -> None:
            per.setdefault(key, []).append(value)

        for reps in by_rep.values():
            run = reps.get(name)
            if run is None:
                continue
            s = LatencySummary.of(run.ttfts())
            for stat in ("mean", "p50", "p90", "p99"):
                add(f"ttft_{stat}_s", getattr(s, stat))
            ok = [q for q in run.requests if not q.error]
            add("requests_per_s", len(ok) / run.wall_s if run.wall_s else math.nan)
            add("errors", len(run.requests) - len(ok))
            add("hit_tokens", run.hit_tokens())
            add("engine_load", run.engine_load())
            add("local_hit_tokens", run.counters.get(PREFIX_HITS, 0.0))
            add("external_hit_tokens", run.counters.get(EXTERNAL_HITS, 0.0))
            # The counters cover every request of the conversations, the client's
            # measured pass (round 1) only.
            measured = [q for q in ok if not run.hits_from_counters or q.round_index == 1]
            if measured:
                count = len(measured)
                add("local_hit_tokens_per_request", run.counters.get(PREFIX_HITS, 0.0) / count)
                add(
                    "external_hit_tokens_per_request",
                    run.counters.get(EXTERNAL_HITS, 0.0) / count,
                )
            add("routed_away_share", run.routed_away_share())
            add("redis_bytes", run.redis_used_bytes)
            add("redis_cpu_s", run.redis_cpu_s)
            for proc, cpu in run.engine_cpu_s.items():
                add(f"cpu_s:{proc}", cpu)
            for phase in ("request_queue_time", "request_prefill_time"):
                key = f"vllm:{phase}_seconds"
                n = run.counters.get(f"{key}_count", 0.0)
                if n:
                    add(f"{phase}_mean_s", run.counters.get(f"{key}_sum", 0.0) / n)
            for key, n in run.counters.items():  # the account's timings, where collected
                if key.startswith("vllm:umbp_") and key.endswith("_seconds_count"):
                    timing = key[len("vllm:umbp_") : -len("_count")]
                    add(f"{timing}_total", run.counters.get(f"vllm:umbp_{timing}_sum", 0.0))
                    add(f"{timing}_count", n)
            add("stalled_requests", run.counters.get("vllm:umbp_stalled_requests_sum", 0.0))
            base = reps.get("no-connector")
            if base is not None:
                want = {(q.conversation, q.round_index): q.text for q in base.requests}
                same = sum(1 for q in ok if want.get((q.conversation, q.round_index)) == q.text)
                add("outputs_equal_share", same / len(ok) if ok else math.nan)
            ideal = reps.get("ideal")
            if base is not None and ideal is not None:
                for stat in ("mean", "p90"):
                    b = getattr(LatencySummary.of(base.ttfts()), stat)
                    i = getattr(LatencySummary.of(ideal.ttfts()), stat)
                    m = getattr(s, stat)
                    add(f"ideal_gain_share_{stat}", share_of_ideal_gain(b, m, i))
            twin = _twin(name, reps)
            if twin is not None:
                t = LatencySummary.of(twin.ttfts())
                add("ttft_mean_vs_twin", s.mean / t.mean if t.mean else math.nan)
                add("ttft_p90_vs_twin", s.p90 / t.p90 if t.p90 else math.nan)
                add("remote_hit_cost_ratio", remote_hit_cost_ratio(run, twin))
        out[name] = {k: _median_spread(v) for k, v in per.items()}
    return out


def remote_hit_cost_ratio(run: ConfigRun, twin: ConfigRun) -> float:
    """vLLM's prefill seconds per token loaded from the external cache over those per
    token computed: the twin (no connector) gives the seconds per computed token, and
    what ``run`` spent beyond its own computed tokens at that rate is charged to its
    loaded tokens. A rough figure (prefill time includes the batch a request shares);
    NaN where nothing was loaded or computed."""
    prefill, computed, loaded = run.prefill_account()
    twin_prefill, twin_computed, _ = twin.prefill_account()
    if not loaded or not twin_computed or not twin_prefill:
        return math.nan
    per_computed = twin_prefill / twin_computed
    return (prefill - computed * per_computed) / loaded / per_computed


def _twin(name: str, reps: dict[str, ConfigRun]) -> ConfigRun | None:
    """The connector-less configuration with the same routing and cache, if any."""
    if name == "sticky-umbp":
        return reps.get("sticky")
    if name == "ideal-umbp":
        return reps.get("ideal")
    if name in ("no-connector", "ideal", "sticky"):
        return None
    run = reps.get(name)
    if run is not None and not run.connector:
        return None
    return reps.get("no-connector")


_TABLE_COLUMNS = (
    ("TTFT mean", "ttft_mean_s", "{:.3f}"),
    ("p50", "ttft_p50_s", "{:.3f}"),
    ("p90", "ttft_p90_s", "{:.3f}"),
    ("p99", "ttft_p99_s", "{:.3f}"),
    ("req/s", "requests_per_s", "{:.2f}"),
    ("busy", "engine_load", "{:.2f}"),
    ("hit tok", "hit_tokens", "{:.0f}"),
    ("local/req", "local_hit_tokens_per_request", "{:.0f}"),
    ("redis/req", "external_hit_tokens_per_request", "{:.0f}"),
    ("moved", "routed_away_share", "{:.0%}"),
    ("Redis MB", "redis_bytes", "{:.1f}"),
    ("ideal gain", "ideal_gain_share_mean", "{:.0%}"),
    ("p90 gain", "ideal_gain_share_p90", "{:.0%}"),
    ("vs twin", "ttft_mean_vs_twin", "{:.2f}x"),
    ("load/compute", "remote_hit_cost_ratio", "{:.2f}"),
    ("same out", "outputs_equal_share", "{:.0%}"),
)


def format_table(result: dict[str, Any]) -> str:
    """The summary as a text table: medians, with [min-max] over repeats for TTFT."""
    summary = result["summary"]
    head = ["configuration", *(c[0] for c in _TABLE_COLUMNS)]
    rows = [head]
    for name, stats in summary.items():
        row = [name]
        for _, key, fmt in _TABLE_COLUMNS:
            s = stats.get(key)
            if s is None or math.isnan(s["median"]):
                row.append("-")
                continue
            scale = 1e-6 if key == "redis_bytes" else 1.0
            cell = fmt.format(s["median"] * scale)
            if key.startswith("ttft_mean") or key.startswith("ideal_gain_share_mean"):
                if s["min"] != s["max"]:
                    cell += f" [{fmt.format(s['min'] * scale)}-{fmt.format(s['max'] * scale)}]"
            row.append(cell)
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    repeats = len({r["repeat"] for r in result["runs"]})
    lines.append(
        f"\n{workload_title(result['plan'])}, {repeats} repeats; "
        "medians over repeats [min-max]; 'busy': other requests in flight on the engine "
        "a request was sent to; 'local/req', 'redis/req': prefix tokens hit per request in "
        "the engine's own cache and in Redis; 'moved': turns served away from the engine "
        "of the conversation's previous round; 'ideal gain': share of the ideal's TTFT gain over "
        "no-connector; 'vs twin': mean TTFT against the same routing and cache without the "
        "connector; 'load/compute': prefill seconds per token loaded from Redis over those "
        "per token computed (rough); 'same out': answers equal to no-connector's"
    )
    return "\n".join(lines)


def workload_title(plan: dict[str, Any]) -> str:
    """One line naming a run's workload and which requests its TTFTs cover."""
    rep = plan.get("repetition")
    if rep:
        return (
            f"{plan['engines']} engines, vLLM's client (prefix_repetition: {rep['prompts']} "
            f"prompts, {rep['prefixes']} prefixes of {rep['prefix_tokens']} + "
            f"{rep['suffix_tokens']} tokens, {rep['concurrency']} at once) warming engine 0; "
            "TTFT of the same prompts on engine 1 (sticky: engine 0 again)"
        )
    shape = plan["shape"]
    join = plan.get("join_late_round") or 0
    late = f" (the last joining after round {join})" if join else ""
    return (
        f"{plan['engines']} engines{late}, {shape['conversations']} conversations x "
        f"{shape['rounds']} rounds; TTFT over rounds 2-{shape['rounds']}"
    )


def account_lines(result: dict[str, Any]) -> list[str]:
    """Where each configuration's time went: vLLM's queue and prefill phases, CPU
    seconds of the engines' processes and of Redis, and the connector's per-step
    account where it runs."""
    lines = []
    for name, stats in result["summary"].items():
        cpu = ", ".join(
            f"{k[6:]} {v['median']:.1f}" for k, v in sorted(stats.items()) if k.startswith("cpu_s:")
        )
        queue = stats.get("request_queue_time_mean_s", {}).get("median", math.nan)
        prefill = stats.get("request_prefill_time_mean_s", {}).get("median", math.nan)
        lines.append(f"{name}: mean queue {queue:.3f} s, prefill {prefill:.3f} s; CPU s: {cpu}")
        n = stats.get("lookup_seconds_count")
        if not n or not n["median"]:
            continue

        def per(key: str, stats: dict[str, Any] = stats) -> str:
            total = stats.get(f"{key}_total", {}).get("median", math.nan)
            count = stats.get(f"{key}_count", {}).get("median", math.nan)
            avg = total / count * 1e3 if count else math.nan
            return f"{total:.2f} s over {count:.0f} ({avg:.2f} ms each)"

        stalled = stats.get("stalled_requests", {}).get("median", 0.0)
        redis_cpu = stats.get("redis_cpu_s", {}).get("median", math.nan)
        lines.append(
            f"{name}: Redis server CPU {redis_cpu:.2f} s; lookups {per('lookup_seconds')}; "
            "scheduler hooks "
            f"{per('scheduler_step_seconds')}; sync-load waits "
            f"{per('sync_load_wait_seconds')}; store CPU {per('store_cpu_seconds')}; "
            f"other requests stalled behind sync loads {stalled:.0f}"
        )
    return lines


def write_png(result: dict[str, Any], path: Path) -> bool:
    """A box plot of TTFT (rounds 2+) per configuration, all repeats; False without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = list(result["summary"])
    data = []
    for name in names:
        data.append(
            [
                q["ttft_s"]
                for r in result["runs"]
                if r["config"] == name
                for q in r["requests"]
                if q["round_index"] >= 1 and not q["error"]
            ]
        )
    fig, ax = plt.subplots(figsize=(1.6 * len(names) + 2, 4.5))
    ax.boxplot(data, whis=(5, 95), showmeans=True)
    ax.set_xticks(range(1, len(names) + 1), names, rotation=20)
    ax.set_ylabel("TTFT (s), measured requests")
    title = f"{workload_title(result['plan'])} (whiskers p5-p95, triangle: mean)"
    ax.set_title(textwrap.fill(title, 20 * len(names) + 40), fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
