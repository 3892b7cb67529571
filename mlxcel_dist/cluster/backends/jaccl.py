"""The JACCL backend (RDMA over Thunderbolt 5)."""

from __future__ import annotations

import json

from ...errors import UserError
from ..hostfile import HostfileInfo
from .base import Backend, Job, RankSpec
from .registry import register


@register
class Jaccl(Backend):
    """RDMA over Thunderbolt 5 (macOS 26.2+): an MLX JSON hostfile with one
    host per rank, each with an ``rdma`` list (a device name per peer, null
    for itself); ``MLX_IBV_DEVICES`` (that matrix, as a file) and
    ``MLX_JACCL_COORDINATOR`` (the first host's first ip,
    ``$MLXCEL_JACCL_PORT``). Auto picks it on several hosts when every host
    lists ``rdma`` devices."""

    name = "jaccl"
    auto_order = 20
    port_var = "MLXCEL_JACCL_PORT"
    default_port = 32323
    identity_vars = ("MLX_RANK",)
    logs_peer_loss = True
    hint = (
        "needs macOS 26.2+ with RDMA over Thunderbolt 5 enabled, and MLX_RANK, "
        "MLX_IBV_DEVICES, MLX_JACCL_COORDINATOR on every rank"
    )

    def suits(self, single_node: bool, info: HostfileInfo | None) -> bool:
        return (not single_node and info is not None and info.format == "json"
                and all(h.rdma for h in info.hosts))

    def rank_specs(self, job: Job) -> list[RankSpec]:
        info = job.info
        if info is None or info.format != "json":
            raise UserError("jaccl needs an MLX JSON hostfile listing each host's rdma devices")
        hosts = info.hosts
        if job.np != len(hosts) or any(h.slots != 1 for h in hosts):
            raise UserError("jaccl runs exactly one rank per hostfile host")
        for i, h in enumerate(hosts):
            if not h.rdma or len(h.rdma) != len(hosts) or h.rdma[i] is not None:
                raise UserError(
                    f"hostfile {info.path}: host {h.name!r} needs an \"rdma\" list with one "
                    f"entry per host and null for itself"
                )
        if not hosts[0].ips:
            raise UserError(f"hostfile {info.path}: jaccl needs \"ips\" for the first host")
        specs = super().rank_specs(job)
        coordinator = f"{hosts[0].ips[0]}:{self.fixed_port()}"
        devices = json.dumps([h.rdma for h in hosts])
        for s in specs:
            s.env["MLX_JACCL_COORDINATOR"] = coordinator
            s.files["MLX_IBV_DEVICES"] = devices
        return specs
