#!/usr/bin/env bash
# The device runs of docs/benchmarks-log.md's 2026-11-30 GPU sections (second to fourth looks),
# on nvidia-h200-x2 after MLX's CUDA wheel is staged (source .dev/setup2.sh).
# One part per device call (each well inside the 10-minute limit):
#
#   bash benchmarks/h200_runs.sh compare   # issue 19: per-family one-GPU decode/prefill vs mlx-lm; gather_mm forms
#   bash benchmarks/h200_runs.sh tp27      # issue 18: 27B-shaped np 1 / np 2 (CUDA graphs on, off), prefill profile
#   bash benchmarks/h200_runs.sh serve     # issue 17: 12B-shaped serve load, ours np 1 / np 2, mlx_lm.server np 1
#   bash benchmarks/h200_runs.sh match     # issue 18: logit-match --np 2 --backend nccl on the 12B-shaped checkpoint
#   bash benchmarks/h200_runs.sh batch     # issue 17: BatchEngine alone at 1/4/16 rows, np 1 / np 2 (retrace costs), then serve
#   bash benchmarks/h200_runs.sh graphs    # issue 17: --warmup and MLX_CUDA_GRAPH_CACHE_SIZE 400 / 2000, alternated
#   bash benchmarks/h200_runs.sh prof      # issue 19: one layer's prefill piece by piece vs mlx-lm (layer_profile.py),
#                                          # then llama / mistral end to end, 4 reps each
#   bash benchmarks/h200_runs.sh tail      # issue 19: prefill_tail.py (chunk / DecodeStep.start / first step), then
#                                          # issue 17: serve np 1 / np 2, graph cache 2000 (run while --warmup was
#                                          # briefly CUDA's default; ours-np1 and ours-np1-nowarmup are now alike)
#   bash benchmarks/h200_runs.sh serve25 [ORDER] [FIRST]  # the serve rebuild (serve/, FastAPI + uvicorn) vs 213fb50's
#                                          # stdlib server.py, 12B-shaped, np 1, alternated (ORDER "new old new old")
#
# JSON and logs land in $OUT (at most 8 files come back).
#
# Single-process runs pin CUDA_VISIBLE_DEVICES=0: on the two-GPU host they
# failed intermittently otherwise (cudaMemcpy ... invalid argument after an
# mlx-lm generation in the same process; docs/benchmarks-log.md). np 2 ranks get
# one GPU each from the launcher, so those runs leave it unset.
set -u
O=${OUT:-/tmp/h200}
mkdir -p "$O"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=index,name,clocks.sm,clocks.mem,memory.used --format=csv,noheader
CKPT=${CKPT:-/tmp/ckpt/gemma3-12b}

ckpt12b() {  # the 12B-shaped random bf16 checkpoint on disk (serve and match read it)
  python3 - "$CKPT" <<'EOF'
import sys, time
sys.path.insert(0, "benchmarks")
from gpu_compare import GEMMA3_12B
from random_ckpt import gemma3_checkpoint
t = time.perf_counter()
p = gemma3_checkpoint(sys.argv[1], **GEMMA3_12B)
print(f"checkpoint {p} ready in {time.perf_counter() - t:.0f} s", flush=True)
EOF
}

case "${1:-}" in
compare)
  export CUDA_VISIBLE_DEVICES=0
  timeout 90 python3 benchmarks/gather_check.py 2>&1 | tee "$O/gather_check.txt" | grep -E "OK=|max|error" | tail -30
  C() { timeout "$1" python3 benchmarks/gpu_compare.py --prompt 2048 --gen 128 --out "$O/compare.jsonl" "${@:2}" 2>&1 \
        | grep -v "^\s*$" | tail -25; }
  C 330 --families qwen3,mistral,llama,gemma3 --repeat 3
  C 100 --families gpt_oss --repeat 2
  C 100 --families gpt_oss --repeat 2 --gpt-oss-group-rows 64
  ;;
