"""The fleet benchmark's second workload: vLLM's own benchmark client
(``vllm.benchmarks.serve``, dataset ``prefix_repetition``) warming one engine, then
measuring another with the same prompts.

The client runs in this process, its output in a log file. Each pass returns one
``ClientRequest`` per prompt, in the dataset's order (the same in every pass and
configuration for one seed).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from umbp_redis.bench.fleet_workload import RepetitionShape


@dataclass(frozen=True)
class ClientRequest:
    """One request of a client pass; times in seconds, ``sent_at`` on ``time.perf_counter``'s
    clock."""

    index: int
    ttft_s: float
    latency_s: float
    prompt_tokens: int
    text: str
    error: str
    sent_at: float


def client_arguments(shape: RepetitionShape, base_url: str, model: str) -> list[str]:
    """The command line of one pass of ``vllm.benchmarks.serve`` for ``shape``."""
    return [
        "--backend",
        "openai",
        "--base-url",
        base_url,
        "--model",
        model,
        "--dataset-name",
        "prefix_repetition",
        "--num-prompts",
        str(shape.prompts),
        "--prefix-repetition-prefix-len",
        str(shape.prefix_tokens),
        "--prefix-repetition-suffix-len",
        str(shape.suffix_tokens),
        "--prefix-repetition-num-prefixes",
        str(shape.prefixes),
        "--prefix-repetition-output-len",
        str(shape.answer_tokens),
        "--max-concurrency",
        str(shape.concurrency),
        "--seed",
        str(shape.seed),
        "--temperature",
        "0",
        "--ignore-eos",
        # The client's readiness probe sends the first prompt: it would warm the
        # measured engine. The engines are ready before a pass starts.
        "--ready-check-timeout-sec",
        "0",
        "--save-detailed",
        "--disable-tqdm",
    ]


def run_client_pass(
    shape: RepetitionShape, base_url: str, model: str, log_path: Path
) -> list[ClientRequest]:
    """Send the dataset to one engine with vLLM's client and return each request's outcome.

    Raises ``RuntimeError`` when the client returns no per-request results."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(client_arguments(shape, base_url, model))
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with (
        log_path.open("a") as log,
        contextlib.redirect_stdout(log),
        contextlib.redirect_stderr(log),
    ):
        result = main(args)
    return requests_of(result)


def requests_of(result: dict[str, Any]) -> list[ClientRequest]:
    """Per-request outcomes from the client's detailed result (``--save-detailed``)."""
    ttfts = result.get("ttfts")
    if not ttfts:
        raise RuntimeError("vllm.benchmarks.serve returned no per-request results")
    out = []
    for i, ttft in enumerate(ttfts):
        error = result["errors"][i] or ""
        out.append(
            ClientRequest(
                index=i,
                ttft_s=math.nan if error else float(ttft),
                latency_s=math.nan if error else float(result["latencies"][i]),
                prompt_tokens=int(result["input_lens"][i]),
                text=result["generated_texts"][i] or "",
                error=error[:300],
                sent_at=float(result["start_times"][i]),
            )
        )
    return out
