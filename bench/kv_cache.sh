#!/usr/bin/env bash
# The KV-cache figures of docs/kv-cache.md on the generated `small` model, 2 threads:
#  1. bench prefix: TTFT of an 8k-token prompt's follow-up (+5 %) cold, from RAM, from disk after a
#     restart, and of a 95 % hit (pread and io_uring readers);
#  2. a multi-turn chat workload through `bench serve --dataset multiturn` with the cache off, the
#     RAM tier alone (whole pool, then a 64 MiB cap), and the 64 MiB RAM tier over the disk tier.
# Writes bench/results/DATE-zen5-small-{prefix-pread,prefix-uring,chat-*}.json.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-build/deepinfer}
DATE=${DATE:-$(date -u +%F)}
OUT=bench/results
MODEL=${MODEL:-$HOME/.cache/deepinfer/models/v41-small-seed0}  # made by `deepinfer bench --size small` on first use
DISK=${DISK:-/var/tmp/deepinfer-kv-bench}
if [ "${SKIP_PREFIX:-0}" != 1 ]; then  # also generates the small model
  "$BIN" bench prefix --size small -t 2 --cache-dir "$DISK" -o "$OUT/$DATE-zen5-small-prefix-pread.json"
  "$BIN" bench prefix --size small -t 2 --cache-dir "$DISK" --cache-io-uring -o "$OUT/$DATE-zen5-small-prefix-uring.json"
fi
CHAT=(--in-process "$MODEL" --dataset multiturn --conversations "${CONVERSATIONS:-20}" --turns 8 --system-len 256
      --turn-len 64 --output-len 32 --max-concurrency 8 --threads 2 --cache-mib 2048 --no-progress)
"$BIN" bench serve "${CHAT[@]}" --no-prefix-cache --json "$OUT/$DATE-zen5-small-chat-off.json"
"$BIN" bench serve "${CHAT[@]}" --json "$OUT/$DATE-zen5-small-chat-ram.json"
"$BIN" bench serve "${CHAT[@]}" --cache-ram-gib 0.015625 --json "$OUT/$DATE-zen5-small-chat-ram16m.json"
"$BIN" bench serve "${CHAT[@]}" --cache-ram-gib 0.015625 --cache-dir "$DISK" --json "$OUT/$DATE-zen5-small-chat-ram16m-disk.json"
