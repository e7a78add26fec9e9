"""``elastic``: torch's elastic agent, on this node (and, through a rendezvous, on others)."""

from __future__ import annotations

from typing import Any

from stratagem.hookspecs import hookimpl
from stratagem.launchers import _preemption_signals, _worker_start
from stratagem.launchers._job import LaunchJob
from stratagem.launchers.launcher import Launcher


class ElasticLauncher(Launcher):
    """Workers started, watched and restarted by torch's elastic agent (``torch.distributed.launcher``)."""

    @hookimpl
    def launch_workers(self, job: LaunchJob) -> dict[int, Any]:
        common = dict(
            nproc_per_node=job.nproc_per_node,
            accelerator=job.accelerator,
            nnodes=job.nnodes,
            node_rank=job.node_rank,
            rdzv_endpoint=job.rdzv_endpoint,
            # The agent passes the preemption signals on to the workers (see launchers/_preemption_signals.py).
            env={
                **job.env,
                **_preemption_signals.launcher_env(job.preemption_signals, job.preemption_grace_s),
            },
            max_restarts=job.max_restarts,
        )
        if job.kind == "script":
            _worker_start.launch_script(list(job.command), rdzv_configs=dict(job.rdzv_configs), **common)
            return {}
        assert job.function is not None
        return _worker_start.launch_function(job.function, tuple(job.args), **common)
