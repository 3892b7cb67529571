#!/usr/bin/env bash
# Device runs of issue 42 (and issue 39's quiet-CPU goals), one part per device call, each inside the
# 10-minute limit, after MLX's CUDA wheel is staged (`source .dev/setup.sh`; the serving wheels and
# llguidance in .dev/wheels, mlx-lm's source on PYTHONPATH for the comparisons):
#
#   [STEP_LOG=1 PROF=1 SWITCH_MS=x BIG_VOCAB=1|spread] bash benchmarks/h200_issue42.sh json [CLIENTS] [REQUESTS] [PAIRS]  # json_schema / text at 1,16,64
#                                          # clients (2 requests a client, 2 pairs of rounds), 12B gemma3 bf16, serve --np 1
#   bash benchmarks/h200_issue42.sh spec   # benchmarks/spec_7b.py: the 7.5B / 4-layer draft pair, prompt lookup
#   bash benchmarks/h200_issue42.sh fam    # issue 39: decode per family (llama 11.3B, gemma3 12B) against mlx-lm,
#                                          # through the one engine's row (gpu_compare.py --families)
#   bash benchmarks/h200_issue42.sh pp     # issue 41: one stream np 1 vs pp 2 (pp_gpu.py, 4B gemma3 shape);
#   bash benchmarks/h200_issue42.sh ppfloor # issue 41: pp_floor.py, the same in MLX calls only (rounds interleaved)
#   bash benchmarks/h200_issue42.sh ppserve #  serve np 1 / pp 2 / pp 2 before (.dev/prev) / pp 2 micro 2 at 1, 16 clients
#   bash benchmarks/h200_issue42.sh floor  # issue 42 in MLX calls only: drafts' bound (draft_floor.py), 4-bit MoE
#                                          # decode's spread in 3 fresh processes (moe_spread.py)
#   bash benchmarks/h200_issue42.sh drafts [ALPHA] [REPS] [spec_7b flags: --check --prompt-per-rep] # issue 42: spec_7b.py --parts --mlx-only: our engine's
#                                          # steps and rounds beside draft_floor.py's MLX-only loop on the same pair
#   bash benchmarks/h200_issue42.sh moeprefill [FAMILY] [TOKENS] [PROMPT] [LIMIT_S] [REPS] [FRESH] # 4-bit MoE prefill per expert form by
#                                          # length (moe_decode.py --forms), then generate at PROMPT tokens vs mlx-lm
#   bash benchmarks/h200_issue42.sh moekernels [PROMPT] # the kernels each expert form compiles (one MoE block)
#   [LIMIT=S] bash benchmarks/h200_issue42.sh moefirst [PROMPT] [IMPLS] # a 4-bit qwen3_moe's first / second run against
#                                          # mlx-lm (moe_first_run.py; IMPLS e.g. ours,ours-gathered,mlx-lm)
#   [VS=.dev/base LONG=1 SERVERS=ours-np1,ours-np2] bash benchmarks/h200_issue42.sh stall [TOKENS] [ROUNDS] [LENGTHS]
#          # issue 39: streams beside a long prompt, 12B gemma3 (VS: an older tree's server too; LONG: the long
#          # prompt's max_tokens; SERVERS: ours-np2 on nvidia-h200-x2, the launcher's backend there)
#   bash benchmarks/h200_issue42.sh mixed [PROMPT] [BUDGETS] [ROUNDS] # issue 39: mixed steps in process, flat vs apart
#   bash benchmarks/h200_issue42.sh maskup [LAYERS] # issue 42 in MLX calls only: a host-made grammar mask's cost to
#                                          # a pipelined step (mask_upload.py: plain / masks on the device / from numpy)
#   bash benchmarks/h200_issue42.sh cpu    # the host's CPU pinned to 2 cores (MLX's CPU wheel from .dev/cpu):
#                                          # bench np 1 / np 2 against aff0c91 (.dev/base), serve at 8 clients
#                                          # against aff0c91 and mlx_lm.server
# Output and JSON land in $OUT.
set -u
O=${OUT:-/tmp/h200}
mkdir -p "$O"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
case "${1:-}" in
maskup)
  timeout 540 python3 benchmarks/mask_upload.py --layers "${2:-200}" --steps 300 --reps 3 --json 2>&1 \
    | tee "$O/mask_upload.jsonl" | tail -16
  ;;