tp27)
  T() { local lim=$1; shift; timeout "$lim" python3 benchmarks/tp_timeline.py --out-dir "$O" --shape 27b "$@" 2>&1 \
        | grep -v "^\s*$" | tail -3; }
  CUDA_VISIBLE_DEVICES=0 T 170 --np 1 --quick --prefill-profile --steps 12 --tag np1
  T 180 --np 2 --backend nccl --quick --prefill-profile --steps 12 --tag np2
  MLX_USE_CUDA_GRAPHS=0 T 150 --np 2 --backend nccl --quick --steps 12 --tag np2-nographs
  ls -la "$O"
  ;;
serve)
  ckpt12b
  CUDA_VISIBLE_DEVICES=0 timeout 300 python3 benchmarks/serve_load.py --model "$CKPT" --clients 1,4,16 --requests 2 \
    --tokens 64 --servers ours-np1,mlx_lm-np1 --json "$O/serve_np1.json" 2>&1 | tail -12
  timeout 200 python3 benchmarks/serve_load.py --model "$CKPT" --clients 1,4,16 --requests 2 --tokens 64 \
    --servers ours-np2 --json "$O/serve_np2.json" 2>&1 | tail -6
  ;;
batch)
  ckpt12b
  CUDA_VISIBLE_DEVICES=0 timeout 150 python3 benchmarks/batch_engine.py "$CKPT" --rows 1,4,16 --steps 128 --json \
    2>&1 | tee "$O/batch_np1.jsonl" | tail -8
  timeout 180 python3 benchmarks/batch_engine.py "$CKPT" --rows 1,4,16 --steps 128 --np 2 --backend nccl --json \
    2>&1 | tee "$O/batch_np2.jsonl" | tail -8
  CUDA_VISIBLE_DEVICES=0 timeout 150 python3 benchmarks/serve_load.py --model "$CKPT" --clients 1,4,16 --requests 2 \
    --tokens 64 --servers ours-np1,mlx_lm-np1 --json "$O/serve_np1.json" 2>&1 | grep clients
  timeout 120 python3 benchmarks/serve_load.py --model "$CKPT" --clients 1,4,16 --requests 2 --tokens 64 \
    --servers ours-np2 --json "$O/serve_np2.json" 2>&1 | grep clients
  ;;
graphs)
  # the suspect behind --warmup's slowdown (docs/benchmarks-log.md): MLX CUDA's graph cache
  ckpt12b
  for size in 400 2000 400 2000; do
    echo "== MLX_CUDA_GRAPH_CACHE_SIZE=$size"
    MLX_CUDA_GRAPH_CACHE_SIZE=$size CUDA_VISIBLE_DEVICES=0 timeout 140 python3 benchmarks/serve_load.py \
      --model "$CKPT" --clients 1,16 --requests 3 --tokens 64 --servers ours-np1,ours-np1-warmup \
      --json "$O/graphs_$size.json" 2>&1 | grep clients
  done
  ;;
prof)
  export CUDA_VISIBLE_DEVICES=0
  for fam in llama qwen3; do  # every kernel of one warm layer, timed by Nsight Compute (no nsys on this host)
    timeout 150 ncu --metrics gpu__time_duration.sum --csv --log-file "$O/ncu_$fam.csv" \
      python3 benchmarks/layer_profile.py --family "$fam" --ncu 2>&1 | tail -3
    python3 benchmarks/layer_profile.py --parse "$O/ncu_$fam.csv" 2>&1 | head -60
  done
  for fam in llama mistral qwen3; do
    timeout 100 python3 benchmarks/layer_profile.py --family "$fam" --reps 5 --iters 10 2>&1 | tee -a "$O/layers.jsonl" \
      | cut -c1-200
  done
  timeout 300 python3 benchmarks/gpu_compare.py --prompt 2048 --gen 128 --out "$O/compare.jsonl" \
    --families llama,mistral --repeat 4 2>&1 | grep -E "summ|wall_s|failed" | cut -c1-600
  ;;
