"""MLflow helpers shared by all apps: one run per stage (or sweep job), config as params + YAML.

mlflow is imported inside the functions: with tracking.enabled=false nothing needs it
(the GPU machines run stages without it)."""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from eagle3.core.artifacts import git_commit
from eagle3.core.config import Config, TrackingConfig
from eagle3.core.lifecycle import Stopped, process_alive, process_identity, watch_runs
from eagle3.core.redact import masked_config

KIND_TAG = "mlflow.experimentKind"  # read by the MLflow 3 UI to pick the experiment's view
MAX_PARAM_CHARS = 500  # MLflow rejects longer param values; the full YAML is an artifact


@contextlib.contextmanager
def store_lock(uri: str) -> Iterator[None]:
    """An exclusive file lock beside a sqlite store (<db>.lock): the first process creates the
    tables and the experiment while the others wait (two at once race on the schema)."""
    if not uri.startswith("sqlite:///"):
        yield
        return
    db = Path(uri.removeprefix("sqlite:///"))
    db.parent.mkdir(parents=True, exist_ok=True)
    with open(db.with_name(db.name + ".lock"), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def setup(tracking: TrackingConfig) -> str:
    """Point MLflow at the configured store and experiment; return the experiment id."""
    with store_lock(tracking.uri):
        return _setup(tracking)


def _setup(tracking: TrackingConfig) -> str:
    import mlflow

    uri = tracking.uri
    mlflow.set_tracking_uri(uri)
    name = tracking.experiment
    experiment = mlflow.get_experiment_by_name(name)
    if experiment is not None:
        experiment_id = experiment.experiment_id
    else:
        location = tracking.artifact_location
        # A local store keeps artifacts beside it; a server decides for itself.
        location = (
            Path(location).resolve().as_uri() if location and not uri.startswith("http") else None
        )
        experiment_id = mlflow.create_experiment(name, artifact_location=location)
    set_experiment_kind(experiment_id, tracking.experiment_kind, experiment)
    mlflow.set_experiment(experiment_id=experiment_id)
    return experiment_id


def set_experiment_kind(experiment_id: str, kind: str | None, experiment=None) -> None:
    """Tag the experiment with the kind the MLflow UI opens it as (once; a user's choice stays)."""
    import mlflow

    if kind and not (experiment and KIND_TAG in experiment.tags):
        mlflow.MlflowClient().set_experiment_tag(experiment_id, KIND_TAG, kind)


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """{'a': {'b': 1}} -> {'a.b': 1}; lists stay values."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        flat.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def log_config(plain: dict) -> None:
    """A resolved config (secrets masked: eagle3.core.redact) as params and config.yaml."""
    import mlflow

    params = {k: str(v)[:MAX_PARAM_CHARS] for k, v in flatten(plain).items()}
    mlflow.log_params(params)
    mlflow.log_text(OmegaConf.to_yaml(OmegaConf.create(plain)), "config.yaml")


def end_dead_runs(uri: str, experiment_id: str) -> list[str]:
    """Runs left RUNNING by an eagle3 process of this host that no longer runs (killed outright)
    are marked KILLED; returns their ids."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    ended = []
    for run in client.search_runs([experiment_id], "attributes.status = 'RUNNING'"):
        if process_alive(run.data.tags) is False:
            client.set_tag(run.info.run_id, "killed", "its process ended without closing the run")
            client.set_terminated(run.info.run_id, "KILLED")
            ended.append(run.info.run_id)
    return ended


@contextlib.contextmanager
def stage_run(
    cfg: Config,
    stage: str,
    artifact_hash: str | None = None,
    run_name: str | None = None,
    parent_run_id: str | None = None,
    tags: dict | None = None,
) -> Iterator:
    """Open the MLflow run of one stage (or one sweep job, nested under parent_run_id)."""
    if not cfg.tracking.enabled:
        yield None
        return
    import mlflow

    experiment_id = setup(cfg.tracking)
    end_dead_runs(cfg.tracking.uri, experiment_id)
    watch_runs(cfg.tracking.uri, experiment_id, cfg.tracking.watchdog_poll_s)
    all_tags = {
        "stage": stage,
        "git_commit": git_commit() or "unknown",
        **process_identity(),
        **(tags or {}),
    }
    if artifact_hash:
        all_tags["artifact_hash"] = artifact_hash
    if parent_run_id:
        all_tags["mlflow.parentRunId"] = parent_run_id
    with mlflow.start_run(run_name=run_name or stage, tags=all_tags) as run:
        try:
            log_config(masked_config(cfg))
            yield run
        except (KeyboardInterrupt, Stopped):  # Ctrl-C, SIGTERM, SIGHUP
            mlflow.end_run("KILLED")
            raise


def client(tracking: TrackingConfig):
    from mlflow.tracking import MlflowClient

    setup(tracking)
    return MlflowClient(tracking_uri=tracking.uri)
