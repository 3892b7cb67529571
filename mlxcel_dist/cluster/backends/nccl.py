"""The NCCL backend (CUDA GPUs, one per rank)."""

from __future__ import annotations

import os

from ...errors import UserError
from .. import gpus
from .base import Backend, Job, RankSpec, free_ports
from .registry import register


def _cuda_available() -> bool:
    try:
        import mlx.core as mx

        return bool(mx.cuda.is_available())
    except Exception:  # noqa: BLE001 - no mlx or no cuda module: no CUDA
        return False


@register
class Nccl(Backend):
    """CUDA GPUs, one per rank: ``MLX_RANK``, ``MLX_WORLD_SIZE``,
    ``NCCL_HOST_IP``/``NCCL_PORT`` (rank 0's host; a free port on one node,
    ``$MLXCEL_NCCL_PORT`` across hosts) and ``CUDA_VISIBLE_DEVICES`` (the
    rank's index on its host, into the launcher's ``CUDA_VISIBLE_DEVICES``
    when set). Auto picks it whenever mlx sees CUDA."""

    name = "nccl"
    auto_order = 0
    point_to_point = False  # MLX 0.32's NCCL group: "Send not supported" (and no split)
    beats_hostfile = True
    real_at_one_rank = True
    port_var = "MLXCEL_NCCL_PORT"
    default_port = 12345
    identity_vars = ("MLX_RANK", "MLX_WORLD_SIZE")
    hint = (
        "needs a CUDA build of mlx (pip install 'mlx[cuda]') and MLX_RANK, "
        "MLX_WORLD_SIZE, NCCL_HOST_IP, NCCL_PORT on every rank"
    )

    def available(self, python: str | None = None) -> bool:
        return _cuda_available()

    def coordinator(self, job: Job) -> tuple[str, int]:
        """(NCCL_HOST_IP, NCCL_PORT): where rank 0 listens."""
        if job.single_node:
            return "127.0.0.1", free_ports(1)[0]
        first = job.placement[0]
        assert first is not None
        return first.address, self.fixed_port()

    def rank_specs(self, job: Job) -> list[RankSpec]:
        if job.single_node and not self.available(job.python):
            # Refused here, once: every rank would fail alike (one error line per rank).
            raise UserError("backend nccl: the mlx here has no CUDA backend or sees no GPU "
                            "(pip install 'mlx[cuda]' on a machine with NVIDIA GPUs)")
        specs = super().rank_specs(job)
        ip, port = self.coordinator(job)
        env = job.env or os.environ
        host = gpus.host_gpus(env)
        if job.single_node and host and job.np > len(host):
            raise UserError(f"backend nccl: {job.np} ranks need {job.np} GPUs and this host has {len(host)} "
                            f"(NCCL refuses two ranks on one GPU); run --backend ring, whose ranks share them")
        # every host's ranks by the launcher's CUDA_VISIBLE_DEVICES where set, else GPU i for local rank i
        visible = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d]
        local_index: dict[str, int] = {}
        for s in specs:
            h = job.placement[s.rank]
            key = h.name if h is not None else "localhost"
            i = local_index.get(key, 0)
            local_index[key] = i + 1
            s.env.update({
                "MLX_WORLD_SIZE": str(job.np),
                "NCCL_HOST_IP": ip,
                "NCCL_PORT": str(port),
                "CUDA_VISIBLE_DEVICES": gpus.device(i, visible) if visible else str(i),
            })
        return specs
