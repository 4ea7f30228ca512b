#!/usr/bin/env bash
# Packs this machine's redis-server with every shared library it loads (and the dynamic
# loader) into .device-carry/ (git-ignored), for a machine without Redis and without
# network, such as the lent GPU machine: pass ".device-carry" in the device tool's
# `carry`; scripts/gpu_check.sh then finds .device-carry/redis-server, a wrapper that
# runs the binary with its own loader and libraries (nothing of the host's is mixed in).
# Usage: scripts/carry_redis_server.sh
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SRC="${UMBP_REDIS_SERVER:-$(command -v redis-server)}"
OUT="$ROOT/.device-carry"
rm -rf "$OUT"
mkdir -p "$OUT/lib"
cp -L "$SRC" "$OUT/lib/redis-server.bin"
loader=""
while read -r lib; do
  cp -L "$lib" "$OUT/lib/"
  case "$lib" in */ld-linux*) loader="$(basename "$lib")" ;; esac
done < <(ldd "$SRC" | grep -o '/[^ ]*' | sort -u)
[ -n "$loader" ] || { echo "carry_redis_server: no dynamic loader in ldd output" >&2; exit 1; }
cat > "$OUT/redis-server" <<WRAP
#!/bin/sh
d="\$(cd "\$(dirname "\$0")" && pwd)/lib"
exec "\$d/$loader" --library-path "\$d" "\$d/redis-server.bin" "\$@"
WRAP
chmod +x "$OUT/redis-server"
"$OUT/redis-server" --version
du -sh "$OUT"
