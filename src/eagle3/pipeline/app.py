"""`python -m eagle3.pipeline`: data -> extract -> train -> export -> bench, in order.

Each stage runs in-process through its module's `run(cfg)`, or, with pipeline.launcher set, as a
job of that launcher (`python -m eagle3.<stage> -m hydra/launcher=<it>`), and is a no-op when its
output folder is complete; the bench runs as the multirun a user would type
(`python -m eagle3.bench -m <pipeline.bench_sweep>`). `pipeline.dry_run=true` prints the plan
(each stage's machine, GPU memory per GPU, host memory per process, disk and time: eagle3.pipeline.plan)
and every command, validating each bench job's spec and engine command, and runs nothing; a
stage that does not fit is refused, in the dry run and before a run.
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser

from eagle3.core.artifacts import StageOutput
from eagle3.core.cluster import submission
from eagle3.core.common import Eagle3Error, app, compose, unique_suffix
from eagle3.core.config import Config
from eagle3.core.lifecycle import run_child
from eagle3.core.outputs import STAGE_OUTPUTS
from eagle3.core.spec import resolve_spec
from eagle3.core.target import download_hint, downloaded, resolve_target_path
from eagle3.data import app as data
from eagle3.data.regen import regen_engine_config
from eagle3.export import app as export
from eagle3.extract import app as extract
from eagle3.extract.vllm_capture import capture_launch, target_shape
from eagle3.pipeline.plan import (
    check_plans,
    check_process_fit,
    disk_line,
    disk_lines,
    stage_plans,
)
from eagle3.serve.launch import compose_launch
from eagle3.train import app as train

STAGE_RUNS = {"data": data.run, "extract": extract.run, "train": train.run, "export": export.run}


def planned_stages(cfg: Config) -> list[str]:
    no_shards = cfg.train.hidden_states in ("online", "engine")
    return [s for s in cfg.pipeline.stages if not (s == "extract" and no_shards)]


def stage_output(cfg: Config, stage: str) -> StageOutput:
    return STAGE_OUTPUTS[stage](cfg)


def user_overrides() -> list[str]:
    """The overrides the pipeline was started with (handed on to the bench)."""
    return [o for o in HydraConfig.get().overrides.task if not o.startswith("pipeline.")]


def bench_jobs(cfg: Config) -> list[list[str]]:
    """The bench sweep expanded exactly as Hydra's basic sweeper will: one override list per job,
    the cartesian product of the sweep values in the order they were given."""
    parsed = OverridesParser.create().parse_overrides(list(cfg.pipeline.bench_sweep))
    choices = []
    for override in parsed:
        key = override.get_key_element()
        values = (
            list(override.sweep_string_iterator())
            if override.is_sweep_override()
            else [override.get_value_element_as_str()]
        )
        choices.append([f"{key}={value}" for value in values])
    return [list(job) for job in itertools.product(*choices)]


def launcher_overrides(cfg: Config) -> list[str]:
    return [f"hydra/launcher={cfg.pipeline.launcher}"] if cfg.pipeline.launcher else []


def bench_command(cfg: Config, sweep_dir: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "eagle3.bench",
        "-m",
        *user_overrides(),
        *cfg.pipeline.bench_sweep,
        *launcher_overrides(cfg),
        f"hydra.sweep.dir={sweep_dir}",
    ]


# the stages pipeline.launcher runs as jobs of their own (resources: conf/cluster, by app name);
# without a launcher they run in the pipeline's process
SUBMITTED = ("data", "extract", "train", "export")


def stage_command(cfg: Config, stage: str, sweep_dir: Path) -> list[str]:
    """A stage as a one-job multirun through pipeline.launcher (training: a SLURM job of
    trainer.num_nodes x trainer.devices tasks; regeneration and capture: one task on the GPUs of
    the engine it starts)."""
    return [
        sys.executable,
        "-m",
        f"eagle3.{stage}",
        "-m",
        *user_overrides(),
        *launcher_overrides(cfg),
        f"hydra.sweep.dir={sweep_dir / stage}",
    ]


def submitted(cfg: Config, stage: str) -> bool:
    return bool(cfg.pipeline.launcher) and stage in SUBMITTED


def print_submission(cfg: Config, app_name: str, overrides: list[str], sweep_dir: Path) -> None:
    """The batch script pipeline.launcher would submit for one job (SLURM launchers only)."""
    if not str(cfg.pipeline.launcher).startswith("submitit_slurm"):
        return
    script = submission(app_name, [*user_overrides(), *overrides], cfg.pipeline.launcher, sweep_dir)
    print("      " + script.strip().replace("\n", "\n      "))


def print_stage_plan(plans: dict, stage: str, limits: tuple[float, float]) -> None:
    if stage in plans:
        print("\n".join(plans[stage].lines(*limits)))
    else:
        print("      resources: unknown (a hub id: give target.plan.config, or a local folder)")


def print_plan(cfg: Config, sweep_dir: Path) -> None:
    """Every stage's command, output folder and status; every bench job's engine command, validated."""
    overrides = " ".join(user_overrides())
    weights = check_process_fit(cfg)
    size = "unknown size" if weights is None else f"{weights:,.1f} GB of weights"
    print(
        f"target {cfg.target.name} ({size}; one process holds {cfg.pipeline.process_memory_gb:g} GB)"
    )
    plans = stage_plans(cfg, planned_stages(cfg))
    limits = (float(cfg.pipeline.plan.gpu_memory_gb), float(cfg.pipeline.process_memory_gb))
    for index, stage in enumerate(planned_stages(cfg), 1):
        if stage == "bench":
            print(f"[{index}] bench: {' '.join(bench_command(cfg, sweep_dir))}")
            print_stage_plan(plans, stage, limits)
            print_submission(cfg, "bench", bench_jobs(cfg)[0], sweep_dir)
            continue
        out = stage_output(cfg, stage)
        status = "done" if out.complete else "to run"
        command = f"python -m eagle3.{stage} {overrides}"
        if submitted(cfg, stage):
            command = " ".join(stage_command(cfg, stage, sweep_dir))
        print(f"[{index}] {stage}: {command}\n      -> {out.path} ({status})")
        print_stage_plan(plans, stage, limits)
        if submitted(cfg, stage):
            print_submission(cfg, stage, [], sweep_dir / stage)
        if stage == "extract":
            print("\n".join(disk_lines(cfg)))
            if cfg.extract.backend == "vllm":
                print(f"    extract starts: {' '.join(capture_command(cfg, out.path))}")
    target = cfg.target.path or cfg.target.name
    if cfg.data.regenerate and cfg.data.regen.backend in ("openai", "engine"):
        launch = compose_launch(
            regen_engine_config(cfg) if cfg.data.regen.backend == "engine" else cfg,
            resolve_spec(compose([*user_overrides(), "spec=off"]).spec),
            None,
            target,
            port=cfg.pipeline.plan_port,
        )
        if cfg.data.regen.backend == "engine":
            print(
                f"    data regeneration starts (spec=off, then stops it): {' '.join(launch.argv)}"
            )
        else:
            print(
                f"    data regeneration talks to {cfg.data.regen.base_url}; serve the target first "
                f"with `python -m eagle3.serve {overrides} spec=off`: {' '.join(launch.argv)}"
            )
    drafter = stage_output(cfg, "export").path / (
        "vllm" if cfg.serve.engine == "vllm" else "sglang"
    )
    for job in bench_jobs(cfg):
        job_cfg = compose([*user_overrides(), *job])
        spec = resolve_spec(job_cfg.spec)
        launch = compose_launch(
            job_cfg, spec, drafter if spec.enabled else None, target, port=cfg.pipeline.plan_port
        )
        print(
            f"    bench job {' '.join(job)} ({spec.label}, {job_cfg.serve.engine}): {' '.join(launch.argv)}"
        )
    if plans:
        print(disk_line(cfg, plans))
    check_plans(cfg, plans)
    missing = missing_download(cfg)
    if missing:
        print(f"    {missing}")
    limits = "its GPUs and one host process"
    if cfg.pipeline.launcher:
        limits += ", its job's GPUs per node, host memory and time limit"
    print(
        f"plan valid: every stage fits {limits}, the outputs fit the disk, and every bench job's "
        "spec and engine command passed validation"
        + ("; train and export need the target downloaded first (above)" if missing else "")
    )


def missing_download(cfg: Config) -> str | None:
    """download_hint when a stage that reads the target's files by name (train, export: its
    embedding, head and norm) is planned on a hub id this machine has not downloaded."""
    path = resolve_target_path(cfg.target, Path(cfg.paths.artifacts))
    reads_files = {"train", "export"} & set(planned_stages(cfg))
    if isinstance(path, Path) or not reads_files or downloaded(path) is not None:
        return None
    return download_hint(cfg.target, Path(cfg.paths.artifacts))


def capture_command(cfg: Config, extract_dir: Path) -> list[str]:
    """The vLLM capture server's command as the extract stage will start it (the plan's port)."""
    path = resolve_target_path(cfg.target, Path(cfg.paths.artifacts))
    shape = target_shape(cfg.target, path)
    launch = capture_launch(cfg, shape, extract_dir / "engine" / "states", cfg.pipeline.plan_port)
    return [f"{k}={v}" for k, v in launch.env.items()] + launch.argv


def run_stage(cfg: Config, stage: str, sweep_dir: Path) -> str:
    out = stage_output(cfg, stage)
    if out.complete:
        return f"skipped (done) -> {out.path}"
    if submitted(cfg, stage):
        return run_command(cfg, stage_command(cfg, stage, sweep_dir), stage, sweep_dir / stage)
    STAGE_RUNS[stage](cfg)
    return f"done -> {out.path}"


def run_command(cfg: Config, command: list[str], what: str, folder: Path) -> str:
    """A child process that dies with this one (a watchdog covers SIGKILL)."""
    grace_s, poll_s = cfg.pipeline.stop_timeout_s, cfg.serve.watchdog_poll_s
    returncode = run_child(command, grace_s, poll_s)
    if returncode != 0:
        raise Eagle3Error(f"{what} failed (exit {returncode}); its logs are under {folder}")
    return f"done -> {folder}"


def run_bench(cfg: Config, sweep_dir: Path) -> str:
    """The bench sweep as a child process."""
    return run_command(cfg, bench_command(cfg, sweep_dir), "the bench sweep", sweep_dir)


def print_summary(cfg: Config, sweep_dir: Path) -> None:
    counts = stage_output(cfg, "train").manifest().get("counts", {})
    print(f"\nsummary: simulated acceptance tau_hat = {counts.get('tau_hat')}")
    for path in sorted(sweep_dir.glob("*/bench_result.json")):
        r = json.loads(path.read_text())
        print(
            f"  {r.get('spec', '?'):>8} {r.get('engine', '?'):>6} drafter "
            f"{Path(str(r.get('drafter'))).parent.name or '-'}: {r.get('status')}, tokens/s "
            f"{_fmt(r.get('tokens_per_s'))} ({_fmt(r.get('tokens_per_s_min'))}-"
            f"{_fmt(r.get('tokens_per_s_max'))}), accept length {_fmt(r.get('accept_length'))}, "
            f"speedup {_fmt(r.get('speedup'))} (spec=off {_fmt(r.get('baseline_tokens_per_s'))} tok/s)"
        )
    for name in ("summary.md", "verdict.txt"):
        if (sweep_dir / name).exists():
            print(f"  {name}: {sweep_dir / name}")
    if (sweep_dir / "verdict.txt").exists():
        print((sweep_dir / "verdict.txt").read_text().rstrip())
    print(
        f"  MLflow: {cfg.tracking.uri}  (python -m eagle3.tools.ui, or mlflow ui --backend-store-uri {cfg.tracking.uri})"
    )


def _fmt(value) -> str:
    return f"{value:.2f}" if isinstance(value, (int, float)) else str(value)


@app
def main(cfg: Config) -> None:
    stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{unique_suffix()}"
    sweep_dir = Path(cfg.paths.root) / "multirun" / f"pipeline-{stamp}"
    if cfg.pipeline.dry_run:
        print_plan(cfg, sweep_dir)
        return
    check_process_fit(cfg)
    stages = planned_stages(cfg)
    check_plans(cfg, stage_plans(cfg, stages))
    for index, stage in enumerate(stages, 1):
        started = time.monotonic()
        print(f"[{index}/{len(stages)}] {stage} ...", flush=True)
        result = run_bench(cfg, sweep_dir) if stage == "bench" else run_stage(cfg, stage, sweep_dir)
        print(
            f"[{index}/{len(stages)}] {stage} {result} ({time.monotonic() - started:.0f}s)",
            flush=True,
        )
    if "bench" in stages:
        print_summary(cfg, sweep_dir)


if __name__ == "__main__":
    main()
