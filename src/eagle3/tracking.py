"""MLflow helpers shared by all apps: one run per stage (or sweep job), config as params + YAML.

mlflow is imported inside the functions: with tracking.enabled=false nothing needs it
(the GPU machines run stages without it)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from eagle3.artifacts import git_commit

MAX_PARAM_CHARS = 500  # MLflow rejects longer param values; the full YAML is an artifact


def setup(cfg: DictConfig) -> str:
    """Point MLflow at the configured store and experiment; return the experiment id."""
    import mlflow

    uri = cfg.tracking.uri
    if uri.startswith("sqlite:///"):
        Path(uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    mlflow.set_tracking_uri(uri)
    name = cfg.tracking.experiment
    experiment = mlflow.get_experiment_by_name(name)
    if experiment is not None:
        experiment_id = experiment.experiment_id
    else:
        location = cfg.tracking.get("artifact_location")
        # A local store keeps artifacts beside it; a server decides for itself.
        location = (
            Path(location).resolve().as_uri() if location and not uri.startswith("http") else None
        )
        experiment_id = mlflow.create_experiment(name, artifact_location=location)
    mlflow.set_experiment(experiment_id=experiment_id)
    return experiment_id


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """{'a': {'b': 1}} -> {'a.b': 1}; lists stay values."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        flat.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def log_config(cfg: DictConfig) -> None:
    import mlflow

    plain = OmegaConf.to_container(cfg, resolve=True)
    params = {k: str(v)[:MAX_PARAM_CHARS] for k, v in flatten(plain).items()}
    mlflow.log_params(params)
    mlflow.log_text(OmegaConf.to_yaml(cfg, resolve=True), "config.yaml")


@contextlib.contextmanager
def stage_run(
    cfg: DictConfig,
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

    setup(cfg)
    all_tags = {"stage": stage, "git_commit": git_commit() or "unknown", **(tags or {})}
    if artifact_hash:
        all_tags["artifact_hash"] = artifact_hash
    if parent_run_id:
        all_tags["mlflow.parentRunId"] = parent_run_id
    with mlflow.start_run(run_name=run_name or stage, tags=all_tags) as run:
        log_config(cfg)
        yield run


def client(cfg: DictConfig):
    from mlflow.tracking import MlflowClient

    setup(cfg)
    return MlflowClient(tracking_uri=cfg.tracking.uri)
