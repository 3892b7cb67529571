#!/usr/bin/env bash
# The device runs of docs/benchmarks-log.md's "np 2 timeline" section, one call on
# nvidia-h200-x2 (after MLX's CUDA wheel is staged: source .dev/setup2.sh).
# At most 8 JSON files land in $OUT (the device tool's limit).
set -u
O=${OUT:-/tmp/tp}
mkdir -p "$O"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv,noheader
T() { local lim=$1; shift; timeout "$lim" python3 benchmarks/tp_timeline.py --out-dir "$O" "$@" 2>&1 | grep -v "^\s*$" | tail -4; }
T 150 --np 1 --tag np1
T 190 --np 2 --backend nccl --tag np2
MLX_USE_CUDA_GRAPHS=0 T 85 --np 2 --backend nccl --quick --tag np2-nographs
MLX_MAX_OPS_PER_BUFFER=200 T 85 --np 2 --backend nccl --quick --tag np2-ops200
MLX_USE_CUDA_GRAPHS=0 T 70 --np 1 --quick --tag np1-nographs
ls -la "$O"
