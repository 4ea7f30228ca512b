"""``umbp-redis bench``: benchmarks that print ratios against baselines of the same run."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

# Where the project's Valkey test binaries sit, from the repository root.
DEFAULT_VALKEY_SERVER = "../shared/servers/valkey-8.0.1/valkey-server"


def register(sub: Any) -> None:
    """Add the ``bench`` subcommand and its targets to the CLI."""
    p = sub.add_parser("bench", help="run a benchmark")
    targets = p.add_subparsers(dest="bench_target", metavar="TARGET")
    plane = targets.add_parser(
        "dataplane",
        help="store/load GB/s and lookup latency vs redis-benchmark and plain redis-py",
    )
    plane.add_argument(
        "--redis-url",
        default=None,
        help="server to measure (default: a private server started for the run); the "
        "benchmark writes and deletes only keys of its own run",
    )
    plane.add_argument("--json", action="store_true", help="print one JSON object")
    plane.add_argument(
        "--sizes", default="65536,524288,2097152", help="comma-separated value sizes in bytes"
    )
    plane.add_argument(
        "--total-mib", type=int, default=256, help="payload MiB moved per measurement (default 256)"
    )
    plane.add_argument("--repeats", type=int, default=3, help="runs per measurement; best is kept")
    plane.add_argument(
        "--servers",
        default=None,
        help="compare servers instead, each started privately in turn: a comma-separated "
        "list of redis or valkey, each with :N for its io-threads (e.g. "
        "redis,valkey:1,valkey:2); transfers only, each against its own benchmark tool",
    )
    plane.add_argument(
        "--valkey-server",
        default=os.environ.get("UMBP_VALKEY_SERVER", DEFAULT_VALKEY_SERVER),
        help="valkey-server binary for --servers (default: $UMBP_VALKEY_SERVER, else "
        "../shared/servers/valkey-8.0.1/valkey-server from the current directory)",
    )
    plane.set_defaults(handler=_run_dataplane)
    cl = targets.add_parser(
        "cluster",
        help="store/load GB/s and lookup p50: 1 node vs 3 masters, each behind a "
        "rate-limited link in its own network namespace (needs root)",
    )
    cl.add_argument("--json", action="store_true", help="print one JSON object")
    cl.add_argument(
        "--rate-mbit", type=int, default=1600, help="link rate per node, each way (default 1600)"
    )
    cl.add_argument("--total-mib", type=int, default=192, help="MiB moved per measurement")
    cl.add_argument("--repeats", type=int, default=3, help="interleaved rounds; best is kept")
    cl.set_defaults(handler=_run_cluster)
    _register_fleet(targets)
    p.set_defaults(handler=lambda a: (p.print_help(), 0)[1])


def _run_dataplane(args: argparse.Namespace) -> int:
    from umbp_redis.bench.dataplane import format_table, run_dataplane_bench
    from umbp_redis.testing.embedded_redis import EmbeddedRedis

    url = args.redis_url
    sizes = [int(s) for s in args.sizes.split(",") if s]
    if args.servers:
        return _compare_servers(args, sizes)
    server = None
    if not url:
        server = EmbeddedRedis().start()
        url = server.url
    try:
        result = run_dataplane_bench(
            url,
            sizes=sizes,
            total_bytes=args.total_mib << 20,
            repeats=args.repeats,
            progress=None if args.json else sys.stderr,
        )
    finally:
        if server is not None:
            server.cleanup()
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(format_table(result))
    return 0


def _compare_servers(args: argparse.Namespace, sizes: list[int]) -> int:
    from umbp_redis.bench.dataplane import (
        format_server_table,
        parse_servers,
        run_server_comparison,
    )

    try:
        servers = parse_servers(args.servers, args.valkey_server)
    except ValueError as e:
        print(f"umbp-redis bench dataplane: {e}", file=sys.stderr)
        return 2
    runs = run_server_comparison(
        servers,
        sizes=sizes,
        total_bytes=args.total_mib << 20,
        repeats=args.repeats,
        progress=None if args.json else sys.stderr,
    )
    print(json.dumps(runs, indent=2) if args.json else format_server_table(runs))
    return 0


def _run_cluster(args: argparse.Namespace) -> int:
    from umbp_redis.bench.cluster import (
        NetworkSetupError,
        format_cluster_table,
        run_cluster_bench,
    )

    try:
        result = run_cluster_bench(
            rate_mbit=args.rate_mbit,
            total_mib=args.total_mib,
            repeats=args.repeats,
            progress=None if args.json else sys.stderr,
        )
    except NetworkSetupError as e:
        print(f"umbp-redis bench cluster: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(format_cluster_table(result))
    return 0


def _register_fleet(targets: Any) -> None:
    from umbp_redis.bench.fleet import BASE_CONFIGS, OPTIONAL_CONFIGS, WORKLOADS
    from umbp_redis.bench.fleet_workload import ROUTINGS

    fl = targets.add_parser(
        "fleet",
        help="TTFT of several OpenAI-server engines behind a router under concurrent "
        "multi-turn conversations: no connector, umbp-redis and the ideal side by side",
    )
    fl.add_argument("--engines", type=int, default=2, help="engines, one core each (default 2)")
    fl.add_argument(
        "--workload",
        choices=WORKLOADS,
        default="conversations",
        help="conversations (default): multi-turn conversations at once; "
        "vllm-prefix-repetition: vLLM's client (vllm.benchmarks.serve, prefix_repetition "
        "dataset) warms engine 0, then the same prompts measure engine 1 (sticky "
        "configurations: engine 0 again)",
    )
    fl.add_argument(
        "--router",
        choices=ROUTINGS,
        default="round-robin",
        help="routing of no-connector and umbp-redis (default round-robin: round r of "
        "conversation c on engine (c+r) mod N); vllm-router:POLICY puts the vLLM project's "
        "router (pip install 'umbp-redis[router]') in front of the engines, which publish "
        "their KV events to it",
    )
    fl.add_argument(
        "--router-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="an argument for vllm-router (repeatable, one word each, e.g. "
        "--router-arg=--kv-penalty-external --router-arg=0.9; also "
        "--router-temperature, --kv-aware-session-affinity-ttl-secs)",
    )
    fl.add_argument(
        "--join-late",
        type=int,
        default=0,
        metavar="K",
        help="scale-out: the last engine starts cold once every conversation has finished "
        "K rounds (default 0: all engines from the start)",
    )
    fl.add_argument(
        "--faults",
        default=None,
        metavar="SPEC",
        help="Redis faults during the measured conversations, the same schedule in every "
        "configuration against its own Redis: KIND@START+DURATION,... in seconds since the "
        "workload started, KIND one of kill (restart empty), kill-keep (SAVE, restart with "
        "the dump), pause (CLIENT PAUSE), sleep (DEBUG SLEEP), maxmemory (10%% of "
        "used_memory, allkeys-lru); e.g. kill@20+8,pause@80+4; reported per fault and "
        "phase (before, during, after)",
    )
    fl.add_argument("--conversations", type=int, default=4, help="conversations at once")
    fl.add_argument("--rounds", type=int, default=6, help="rounds per conversation")
    fl.add_argument("--system-tokens", type=int, default=640, help="shared system prompt")
    fl.add_argument("--user-tokens", type=int, default=96, help="tokens of each user turn")
    fl.add_argument(
        "--assistant-tokens", type=int, default=160, help="tokens of each scripted assistant turn"
    )
    fl.add_argument("--answer-tokens", type=int, default=16, help="tokens generated per request")
    fl.add_argument("--prompts", type=int, default=16, help="vllm-prefix-repetition: prompts")
    fl.add_argument(
        "--prefixes", type=int, default=4, help="vllm-prefix-repetition: distinct prefixes"
    )
    fl.add_argument(
        "--prefix-tokens", type=int, default=1024, help="vllm-prefix-repetition: prefix length"
    )
    fl.add_argument(
        "--suffix-tokens", type=int, default=128, help="vllm-prefix-repetition: suffix length"
    )
    fl.add_argument(
        "--concurrency",
        type=int,
        default=4,
        help="vllm-prefix-repetition: requests in flight at most",
    )
    fl.add_argument(
        "--conversation-rate",
        type=float,
        default=0.0,
        help="conversations started per second (default 0: all at once)",
    )
    fl.add_argument(
        "--think-time-s",
        type=float,
        default=0.0,
        help="seconds between an answer and the conversation's next turn (default 0)",
    )
    fl.add_argument("--blocks", type=int, default=24, help="KV blocks per engine (default 24)")
    fl.add_argument("--repeats", type=int, default=3, help="interleaved repeats (default 3)")
    fl.add_argument(
        "--configs",
        default=",".join(BASE_CONFIGS),
        help="comma-separated subset of the base configurations to run (also "
        f"{', '.join(OPTIONAL_CONFIGS)}: ideal with the connector)",
    )
    fl.add_argument(
        "--small-redis",
        action="store_true",
        help="add small-redis: umbp-redis with Redis maxmemory at half of what it stored",
    )
    fl.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME[@ROUTER]:key=value,...",
        help="add a configuration (repeatable): umbp-redis, routed by ROUTER if given "
        "(NAME@vllm-router:kv_aware:...), with these connector options; env.VAR=value sets "
        "an engine environment variable, ktc.FIELD=value a field of --kv-transfer-config, "
        "connector=false runs without the connector, router.FLAG=value passes --FLAG value "
        "to vllm-router",
    )
    fl.add_argument(
        "--model",
        default=None,
        help="model directory (default: a random Llama, hidden 1024, 8 layers, fp32, "
        "built once in --work-dir)",
    )
    fl.add_argument(
        "--work-dir", default=None, help="where the model and engine logs go (default: a temp dir)"
    )
    fl.add_argument("--json", action="store_true", help="print one JSON object")
    fl.add_argument("--png", default=None, help="write a PNG of the TTFT distributions here")
    fl.add_argument("--quiet", action="store_true", help="no progress bar")
    fl.set_defaults(handler=_run_fleet)


def _run_fleet(args: argparse.Namespace) -> int:
    import tempfile
    from pathlib import Path

    from umbp_redis.bench.fleet import (
        BASE_CONFIGS,
        OPTIONAL_CONFIGS,
        FleetPlan,
        account_lines,
        build_configs,
        format_table,
        ideal_block_count,
        parse_variant,
        repetition_ideal_block_count,
        run_fleet_bench,
        write_png,
    )
    from umbp_redis.bench.fleet_faults import format_fault_table, parse_faults
    from umbp_redis.bench.fleet_workload import ConversationShape, RepetitionShape
    from umbp_redis.bench.vllm_router import RouterMissingError
    from umbp_redis.store.errors import ConfigError
    from umbp_redis.testing.tiny_model import PREFILL_BOUND_SPEC, build_tiny_llama

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="umbp-fleet-"))
    block_size = 128  # vLLM's CPU backend
    try:
        variants = [parse_variant(v) for v in args.variant]
        faults = parse_faults(args.faults) if args.faults is not None else ()
        if faults and args.workload != "conversations":
            raise ValueError(f"--faults needs the conversations workload, not {args.workload}")
        shape = ConversationShape(
            conversations=args.conversations,
            rounds=args.rounds,
            system_tokens=args.system_tokens,
            user_tokens=args.user_tokens,
            assistant_tokens=args.assistant_tokens,
            answer_tokens=args.answer_tokens,
        )
        shape.validate()
        if args.engines < 1 or args.blocks < 1 or args.repeats < 1:
            raise ValueError("--engines, --blocks and --repeats must be at least 1")
        if args.model:
            model = args.model
        else:
            spec = PREFILL_BOUND_SPEC
            model = str(build_tiny_llama(work / "model", spec))
            shape = ConversationShape(**{**shape.__dict__, "vocab_size": spec.vocab_size})
        wanted = [c for c in args.configs.split(",") if c]
        named = (*BASE_CONFIGS, *OPTIONAL_CONFIGS)
        unknown = sorted(set(wanted) - set(named))
        if unknown:
            raise ValueError(f"--configs: unknown {unknown}; choose from {named}")
        if args.conversation_rate < 0 or args.think_time_s < 0:
            raise ValueError("--conversation-rate and --think-time-s must be at least 0")
        repetition = None
        if args.workload == "vllm-prefix-repetition":
            if args.engines != 2:
                raise ValueError(
                    "--workload vllm-prefix-repetition warms engine 0 and measures engine 1: "
                    f"--engines must be 2, got {args.engines}"
                )
            repetition = RepetitionShape(
                prompts=args.prompts,
                prefixes=args.prefixes,
                prefix_tokens=args.prefix_tokens,
                suffix_tokens=args.suffix_tokens,
                answer_tokens=args.answer_tokens,
                concurrency=args.concurrency,
            )
            repetition.validate()
        longest = (repetition or shape).longest_request_tokens
        if longest > args.blocks * block_size:
            raise ValueError(
                f"--blocks {args.blocks} holds {args.blocks * block_size} tokens, fewer than "
                f"the longest request ({longest} tokens): raise --blocks or shorten the turns"
            )
        if repetition is not None:
            ideal = repetition_ideal_block_count(repetition, block_size, args.blocks)
        else:
            ideal = ideal_block_count(shape, args.engines, block_size, args.blocks)
        configs = [
            c
            for c in build_configs(
                args.router,
                args.blocks,
                ideal,
                small_redis=args.small_redis,
                variants=variants,
                router_args=args.router_arg,
            )
            if c.name in wanted or c.name not in named
        ]
        _check_fleet_routing(args, configs)
    except (ValueError, RouterMissingError) as e:
        raise ConfigError(str(e)) from e
    plan = FleetPlan(
        model=model,
        engines=args.engines,
        shape=shape,
        block_size=block_size,
        conversation_rate=args.conversation_rate,
        think_time_s=args.think_time_s,
        log_dir=work / "logs",
        repetition=repetition,
        join_late_round=args.join_late,
        faults=faults,
    )
    result = run_fleet_bench(plan, configs, args.repeats, progress=not args.quiet)
    if args.png:
        if not write_png(result, Path(args.png)):
            print("umbp-redis bench fleet: no PNG (matplotlib is not installed)", file=sys.stderr)
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    else:
        print(format_table(result))
        for line in account_lines(result):
            print(line)
        if "faults" in result:
            print()
            print(format_fault_table(result["faults"]))
    return 0


def _check_fleet_routing(args: argparse.Namespace, configs: Any) -> None:
    """Raise ``ValueError`` where the run's routing cannot work: vllm-router or
    ``--join-late`` with vLLM's client workload, a join round outside the conversation,
    ``--router-arg`` with no configuration behind vllm-router; ``RouterMissingError``
    where a configuration needs vllm-router and it is not installed."""
    from umbp_redis.bench.vllm_router import find_router_binary

    behind = [c.name for c in configs if c.vllm_router_policy]
    if behind and args.workload != "conversations":
        raise ValueError(f"vllm-router routes the conversations workload only ({behind})")
    if args.router_arg and not behind:
        raise ValueError("--router-arg needs a configuration routed by vllm-router")
    if args.join_late:
        if args.workload != "conversations":
            raise ValueError("--join-late needs the conversations workload")
        if args.engines < 2:
            raise ValueError("--join-late needs 2 engines at least")
        if not 1 <= args.join_late < args.rounds:
            raise ValueError(f"--join-late must be between 1 and --rounds - 1 ({args.rounds - 1})")
    if behind:
        find_router_binary()
