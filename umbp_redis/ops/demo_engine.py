"""One vLLM engine of the CPU demo (run as ``python -m umbp_redis.ops.demo_engine SPEC.json``).

vLLM spawns its workers, which re-import the main module, so the engine lives in its
own process behind ``if __name__ == "__main__"``.
"""

from __future__ import annotations

import json
import os
import sys
import time


def run(spec: dict) -> dict:  # type: ignore[type-arg]
    """Time to first token over the prompts, then greedy outputs; returns the figures."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    llm = LLM(
        model=spec["model"],
        max_model_len=spec["max_model_len"],
        dtype="bfloat16",
        enforce_eager=True,
        seed=0,
        kv_transfer_config=KVTransferConfig(**spec["connector"]),
    )
    prompts = spec["prompts"]
    t0 = time.perf_counter()
    first = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    ttft = time.perf_counter() - t0
    time.sleep(1.0)  # let the asynchronous stores land before the next engine looks
    llm.reset_prefix_cache()
    outs = llm.generate(
        prompts, SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0), use_tqdm=False
    )
    time.sleep(1.0)
    return {
        "ttft_s": ttft,
        "prompt_tokens": [len(o.prompt_token_ids or []) for o in first],
        "redis_hit_tokens": [o.num_cached_tokens for o in first],
        "outputs": [list(o.outputs[0].token_ids) for o in outs],
    }


if __name__ == "__main__":
    spec = json.load(open(sys.argv[1]))
    result = run(spec)
    json.dump(result, open(spec["out"], "w"))
