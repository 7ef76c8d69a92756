"""MLflow tracking of a training run, from the orchestrator (the runner), not the ranks: one
MLflow run per Frenzy run however many attempts, fallbacks or re-sizes it takes. The run's folder
records its MLflow run (``mlflow-run.json``): a segment after a re-size or a preemption (the
same folder) goes on logging into it (the plan each segment starts on as a
``frenzy.segment.<n>.plan`` tag; steps re-run after resuming from a checkpoint are logged again,
at their later time). A resubmission is a new run in a folder of its own: a new MLflow run.

What is logged: the job's fields and the starting plan with its memory and step-time
predictions as parameters (``job.*``, ``plan.*``), the model's parameter counts and the
optimizer implementation; per optimizer step ``loss``, ``lr``, ``step_time_s`` and
``tokens_per_s``; ``eval_loss`` at every evaluation; at the end the measured step time,
throughput and memory peaks (``measured.*``), the status, the final plan and the export folder
(tags ``frenzy.*``).

Where: ``tracking.uri`` of the job, else the ``FrenzySettings`` block's ``mlflow_tracking_uri``
(the flows copy it into the job), else ``MLFLOW_TRACKING_URI``, else a SQLite store under
FRENZY_HOME (``sqlite:///<FRENZY_HOME>/mlflow.db``, artifacts in ``<FRENZY_HOME>/mlflow-artifacts``):
``mlflow ui --backend-store-uri <that uri>`` shows it. Uses ``MlflowClient`` (no global active
run: several trainings may share one Prefect worker process). Metric writes are batched.
"""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from estimator.errors import FrenzyInputError
from estimator.home import frenzy_home
from estimator.job import TrainingJob
from estimator.plan import Plan

# Metric writes are sent at most this often (a tiny model steps every few ms; each write is a
# database transaction or an HTTP request)
FLUSH_INTERVAL_S = 2.0
_MLFLOW_STATUS = {"completed": "FINISHED", "stopped": "KILLED", "failed": "FAILED", "timeout": "FAILED"}
# MLflow's limit on one parameter value (characters)
_PARAM_MAX = 6000
# in the run's folder: the MLflow run its segments log into
RUN_FILE = "mlflow-run.json"


def default_uri() -> str:
    return f"sqlite:///{(frenzy_home() / 'mlflow.db').resolve()}"


# MLflow's tracking stores: a folder (no scheme, or file:), its database stores (sqlite, and
# SQLAlchemy's postgresql / mysql / mssql, with a +driver), a tracking server (http / https) and
# Databricks; anything else fails only when the run starts
TRACKING_SCHEMES = ("", "file", "sqlite", "postgresql", "mysql", "mssql", "http", "https", "databricks",
                    "databricks-uc", "uc")


def check_tracking_uri(uri: str) -> None:
    """One line naming ``tracking.uri`` when its scheme is no MLflow tracking store."""
    from urllib.parse import urlparse

    scheme = urlparse(uri).scheme.split("+")[0].lower()
    if scheme not in TRACKING_SCHEMES:
        raise FrenzyInputError("tracking.uri", f"{uri!r}: {scheme}:// is not an MLflow tracking store (a folder, "
                                               f"file:, sqlite:, postgresql:, mysql:, mssql:, http(s): or databricks)")


def tracking_uri(job: TrainingJob) -> str:
    return job.tracking.uri or os.environ.get("MLFLOW_TRACKING_URI") or default_uri()


def with_tracking_default(job: TrainingJob, site: Any) -> TrainingJob:
    """``job`` with the settings block's MLflow URL where the job names none."""
    uri = getattr(site, "mlflow_tracking_uri", None) if site is not None else None
    if not uri or job.tracking.uri:
        return job
    return job.model_copy(update={"tracking": job.tracking.model_copy(update={"uri": uri})})


def flatten(prefix: str, value: Any, out: dict[str, str]) -> dict[str, str]:
    """Nested dicts as dotted keys; lists and scalars as their JSON text."""
    if isinstance(value, dict):
        for k, v in value.items():
            flatten(f"{prefix}.{k}" if prefix else str(k), v, out)
    else:
        text = value if isinstance(value, str) else json.dumps(value)
        out[prefix] = text[:_PARAM_MAX]
    return out


def run_url(uri: str, experiment_id: str, run_id: str) -> str | None:
    """The MLflow UI page of the run when the store is a tracking server (http/https)."""
    if uri.startswith(("http://", "https://")):
        return f"{uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"
    return None


