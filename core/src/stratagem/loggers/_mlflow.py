"""``mlflow``: one MLflow run per ``fit``, through ``mlflow.MlflowClient`` (``pip install "stratagem[mlflow]"``)."""

from __future__ import annotations

import re
import time
from typing import Any

from stratagem.hookspecs import hookimpl
from stratagem.loggers._logger_base import RankZeroLogger

# MLflow keys allow letters, digits, and _ - . space /.
_BAD_KEY_CHARS = re.compile(r"[^\w\-. /]")
_MAX_PARAM_VALUE = 6000


def _key(name: str) -> str:
    return _BAD_KEY_CHARS.sub("_", name)


class MLflowLogger(RankZeroLogger):
    """Log to an MLflow tracking server or store.

    :param tracking_uri: e.g. ``"sqlite:///mlflow.db"`` or ``"http://host:5000"``; default: MLflow's own
        (``MLFLOW_TRACKING_URI`` or its local default).
    :param experiment_name: created if it does not exist.
    :param run_name: the run's display name.

    The run id goes into checkpoints: a resumed ``fit`` continues the same run.
    """

    def __init__(
        self, tracking_uri: str | None = None, experiment_name: str = "stratagem", run_name: str | None = None
    ) -> None:
        super().__init__()
        self.tracking_uri = tracking_uri
        self.experiment_name = experiment_name
        self.run_name = run_name
        self.run_id: str | None = None
        self._client: Any = None

    def start(self, trainer: Any, params: dict[str, Any]) -> None:
        from mlflow import MlflowClient
        from mlflow.entities import Param

        self._client = client = MlflowClient(tracking_uri=self.tracking_uri)
        if self.run_id is not None and trainer.ckpt_path is not None:
            client.update_run(self.run_id, status="RUNNING")
            return  # the run's parameters were recorded when it began
        experiment = client.get_experiment_by_name(self.experiment_name)
        experiment_id = (
            experiment.experiment_id
            if experiment is not None
            else client.create_experiment(self.experiment_name)
        )
        self.run_id = client.create_run(experiment_id, run_name=self.run_name).info.run_id
        entries = [Param(_key(k), str(v)[:_MAX_PARAM_VALUE]) for k, v in sorted(params.items())]
        for i in range(0, len(entries), 100):  # MLflow takes at most 100 params per batch
            client.log_batch(self.run_id, params=entries[i : i + 100])

    def write(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        entries = [Metric(_key(k), float(v), now, step) for k, v in metrics.items()]
        self._client.log_batch(self.run_id, metrics=entries)

    def close(self, failed: bool) -> None:
        if self._client is not None and self.run_id is not None:
            self._client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")

    @hookimpl
    def on_save_checkpoint(self, state: dict[str, Any]) -> None:
        if self.run_id is not None:
            state["run_id"] = self.run_id

    @hookimpl
    def on_load_checkpoint(self, state: dict[str, Any]) -> None:
        self.run_id = state.get("run_id", self.run_id)