tail)
  for fam in llama mistral; do
    CUDA_VISIBLE_DEVICES=0 timeout 100 python3 benchmarks/prefill_tail.py --family "$fam" --reps 4 2>&1 \
      | tee -a "$O/tail.jsonl" | cut -c1-300
  done
  ckpt12b
  CUDA_VISIBLE_DEVICES=0 timeout 200 python3 benchmarks/serve_load.py --model "$CKPT" --clients 1,16 --requests 3 \
    --tokens 64 --servers ours-np1,ours-np1-nowarmup --json "$O/serve_defaults_np1.json" 2>&1 | grep clients
  timeout 150 python3 benchmarks/serve_load.py --model "$CKPT" --clients 1,16 --requests 3 --tokens 64 \
    --servers ours-np2 --json "$O/serve_defaults_np2.json" 2>&1 | grep clients
  grep -h -E "batch steps ready|rows a step" /tmp/serve-load-*/* 2>/dev/null | cut -c1-300 | tail -12
  ;;
serve25)
  # compares the serve rebuild (mlxcel_dist/serve/: FastAPI + uvicorn + pydantic) with 213fb50's stdlib
  # server.py on the same checkpoint: ours-np1, 1 / 4 / 16 clients, each tree serving its own code through its
  # own benchmarks/serve_load.py (run from the tree, so its package is first on the path). The old tree, made
  # here and carried to the device:
  #   mkdir -p .dev/old && git archive 213fb50 mlxcel_dist models benchmarks pyproject.toml | tar -x -C .dev/old
  # NEW (default: this checkout) may name another such tree, e.g. one commit's archive. ORDER and FIRST (the
  # first run's number) let the alternation go over two device calls on one warm machine; with UNTIL (epoch
  # seconds) set, a run that could not finish by then (150 s each) is left for the next call.
  ckpt12b
  export CUDA_VISIBLE_DEVICES=0
  NEW=$(cd "${NEW:-.}" && pwd) OLD=$(cd "${OLD:-.dev/old}" && pwd)
  n=${3:-1}
  for which in ${2:-new old new old}; do
    if [ -n "${UNTIL:-}" ] && [ $(($(date +%s) + 150)) -gt "$UNTIL" ]; then echo "== run $n ($which) and later: not run"; break; fi
    if [ "$which" = old ]; then dir=$OLD; else dir=$NEW; fi
    pp=$dir${PYTHONPATH:+:$PYTHONPATH}  # the tree's package ahead of any other on the path
    echo "== run $n: $which, $(cd "$dir" && PYTHONPATH=$pp python3 -c 'import mlxcel_dist; print(mlxcel_dist.__file__)')"
    (cd "$dir" && PYTHONPATH=$pp timeout 230 python3 benchmarks/serve_load.py --model "$CKPT" --clients 1,4,16 \
      --requests 2 --tokens 64 --servers ours-np1 --json "$O/serve25_${n}_$which.json") 2>&1 | grep -v "^\s*$" | tail -6
    log=$(ls -td /tmp/serve-load-* | head -1)/ours-np1.log  # the old server logs a 'serve: 127.0.0.1 "POST' line a request
    echo "   $(grep -c '^serve: 127.0.0.1 "POST' "$log") old-style request lines; server log's last lines:"
    grep -v "^\s*$" "$log" | tail -3 | cut -c1-300
    n=$((n + 1))
  done
  ;;
match)
  ckpt12b
  /usr/bin/time -v timeout 560 python3 -m mlxcel_dist.cli logit-match "$CKPT" --np 2 --backend nccl 2>&1 \
    | grep -v "^\s*$" | grep -v -E "^\s+(Average|Exit|Major|Minor|Voluntary|Involuntary|Swaps|File|Socket|Signals|Page|Percent|System|User)" \
    | tail -25
  ;;
*)
  echo "usage: $0 compare|tp27|serve|match|batch|graphs|prof|tail|serve25" >&2
  exit 2
  ;;
esac