class Tracker:
    """One MLflow run. Errors after the start are reported through ``log`` and never stop the
    training (a flaky tracking server must not cost a run)."""

    def __init__(self, job: TrainingJob, plan: Plan, run_dir: Path, log) -> None:
        self.uri = tracking_uri(job)
        self.log = log
        self._lock = threading.Lock()
        self._metrics: list[Any] = []
        self._last_flush = time.monotonic()
        self._logged_params: set[str] = set()
        try:
            from mlflow.tracking import MlflowClient

            self.client = MlflowClient(tracking_uri=self.uri)
            exp = self.client.get_experiment_by_name(job.tracking.experiment)
            if exp is not None:
                self.experiment_id = exp.experiment_id
            else:
                art = None
                if self.uri.startswith("sqlite:///") and self.uri == default_uri():
                    art = (frenzy_home() / "mlflow-artifacts").resolve().as_uri()
                self.experiment_id = self.client.create_experiment(job.tracking.experiment, artifact_location=art)
            earlier = self._earlier_run(Path(run_dir))
            if earlier is not None:
                run = earlier
                self.client.update_run(run.info.run_id, status="RUNNING")
            else:
                run = self.client.create_run(self.experiment_id, run_name=job.name,
                                             tags={"frenzy.run_dir": str(run_dir), "frenzy.job_name": job.name})
        except Exception as e:
            raise FrenzyInputError("tracking.uri", f"cannot start an MLflow run at {self.uri} "
                                                   f"({type(e).__name__}: {' '.join(str(e).split())[:200]})") from None
        self.run_id = run.info.run_id
        # params are immutable in MLflow: a continued run keeps its first segment's (the job and
        # the plan it started on); each segment's own plan is a tag
        self._logged_params.update(run.data.params)
        segment = int(run.data.tags.get("frenzy.segments", "0")) + 1
        self._guard("tag the segment", self.client.log_batch, self.run_id, tags=_tags(
            {"frenzy.segments": str(segment), f"frenzy.segment.{segment}.plan": plan.short()}))
        params = flatten("job", job.model_dump(mode="json", exclude={"tracking"}), {})
        flatten("plan", plan.model_dump(mode="json"), params)
        self.log_params(params)
        try:
            (Path(run_dir) / RUN_FILE).write_text(json.dumps(
                {"tracking_uri": self.uri, "experiment_id": self.experiment_id, "run_id": self.run_id}))
        except OSError as e:        # the next segment then starts a run of its own
            self.log(f"frenzy: could not record the MLflow run in {run_dir} ({e}); training goes on")

    def _earlier_run(self, run_dir: Path):
        """The MLflow run an earlier segment of this run logged into, when it is in this store
        and experiment and was not deleted; else None."""
        try:
            rec = json.loads((run_dir / RUN_FILE).read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(rec, dict) or rec.get("tracking_uri") != self.uri or \
                rec.get("experiment_id") != self.experiment_id:
            return None
        try:
            run = self.client.get_run(str(rec.get("run_id")))
        except Exception:           # gone from the store (or never there): a new run
            return None
        return run if run.info.lifecycle_stage == "active" else None

    @property
    def url(self) -> str | None:
        return run_url(self.uri, self.experiment_id, self.run_id)

    def _guard(self, what: str, fn, *args, **kw) -> None:
        try:
            fn(*args, **kw)
        except Exception as e:
            self.log(f"frenzy: MLflow {what} failed ({type(e).__name__}: {str(e)[:200]}); training goes on")

    def log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        new = {k: str(v)[:_PARAM_MAX] for k, v in params.items() if k not in self._logged_params}
        if not new:
            return
        self._logged_params.update(new)
        items = [Param(k, v) for k, v in new.items()]
        for i in range(0, len(items), 100):          # MLflow takes at most 100 params per batch
            self._guard("log params", self.client.log_batch, self.run_id, params=items[i:i + 100])

    def metric(self, key: str, value: float, step: int) -> None:
        from mlflow.entities import Metric

        with self._lock:
            self._metrics.append(Metric(key, float(value), int(time.time() * 1000), int(step)))
            due = time.monotonic() - self._last_flush >= FLUSH_INTERVAL_S
        if due:
            self.flush()

    def flush(self) -> None:
        with self._lock:
            batch, self._metrics = self._metrics, []
            self._last_flush = time.monotonic()
        for i in range(0, len(batch), 1000):         # MLflow takes at most 1000 metrics per batch
            self._guard("log metrics", self.client.log_batch, self.run_id, metrics=batch[i:i + 1000])

    def on_line(self, tag: str, payload: dict[str, Any]) -> None:
        """The training program's marker lines (see trainer.train)."""
        if tag == "FRENZY_STEP":
            step = int(payload["step"])
            self.metric("loss", payload["loss"], step)
            for key in ("lr", "grad_norm"):
                if payload.get(key) is not None:
                    self.metric(key, payload[key], step)
            dt = float(payload.get("step_time_s") or 0.0)
            if dt > 0:
                self.metric("step_time_s", dt, step)
                self.metric("tokens_per_s", float(payload.get("tokens", 0)) / dt, step)
        elif tag == "FRENZY_EVAL":
            self.metric("eval_loss", payload["loss"], int(payload["step"]))
        elif tag == "FRENZY_MODEL":
            self.log_params({"model.params": payload.get("params"),
                             "model.trainable_params": payload.get("trainable_params"),
                             "optimizer_impl": payload.get("optimizer_impl")})

    def finish(self, status: str, *, measured: dict[str, Any], final_plan: Plan, export_dir: str | None,
               steps: int) -> None:
        self.flush()
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(f"measured.{k}", float(v), now, steps) for k, v in measured.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool)]
        tags = _tags({"frenzy.status": status, "frenzy.final_plan": final_plan.short(),
                      "frenzy.memory_measured": str(bool(measured.get("memory_measured"))),
                      **({"frenzy.export_dir": export_dir} if export_dir else {})})
        self._guard("log the summary", self.client.log_batch, self.run_id, metrics=metrics, tags=tags)
        self._guard("end the run", self.client.set_terminated, self.run_id, _MLFLOW_STATUS.get(status, "FAILED"))


def _tags(values: dict[str, str]) -> list:
    from mlflow.entities import RunTag

    return [RunTag(k, v) for k, v in values.items()]
