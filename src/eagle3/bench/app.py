"""`python -m eagle3.bench`: deploy target + drafter with the job's `spec`, warm up, run the prompt
suite, measure, log one MLflow run. `-m spec.depth=16,10` sweeps: one parent run per sweep (the
Hydra callback in eagle3.bench.sweep), one child run per job, a summary table, plots and cost model
at the end. Speedup is against the same engine with spec=off, measured once per (engine, target,
suite, batch size, max tokens) and cached like a stage artifact (eagle3.bench.baseline).
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode

from eagle3.bench import sweep
from eagle3.bench.baseline import BASELINE_KEYS, BaselineIdentity, baseline, off_spread
from eagle3.bench.checks import (
    bench_requests,
    check_drafter_fits,
    check_engine_supports,
    job_spec,
)
from eagle3.bench.engines import open_engine
from eagle3.bench.measurement import measure
from eagle3.bench.outputcheck import check_output_settings, compare_outputs, output_check_line
from eagle3.bench.provenance import drafter_hash, provenance
from eagle3.bench.runlog import log_job
from eagle3.bench.verdict import speedup_fields
from eagle3.core.common import Eagle3Error, app, log
from eagle3.core.config import BenchConfig, Config, ServeConfig, SpecConfig, TargetConfig
from eagle3.core.redact import mask_text
from eagle3.core.spec import OFF, Spec, resolve_spec
from eagle3.core.target import Target, load_target
from eagle3.core.tracking import stage_run
from eagle3.data.suites import suite_name
from eagle3.serve.drafter import drafter_for
from eagle3.serve.launch import EngineSetup, engine_setup

RESULT_FILE = "bench_result.json"


def job_identity(
    bench: BenchConfig, serve: ServeConfig, target: TargetConfig, spec: SpecConfig
) -> dict:
    """What a job varied: shown in the summary even when the job failed before measuring."""
    ident = {
        "engine": serve.engine,
        "target": target.name,
        "suite": suite_name(bench),
        "batch_size": bench.batch_size,
        "max_new_tokens": bench.max_new_tokens,
        "spec": "invalid",
        "depth": spec.depth,
        "steps": spec.steps,
        "topk": spec.topk,
        "spec_enabled": bool(spec.enabled),
    }
    try:
        resolved = resolve_spec(spec)
        ident.update(
            spec=resolved.label, depth=resolved.depth, steps=resolved.steps, topk=resolved.topk
        )
    except Eagle3Error:
        pass
    return ident


@dataclass(frozen=True)
class BenchJob:
    """One job as measuring it reads it: the bench settings, the spec asked for (job_spec checks
    it), the artifacts root the target is prepared under, how its engines start, and the config's
    lookups bound once: the drafter for a spec (drafter_for: drafter.path, the shipped drafter or
    the config's export, found by a hash over several sections) and the target loaded (the output
    check, serve=hf in process)."""

    bench: BenchConfig
    spec: SpecConfig
    artifacts: str
    engines: EngineSetup
    drafter_for: Callable[[Spec], Path | None]
    load_target: Callable[[], Target]


def measure_job(job: BenchJob, folder: Path, scope: str | None = None) -> dict:
    """Validate, find drafter and prompts, measure (baseline first), compute speedup. The
    baseline is shared by the jobs of one `scope` (a sweep folder; a lone job's own folder)."""
    bench, setup = job.bench, job.engines
    serve, target, engine_name = setup.serve, setup.target, setup.serve.engine
    check_output_settings(bench, engine_name)
    spec = job_spec(job.spec, serve)
    target_path, requests = bench_requests(bench, serve, setup.engine, target, job.artifacts)
    check_engine_supports(engine_name, target, target_path)
    drafter_path = job.drafter_for(spec)
    check_drafter_fits(target, engine_name, drafter_path, target_path)
    opener = functools.partial(open_engine, setup, job.load_target, target_path)
    measure_with = functools.partial(measure, opener, bench, engine_name, requests)
    identity = BaselineIdentity(serve, bench, target, job.artifacts)
    measure_off = functools.partial(measure_with, OFF, None)
    base = baseline(identity, measure_off, folder, str(scope or folder))
    metrics = (
        measure_with(spec, drafter_path, folder / "spec", off_spread(base))
        if spec.enabled
        else {k: v for k, v in base.items() if not k.startswith("baseline_")}
    )
    metrics.update(against_baseline(metrics, base))
    metrics.update(
        drafter=str(drafter_path) if drafter_path else None, drafter_hash=drafter_hash(drafter_path)
    )
    outputs = metrics.pop("outputs", None)
    if bench.check_outputs:
        check = compare_outputs(requests, base.get("outputs") or [], outputs or [], job.load_target)
        (folder / "output_check.json").write_text(json.dumps(check, indent=1))
        metrics.update(check)
        log.info("%s", output_check_line(spec.label, check))
    return metrics


def against_baseline(metrics: dict, base: dict) -> dict:
    """The spec=off measurement a job carries (baseline_<key>, its run and reuse) and the speedup."""
    fields = {f"baseline_{k}": base.get(k) for k in BASELINE_KEYS}
    fields.update({k: v for k, v in base.items() if k.startswith("baseline_")})
    fields.update(speedup_fields(metrics, base))
    return fields


def bench_job(cfg: Config) -> BenchJob:
    """The job a config measures, its lookups bound: the engine setup, the drafter by drafter.path
    or the config's export hash, the target loaded only when asked for."""
    return BenchJob(
        cfg.bench,
        cfg.spec,
        cfg.paths.artifacts,
        engine_setup(cfg),
        functools.partial(drafter_for, cfg),
        functools.partial(load_target, cfg.target, cfg.paths.artifacts),
    )


def run_job(
    cfg: Config, folder: Path, parent_run_id: str | None = None, sweep_dir: Path | None = None
) -> dict:
    """One job, never raising for an engine or spec failure: the result says ok or failed."""
    folder.mkdir(parents=True, exist_ok=True)
    result = {**job_identity(cfg.bench, cfg.serve, cfg.target, cfg.spec), "folder": str(folder)}
    name = f"{result['engine']}-{result['spec']}-bs{result['batch_size']}"
    with stage_run(
        cfg,
        "bench",
        run_name=name,
        parent_run_id=parent_run_id,
        tags={"engine": result["engine"], "spec": result["spec"]},
    ) as run:
        try:
            result.update(measure_job(bench_job(cfg), folder, sweep_dir), status="ok")
            result.update(provenance(cfg.serve, cfg.target, cfg.bench))
        except (Eagle3Error, OSError, httpx.HTTPError) as err:
            result.update(
                status="failed",
                error=mask_text(f"{type(err).__name__}: {err}"),
                log_tail=getattr(err, "log_tail", ""),
            )
            log.error("bench job %s failed: %s", name, err)
        if run is not None:
            result["run_id"] = run.info.run_id
            log_job(cfg.bench, cfg.target.name, result)
    (folder / RESULT_FILE).write_text(json.dumps(result, indent=1, default=str))
    return result


def job_value(result: dict) -> float:
    """A job's score for a search (search=shapes): its median tok/s, 0 when it failed."""
    return float(result["tokens_per_s"]) if result.get("status") == "ok" else 0.0


# ---------------------------------------------------------------- the app


@app
def main(cfg: Config) -> float | None:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request in the job log
    hydra_cfg = HydraConfig.get()
    folder = Path(hydra_cfg.runtime.output_dir)
    # settings, prompts and context, checked before any run or engine: one error line, and in a
    # sweep the first job stops it (every job would fail the same way); a lone job's spec first,
    # before the target is prepared (in a sweep a spec one engine cannot run fails that job only)
    if hydra_cfg.mode != RunMode.MULTIRUN:
        job_spec(cfg.spec, cfg.serve)
    bench_requests(cfg.bench, cfg.serve, cfg.engine, cfg.target, cfg.paths.artifacts)
    if hydra_cfg.mode == RunMode.MULTIRUN:
        sweep_dir = Path(hydra_cfg.sweep.dir)
        log.info(sweep.progress_line(sweep_dir))
        result = run_job(cfg, folder, sweep.parent_run_id(sweep_dir), sweep_dir)
        return job_value(result)  # the score a search ranks jobs by (search=shapes)
    result = run_job(cfg, folder)
    sweep.summarize(cfg.bench, [result], folder)
    if result["status"] != "ok":
        raise Eagle3Error(f"bench job failed: {result['error']}")


if __name__ == "__main__":
    main()