json)
  nvidia-smi --query-gpu=name,clocks.sm,memory.used --format=csv,noheader
  python3 - <<'EOF'
import sys, time
sys.path.insert(0, "benchmarks")
from gpu_compare import GEMMA3_12B
from random_ckpt import gemma3_checkpoint
t = time.perf_counter()
p = gemma3_checkpoint("/tmp/ckpt/gemma3-12b", **GEMMA3_12B)
print(f"checkpoint {p} ready in {time.perf_counter() - t:.0f} s", flush=True)
EOF
  # BIG_VOCAB=1: the same checkpoint with the embedded tokenizer grown to 262,144 tokens (big_vocab_masks.py),
  # so that json_schema's masks walk a trie of gemma3's size, not the embedded 512 tokens';
  # BIG_VOCAB=spread: grown and its ids shuffled, so a mask's allowed ids reach its last words as a real
  # tokenizer's do (the upload's full width; grown alone, this schema's masks stay within 16 words)
  CKPT=/tmp/ckpt/gemma3-12b
  if [ "${BIG_VOCAB:-0}" != 0 ]; then
    CKPT=/tmp/ckpt/gemma3-12b-bigvocab$([ "$BIG_VOCAB" = spread ] && echo -spread)
    python3 - "$CKPT" "$BIG_VOCAB" <<'EOF'
import sys
from pathlib import Path
sys.path.insert(0, "benchmarks")
from big_vocab_masks import grow
src, dst = Path("/tmp/ckpt/gemma3-12b"), Path(sys.argv[1])
dst.mkdir(parents=True, exist_ok=True)
for f in src.iterdir():
    if f.name != "tokenizer.json" and not (dst / f.name).exists():
        (dst / f.name).symlink_to(f)
if not (dst / "tokenizer.json").exists():
    grow(src / "tokenizer.json", 262144, dst, spread=sys.argv[2] == "spread")
print(f"{dst}: the tokenizer grown to 262144 tokens", flush=True)
EOF
  fi
  # pairs in ABBA order (text first, then json_schema first, ...): a server that slows over its life
  # (sessions 30-32) would otherwise always time json_schema on the slower side of its pair
  fmts=$(for i in $(seq "${4:-2}"); do [ $((i % 2)) = 1 ] && printf "text,json_schema," || printf "json_schema,text,"; done)
  # STEP_LOG=1: the server logs each admitting step and its 15 s interval lines (kept in $O/json42-server.log.gz)
  # PROF=1: the server sampled by py-spy (staged in .dev/wheels) for 15 s every minute, prof1.txt .. (raw),
  # the first and last side by side (pyspy_top.py): what grows in its CPU time a token over its life
  # SWITCH_MS=x: every process of the run starts with the GIL switch interval at x ms (a sitecustomize; 5.1
  # holds the interval near Python's 5 ms, which the grammar worker would otherwise lower to 0.5 ms)
  if [ -n "${SWITCH_MS:-}" ]; then
    mkdir -p /tmp/switch && echo "import sys; sys.setswitchinterval(${SWITCH_MS} / 1e3)" > /tmp/switch/sitecustomize.py
    export PYTHONPATH=/tmp/switch:$PYTHONPATH
  fi
  if [ "${PROF:-0}" = 1 ]; then
    spy=$(ls /tmp/site/bin/py-spy 2>/dev/null || command -v py-spy)
    ( sleep 20; for i in 1 2 3 4 5 6 7 8; do
        pid=$(pgrep -f "mlxcel_dist.cli serve" | head -1)
        [ -n "$pid" ] && "$spy" record --nonblocking --pid "$pid" -d 15 -f raw -o "$O/prof$i.txt" >/dev/null 2>&1
        sleep 45; done ) &
  fi
  MLXCEL_DIST_STEP_LOG=${STEP_LOG:-0} timeout 520 python3 benchmarks/serve_load.py --model "$CKPT" \
    --servers ours-np1 --clients "${2:-1,16,64}" --requests "${3:-2}" --tokens 64 --formats "${fmts%,}" \
    --json "$O/json42.json" 2>&1 | tee "$O/json42.log" | grep -v "^\s*$" | tail -40
  gzip -c "$(ls -td /tmp/serve-load-*/ | head -1)ours-np1.log" > "$O/json42-server.log.gz"
  # the interval lines' host parts a step, text intervals against json_schema ones (STEP_LOG=1)
  [ "${STEP_LOG:-0}" = 1 ] && python3 benchmarks/step_log_parts.py "$O/json42-server.log.gz"
  if [ "${PROF:-0}" = 1 ]; then
    profs=$(ls "$O"/prof*.txt 2>/dev/null | sort -V)
    [ -n "$profs" ] && python3 benchmarks/pyspy_top.py $(echo "$profs" | head -1) $(echo "$profs" | tail -1) --top 40
  fi
  ;;
