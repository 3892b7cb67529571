"""Which CUDA GPU each rank of a job on one host uses.

The ring, mpi and nccl backends give each rank of a one-host job its own GPU
where the host has NVIDIA GPUs (`CUDA_VISIBLE_DEVICES`, the rank's index on the host modulo
the GPUs there): NCCL needs one a rank, and ring or MPI ranks (the pipeline's
send/recv hand-off, which NCCL lacks) would otherwise all run on GPU 0. Ranks
beyond the GPUs share them, which `sharing` says at launch: two ranks on one
GPU take turns on it, and a hand-off between them goes through the CPU
(docs/benchmarks.md, "Pipeline stages on one H200": 0.37-0.48x of --np 1).

The processes' backends (ring, nccl) set each rank's variable; under mpirun,
one command for every rank, the launcher exports the list (`VAR`) and each
rank picks its own from Open MPI's local rank before anything imports MLX
(`place`, run by the rank bootstrap). Imports nothing beyond the standard
library (the bootstrap runs it first).
"""

from __future__ import annotations

import os

VAR = "MLXCEL_DIST_GPUS"  # the host's GPUs, as CUDA_VISIBLE_DEVICES names them, for `place`
LOCAL_RANK_VARS = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "MV2_COMM_WORLD_LOCAL_RANK")
PROC = "/proc/driver/nvidia/gpus"  # one entry per NVIDIA GPU the driver sees (Linux)


def host_gpus(env=None) -> list[str]:
    """This host's GPUs as CUDA_VISIBLE_DEVICES names them: the launcher's own
    CUDA_VISIBLE_DEVICES when set (its order kept), else an index per GPU the
    NVIDIA driver lists; [] on a host without one (a Mac, a CPU box)."""
    env = os.environ if env is None else env
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d.strip() for d in visible.split(",") if d.strip()]
    try:
        return [str(i) for i in range(len(os.listdir(PROC)))]
    except OSError:
        return []


def device(local: int, gpus: list[str]) -> str:
    """The GPU of the rank with index `local` on its host."""
    return gpus[local % len(gpus)]


def sharing(n: int, gpus: list[str]) -> str | None:
    """A line for the launch when n ranks on this host must share its GPUs, else None."""
    if not gpus or n <= len(gpus):
        return None
    return (f"note: {n} ranks share this host's {len(gpus)} GPU(s) (CUDA_VISIBLE_DEVICES {','.join(gpus)}): "
            f"ranks on one GPU take turns on it and hand on through the CPU, slower than fewer ranks "
            f"(docs/benchmarks.md, \"Pipeline stages on one H200\")")


def place(env=None) -> None:
    """Rank side, under mpirun: this rank's GPU from the exported list and its
    local rank, before MLX is imported (nothing where either is missing: a
    host without GPUs, a rank another launcher started)."""
    env = os.environ if env is None else env
    gpus = [d for d in env.get(VAR, "").split(",") if d]
    local = next((env[v] for v in LOCAL_RANK_VARS if v in env), None)
    if gpus and local is not None and local.isdigit():
        env["CUDA_VISIBLE_DEVICES"] = device(int(local), gpus)
