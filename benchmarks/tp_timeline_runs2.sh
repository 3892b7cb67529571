#!/usr/bin/env bash
# Second device call of docs/benchmarks-log.md's "np 2 timeline" section: the
# agreement check off / as before / device-resident (guard_ab), with CUDA
# graphs on and off, and the host-array stall probe.
set -u
O=${OUT:-/tmp/tp}
mkdir -p "$O"
T() { local lim=$1; shift; timeout "$lim" python3 benchmarks/tp_timeline.py --out-dir "$O" "$@" 2>&1 | grep -v "^\s*$" | tail -4; }
T 170 --np 2 --backend nccl --guard-ab --rounds 6 --tag np2-guard
MLX_USE_CUDA_GRAPHS=0 T 150 --np 2 --backend nccl --guard-ab --rounds 3 --tag np2-guard-nographs
T 110 --np 2 --backend nccl --quick --rounds 2 --tag np2-new
ls -la "$O"
