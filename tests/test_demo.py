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


def test_demo_runs_cold_then_warm(tiny_model: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "umbp_redis.ops.cli",
            "demo",
            "--prompts",
            "2",
            "--prompt-words",
            "600",
            "--model-dir",
            str(tiny_model),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "started a private Redis server" in out
    assert _row(out, "outputs equal (cold vs warm)") == "yes"
    assert _row(out, "tokens hit in Redis (cold)") == "0, 0"
    prompt_tokens = [int(x) for x in _row(out, "prompt tokens").split(", ")]
    hits = [int(x) for x in _row(out, "tokens hit in Redis (warm)").split(", ")]
    assert hits == [(n - 1) // 128 * 128 for n in prompt_tokens]
    blocks = sum((n - 1) // 128 for n in prompt_tokens)
    assert int(_row(out, "values stored")) == int(_row(out, "stored markers")) == blocks
    assert float(_row(out, "time to first token, warm (s)")) > 0


def test_blocks_only_demo() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "umbp_redis.ops.cli", "demo", "--blocks-only"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and "caches byte-identical        yes" in proc.stdout
