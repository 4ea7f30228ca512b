"""The README's first command: the CPU demo, cold and warm engines on a private Redis."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm


def _row(out: str, label: str) -> str:
    line = next(ln for ln in out.splitlines() if ln.startswith(label))
    return line[len(label) :].strip()


def test_demo_runs_cold_then_warm(real_model: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "umbp_redis.cli",
            "demo",
            "--prompts",
            "2",
            "--prompt-words",
            "300",
            "--model-dir",
            str(real_model),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "started a private Redis server" in out
    assert _row(out, "model") == "SmolLM2-135M-Instruct (bf16)"
    assert _row(out, "outputs equal (cold vs warm)") == "yes"
    assert _row(out, "tokens hit in Redis (cold)") == "0, 0"
    prompt_tokens = [int(x) for x in _row(out, "prompt tokens").split(", ")]
    hits = [int(x) for x in _row(out, "tokens hit in Redis (warm)").split(", ")]
    assert hits == [(n - 1) // 128 * 128 for n in prompt_tokens] and min(hits) > 0
    blocks = sum((n - 1) // 128 for n in prompt_tokens)
    assert int(_row(out, "values stored")) == int(_row(out, "stored markers")) == blocks
    # 30 layers x (K, V) x 3 KV heads x 64 x 128 tokens x 2 bytes (bf16)
    assert _row(out, "bytes per block (128 tokens)") == f"{30 * 2 * 3 * 64 * 128 * 2:,}"
    assert float(_row(out, "time to first token, warm (s)")) > 0
    # The real text, cold and warm, shown for each question.
    cold = [ln.strip() for ln in out.splitlines() if ln.strip().startswith("cold: ")]
    warm = [ln.strip() for ln in out.splitlines() if ln.strip().startswith("warm: ")]
    assert len(cold) == len(warm) == 2
    assert [c[len("cold: ") :] for c in cold] == [w[len("warm: ") :] for w in warm]
    assert all(len(c) > len('cold: ""') for c in cold)


def test_blocks_only_demo() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "umbp_redis.cli", "demo", "--blocks-only"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and "caches byte-identical        yes" in proc.stdout
