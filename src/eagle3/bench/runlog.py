"""A job's MLflow child run: its settings as params, its measurements as metrics, or its failure.

mlflow is imported inside log_job: with tracking.enabled=false nothing needs it (eagle3.core.tracking)."""

from __future__ import annotations

from eagle3.bench.baseline import baseline_of
from eagle3.bench.provenance import PROVENANCE
from eagle3.bench.verdict import ACCEPTS_NOTHING, accepts_nothing, against_off
from eagle3.core.config import BenchConfig

LOG_EXCERPT_LINES = 40


# settings of a job, logged as params (MLflow compares runs on them); measurements are metrics
JOB_PARAMS = ("engine", "spec", "depth", "steps", "topk", "batch_size", "max_new_tokens", "suite")
NOT_METRICS = frozenset((*JOB_PARAMS, "repeats", "spec_enabled", "baseline_reused", "temperature"))


def job_params(bench: BenchConfig, target_name: str, result: dict) -> dict:
    """What a job ran: its shape, load and suite, the target, drafter, hardware, engine version."""
    params = {k: result.get(k) for k in JOB_PARAMS}
    params.update(
        target=target_name,
        drafter=result.get("drafter_hash"),
        **{k: result.get(k) for k in PROVENANCE},
        repeats=bench.repeats,
    )
    return {k: "" if v is None else str(v) for k, v in params.items()}


def job_metrics(result: dict) -> dict:
    """The numbers a job measured (per-position acceptance as accept_pos_i)."""
    numbers = {
        k: float(v)
        for k, v in result.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in NOT_METRICS
    }
    numbers.update({f"accept_pos_{i}": p for i, p in enumerate(result.get("accept_per_pos", []))})
    return numbers


def log_job(bench: BenchConfig, target_name: str, result: dict) -> None:
    """Settings as params, measurements as metrics (tok/s per pass as steps of tokens_per_s_pass),
    or the failure, on the active child run."""
    import mlflow

    mlflow.set_tag("status", result["status"])
    mlflow.log_params({f"job.{k}": v for k, v in job_params(bench, target_name, result).items()})
    if result["status"] != "ok":
        mlflow.set_tag("error", result["error"][:5000])
        mlflow.log_text(
            f"{result['error']}\n\n--- engine log (last {LOG_EXCERPT_LINES} lines) ---\n"
            f"{result.get('log_tail', '')}\n",
            "failure.txt",
        )
        mlflow.end_run(status="FAILED")
        return
    mlflow.set_tag("vs_spec_off", against_off(result, baseline_of(result)))
    if accepts_nothing(result, float(bench.accepts_nothing_tau)):
        mlflow.set_tag("acceptance", ACCEPTS_NOTHING)
    if result.get("baseline_run_id"):
        mlflow.set_tag("baseline_run_id", result["baseline_run_id"])
    mlflow.log_metrics(job_metrics(result))
    for step, value in enumerate(result.get("tokens_per_s_runs", [])):
        mlflow.log_metric("tokens_per_s_pass", value, step=step)
    mlflow.log_dict(result, "bench_result.json")