fam)
  nvidia-smi --query-gpu=name,clocks.sm,memory.used --format=csv,noheader
  timeout 560 python3 benchmarks/gpu_compare.py --families llama,gemma3 --prompt 2048 --gen 128 --repeat 3 \
    --out "$O/fam39.jsonl" 2>&1 | tee "$O/fam39.log" | cut -c1-300 | tail -40
  ;;
pp)
  timeout 560 python3 benchmarks/pp_gpu.py --rounds 2 --configs np1 pp2-send --handoff-iters 0 \
    --ckpt /tmp/ckpt/g4b 2>&1 | tee "$O/pp41.log" | cut -c1-300 | tail -30
  ;;
ppfloor)  # [ROUNDS]
  for r in $(seq "${2:-2}"); do
    for st in "" "--stage 0" "--stage 1"; do timeout 120 python3 benchmarks/pp_floor.py one $st; done
    for b in ids logits; do
      timeout 150 python3 -c "from mlx._distributed_utils.launch import main; main()" -n 2 --backend ring \
        python3 benchmarks/pp_floor.py pp --hand-back $b
    done
  done 2>&1 | tee "$O/ppfloor41.jsonl"
  ;;
ppserve)  # [SERVERS] [SECONDS]
  [ -d /tmp/ckpt/g4b ] || python3 benchmarks/pp_gpu.py --rounds 0 --configs np1 --handoff-iters 0 --ckpt /tmp/ckpt/g4b
  timeout "${3:-570}" python3 benchmarks/serve_load.py --model /tmp/ckpt/g4b --backend ring --clients 1,16 \
    --requests 2 --tokens 64 --servers "${2:-ours-np1,ours-pp2,ours-pp2@.dev/prev,ours-pp2-micro2}" \
    --json "$O/ppserve41.json" 2>&1 | tee "$O/ppserve41.log" | grep -v "^\s*$" | tail -30
  for f in /tmp/serve-load-*/*.log; do cp "$f" "$O/$(basename "$(dirname "$f")")-$(basename "$f")"; done
  ;;
floor)  # issue 42: what MLX itself allows, nothing of ours
  nvidia-smi --query-gpu=name,clocks.sm,memory.used --format=csv,noheader
  timeout 240 python3 benchmarks/draft_floor.py --reps 3 2>&1 | tee "$O/draftfloor42.jsonl"
  for p in 1 2 3; do timeout 110 python3 benchmarks/moe_spread.py --reps 4 "${@:2}"; done 2>&1 | tee "$O/moespread42.jsonl"
  ;;
drafts)  # issue 42: our rounds and draft_floor.py's MLX-calls-only loop on one pair (spec_7b.py --mlx-only)
  nvidia-smi --query-gpu=name,clocks.sm,memory.used --format=csv,noheader
  timeout 540 python3 benchmarks/spec_7b.py --no-mlx-lm --pair-only --parts --mlx-only --alphas "${2:-0.03}" \
    --reps "${3:-3}" "${@:4}" --json "$O/spec7b_pair.jsonl" 2>&1 | cut -c1-500
  ;;
moeprefill)  # issue 42: where quantized experts' grouped prefill overtakes the gathered one, and end to end
  nvidia-smi --query-gpu=name,clocks.sm,memory.used --format=csv,noheader
  timeout "${5:-540}" python3 benchmarks/moe_decode.py --family "${2:-qwen3_moe}" \
    --prefill-tokens "${3:-128,192,256,384,512,768,1024,2048}" --forms "gather,grouped,by rows" \
    --prompt "${4:-1024}" --gen 32 --reps "${6:-3}" --impls "mlx-lm,ours split" --fresh "${7:-0}" \
    --out "$O/moeprefill_${2:-qwen3_moe}.jsonl"
  ;;
moekernels)  # issue 42: the kernels each expert form compiles for one MoE block of a PROMPT-token prompt
  python3 benchmarks/moe_first_run.py build /tmp/ckpt/qwen3moe-4bit 2>&1 | tail -1
  timeout 400 python3 benchmarks/moe_first_run.py kernels /tmp/ckpt/qwen3moe-4bit --prompt "${2:-4096}" --json "$O/moekernels42.jsonl"
  ;;
moefirst)  # issue 42: a 4-bit qwen3_moe's first and second run, ours and mlx-lm, each with empty kernel caches
  t=$(date +%s); python3 benchmarks/moe_first_run.py build /tmp/ckpt/qwen3moe-4bit 2>&1 | tail -3
  echo "built in $(( $(date +%s) - t )) s"
  timeout "${LIMIT:-480}" python3 benchmarks/moe_first_run.py all /tmp/ckpt/qwen3moe-4bit --runs 2 --json "$O/moefirst42.jsonl" \
    --prompt "${2:-128}" --impls "${3:-ours,mlx-lm}"
  ;;
stall)  # issue 39: streams beside a long prompt on one GPU (12B gemma3 bf16, serve --np 1)
  python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from gpu_compare import GEMMA3_12B; \
from random_ckpt import gemma3_checkpoint; gemma3_checkpoint('/tmp/ckpt/gemma3-12b', **GEMMA3_12B)"
  # VS=<an older checkout of ours> runs its server too, interleaved; LONG=<n>: the long prompt's max_tokens;
  # the lengths go through one server in turn: the later ones read a server that has met the shapes
  MLXCEL_DIST_STEP_LOG=1 timeout "${LIMIT:-500}" python3 benchmarks/serve_stall.py --model /tmp/ckpt/gemma3-12b \
    --servers "${SERVERS:-ours-np1}" --stream-tokens "${2:-400}" --settle 10 --rounds "${3:-2}" --lengths "${4:-1500,4000}" --verbose \
    ${VS:+--vs "$VS"} --long-tokens "${LONG:-1}" --alone-runs 2 --json "$O/stall39.json" 2>&1 | tee "$O/stall39.log" | tail -30
  for f in /tmp/serve_stall_logs/*.log; do cp "$f" "$O/stall39-server-$(basename "$f")"; done
  ;;
mixed)  # issue 39: the engine's steps beside a long prompt, in process: flat (one forward) vs apart (12B gemma3)
  python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from gpu_compare import GEMMA3_12B; \
from random_ckpt import gemma3_checkpoint; gemma3_checkpoint('/tmp/ckpt/gemma3-12b', **GEMMA3_12B)"
  timeout "${LIMIT:-400}" python3 benchmarks/mixed_step.py --model /tmp/ckpt/gemma3-12b --prompt "${2:-1500}" \
    --budgets "${3:-64,256,1024}" --rounds "${4:-2}" 2>&1 | tee "$O/mixed39.jsonl" | tail -20
  ;;
spec)
  timeout 560 python3 benchmarks/spec_7b.py --json "$O/spec7b.jsonl" 2>&1 | tee "$O/spec7b.log" | cut -c1-400
  ;;
cpu)
  mkdir -p /tmp/sitecpu && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/sitecpu .dev/cpu/*.whl
  export PYTHONPATH=/tmp/sitecpu${PYTHONPATH:+:$PYTHONPATH}
  python3 -c "import mlx.core as mx; print(mx.default_device())"
  taskset -c 0,1 timeout 250 python3 benchmarks/bench_vs.py --vs .dev/base --shape cpu --prompt 128 --gen 48 \
    --rounds 3 2>&1 | tee "$O/cpu_np1.log"
  taskset -c 0,1 timeout 250 python3 benchmarks/bench_vs.py --vs .dev/base --shape cpu --prompt 128 --gen 48 \
    --rounds 3 --np 2 --backend ring 2>&1 | tee "$O/cpu_np2.log"
  ;;
serve8)
  mkdir -p /tmp/sitecpu && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/sitecpu .dev/cpu/*.whl
  export PYTHONPATH=/tmp/sitecpu${PYTHONPATH:+:$PYTHONPATH}
  taskset -c 0,1 timeout 400 python3 benchmarks/serve_load.py --servers ours-np1,ours-np1@.dev/base,mlx_lm-np1 \
    --clients 8 --requests 2 --json "$O/serve8.json" 2>&1 | tee "$O/serve8.log" | grep -v "^\s*$" | tail -30
  ;;
*) echo "usage: $0 json|fam|pp|ppfloor|ppserve|floor|drafts|moeprefill|moefirst|stall|mixed|spec|cpu|serve8"; exit 2 ;;
esac
