#!/usr/bin/env bash
# The GPU check, for a machine with a CUDA device, torch and CuPy (no downloads, no
# vLLM; under 5 minutes): the `gpu` tests, the copy micro-benchmark, and, where a
# redis-server is found (see below), loads through staging with copies per window.
# Results go to stdout, and to $OUT/ when OUT is set (the device tool's output folder).
# Usage: scripts/gpu_check.sh   (PYTHON=... to pick the interpreter holding torch)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
DEST="${OUT:-$(mktemp -d)}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
"$PY" - <<'PYEOF'
import sys
import torch
if not torch.cuda.is_available():
    sys.exit("gpu_check: torch sees no CUDA device")
import cupy
print(f"gpu_check: {torch.cuda.get_device_name()}, torch {torch.__version__}, cupy {cupy.__version__}")
PYEOF
nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current \
  --format=csv 2>/dev/null || true
set +e
timeout 240 "$PY" -m pytest -p no:cacheprovider -o addopts="" -q -rs -m gpu \
  tests/test_gpu_copy.py 2>&1 | tee "$DEST/gpu_tests.log"
tests_rc=${PIPESTATUS[0]}
timeout 180 "$PY" -m umbp_redis.bench.gpu_copy --json "$DEST/gpu_copy_bench.json" 2>&1 \
  | tee "$DEST/gpu_copy_bench.log"
bench_rc=${PIPESTATUS[0]}
set -e
# Loads through staging with a copy per window as values arrive (issue 17 part 1) need a
# redis-server: on PATH, named by UMBP_REDIS_SERVER, or carried in .device-carry/ (made
# by scripts/carry_redis_server.sh; the device tool's carry: [".device-carry"]).
if [ -z "${UMBP_REDIS_SERVER:-}" ] && ! command -v redis-server >/dev/null 2>&1 \
   && [ -x "$ROOT/.device-carry/redis-server" ]; then
  export UMBP_REDIS_SERVER="$ROOT/.device-carry/redis-server"
fi
if [ -n "${UMBP_REDIS_SERVER:-}" ] || command -v redis-server >/dev/null 2>&1; then
  timeout 150 "$PY" -m umbp_redis.bench.staged_load --json "$DEST/staged_load_bench.json" 2>&1 \
    | tee "$DEST/staged_load_bench.log"
  staged_rc=${PIPESTATUS[0]}
else
  echo "gpu_check: staged load benchmark skipped: no redis-server (scripts/carry_redis_server.sh)"
  staged_rc=0
fi
echo "gpu_check: tests exit $tests_rc, benchmark exit $bench_rc, staged loads exit $staged_rc" \
  "(logs in $DEST)"
[ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ] && [ "$staged_rc" = 0 ]
