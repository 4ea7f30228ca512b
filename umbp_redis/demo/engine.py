"""One vLLM engine of the CPU demo (run as ``python -m umbp_redis.demo.engine SPEC.json``).

vLLM spawns its workers, which re-import the main module, so the engine lives in its
own process behind ``if __name__ == "__main__"``.
"""

from __future__ import annotations

import json
import os
import sys
import time

BLOCK = 128  # vLLM 0.32's CPU block size
STORE_WAIT_S = 60.0


def _wait_for_markers(url: str, blocks: int) -> None:
    """Return once Redis holds at least ``blocks`` stored markers (the asynchronous
    stores of this engine's prompts have landed, so the next engine finds them), or
    after ``STORE_WAIT_S``; then a second more for stragglers."""
    import redis

    from umbp_redis.data.keys import is_marker_key, namespace_pattern

    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + STORE_WAIT_S
    while time.monotonic() < deadline:
        found = client.scan_iter(match=namespace_pattern(), count=1000)
        if sum(1 for k in found if is_marker_key(k)) >= blocks:
            break
        time.sleep(0.2)
    client.close()
    time.sleep(1.0)


def run(spec: dict) -> dict:  # type: ignore[type-arg]
    """Greedy outputs over the spec's ``conversations`` (through the model's chat
    template) or ``prompts``, all in one batch; returns the time to first token over
    the batch (the last request's, from vLLM's request metrics), prompt tokens, tokens
    hit in Redis, and each output's token ids and text."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    llm = LLM(
        model=spec["model"],
        max_model_len=spec["max_model_len"],
        dtype="bfloat16",
        enforce_eager=True,
        seed=0,
        disable_log_stats=False,  # the requests' metrics: their time to first token
        kv_transfer_config=KVTransferConfig(**spec["connector"]),
    )
    params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0)
    t0 = time.perf_counter()
    if "conversations" in spec:
        outs = llm.chat(spec["conversations"], params, use_tqdm=False)
    else:
        outs = llm.generate(spec["prompts"], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    ttfts = [o.metrics.first_token_latency for o in outs if o.metrics is not None]
    prompt_tokens = [len(o.prompt_token_ids or []) for o in outs]
    url = spec["connector"]["kv_connector_extra_config"]["redis_url"]
    _wait_for_markers(url, sum((n - 1) // BLOCK for n in prompt_tokens))
    return {
        # Without request metrics, the whole batch's time (first token and the rest).
        "ttft_s": max(ttfts) if len(ttfts) == len(outs) else wall,
        "prompt_tokens": prompt_tokens,
        # Distinct prompts in one batch share no block: every hit is one from Redis.
        "redis_hit_tokens": [o.num_cached_tokens for o in outs],
        "outputs": [list(o.outputs[0].token_ids) for o in outs],
        "texts": [o.outputs[0].text for o in outs],
    }


if __name__ == "__main__":
    spec = json.load(open(sys.argv[1]))
    result = run(spec)
    json.dump(result, open(spec["out"], "w"))
