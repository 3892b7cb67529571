"""MLX's TCP ring backend."""

from __future__ import annotations

import json

from ...errors import UserError
from .. import gpus
from ..hostfile import host_ip
from .base import Backend, Job, Processes, RankSpec, free_ports
from .registry import register


@register
class Ring(Backend):
    """MLX's TCP ring. One node: ``127.0.0.1`` and free ports. Several: each
    host's ``ips`` (else its resolved name), ports from ``$MLXCEL_RING_PORT``
    counting up. Every rank gets ``MLX_RANK`` and ``MLX_HOSTFILE`` (a JSON
    list with one ``["ip:port", ...]`` list per rank); on one host with CUDA
    GPUs, ``CUDA_VISIBLE_DEVICES`` too (its own GPU while there are enough:
    cluster/gpus.py)."""

    name = "ring"
    auto_order = 40
    port_var = "MLXCEL_RING_PORT"
    default_port = 32323
    identity_vars = ("MLX_RANK", "MLX_HOSTFILE")
    logs_peer_loss = True
    hint = (
        "every rank needs MLX_RANK and MLX_HOSTFILE (a JSON list with one "
        '["ip:port"] list per rank) and all ranks must reach each other; '
        "start the job with `mlxcel_dist.cluster.launcher.launch` rather than by hand"
    )

    def addresses(self, job: Job) -> list[list[str]]:
        """Rank r's ``ip:port`` list: what ``MLX_HOSTFILE`` holds."""
        if job.single_node:
            return [[f"127.0.0.1:{p}"] for p in free_ports(job.np)]
        port = self.fixed_port()
        nodes = []
        for h in job.placement:
            assert h is not None
            addrs = []
            for ip in (h.ips or [host_ip(h)]):
                addrs.append(f"{ip}:{port}")
                port += 1
            nodes.append(addrs)
        if len({len(n) for n in nodes}) != 1:
            raise UserError("ring: every host needs the same number of ips in the hostfile")
        return nodes

    def rank_specs(self, job: Job) -> list[RankSpec]:
        specs = super().rank_specs(job)
        if job.np == 1:
            return specs  # a singleton group needs no hostfile
        ring_json = json.dumps(self.addresses(job))
        host = gpus.host_gpus(job.env) if job.single_node else []
        for s in specs:
            s.files["MLX_HOSTFILE"] = ring_json
            if host:
                s.env["CUDA_VISIBLE_DEVICES"] = gpus.device(s.rank, host)
        return specs

    def _plan(self, job: Job) -> Processes:
        specs = self.rank_specs(job)
        plan = Processes(specs)
        ring_json = specs[0].files.get("MLX_HOSTFILE")
        if ring_json is None:
            return plan
        plan.notes.append(f"ring hostfile {ring_json}")
        if job.single_node:
            plan.warnings += filter(None, [gpus.sharing(job.np, gpus.host_gpus(job.env))])
            # The ring's last rank connects to rank 0 before anyone else
            # connects; if rank 0 is not listening yet MLX backs off for a
            # whole second. The launcher starts it once the others listen.
            plan.last_waits_for = [int(a.rsplit(":", 1)[1])
                                   for node in json.loads(ring_json)[:-1] for a in node]
        return plan
