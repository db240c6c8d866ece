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

import dataclasses
import functools
import itertools
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser

from eagle3.core.artifacts import StageOutput
from eagle3.core.cluster import submission
from eagle3.core.common import Eagle3Error, app, compose, unique_suffix
from eagle3.core.config import (
    Config,
    DataConfig,
    ExtractConfig,
    PipelineConfig,
    RegenConfig,
    ServeConfig,
    TargetConfig,
    TrackingConfig,
    TrainConfig,
)
from eagle3.core.lifecycle import run_child
from eagle3.core.outputs import STAGE_OUTPUTS
from eagle3.core.spec import resolve_spec
from eagle3.core.target import download_hint, downloaded, resolve_target_path
from eagle3.data import stage as data
from eagle3.data.regen import regen_engine_config
from eagle3.export import stage as export
from eagle3.extract import stage as extract
from eagle3.extract.vllm_capture import capture_launch, target_shape
from eagle3.pipeline.plan import (
    StagePlan,
    check_plans,
    check_process_fit,
    disk_line,
    disk_lines,
    disk_writes,
    in_process_loads,
    planned_tokens,
    stage_plans,
    target_hidden_size,
)
from eagle3.serve.launch import Launch, compose_launch, engine_setup
from eagle3.train import stage as train

STAGE_RUNS = {"data": data.run, "extract": extract.run, "train": train.run, "export": export.run}


def planned_stages(pipeline: PipelineConfig, train: TrainConfig) -> list[str]:
    no_shards = train.hidden_states in ("online", "engine")
    return [s for s in pipeline.stages if not (s == "extract" and no_shards)]


def user_overrides() -> list[str]:
    """The overrides the pipeline was started with (handed on to the bench)."""
    return [o for o in HydraConfig.get().overrides.task if not o.startswith("pipeline.")]


def bench_jobs(pipeline: PipelineConfig) -> list[list[str]]:
    """pipeline.bench_sweep expanded exactly as Hydra's basic sweeper will: one override list per
    job, the cartesian product of the sweep values in the order they were given."""
    parsed = OverridesParser.create().parse_overrides(list(pipeline.bench_sweep))
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


def launcher_overrides(launcher: str | None) -> list[str]:
    return [f"hydra/launcher={launcher}"] if launcher else []


def bench_command(pipeline: PipelineConfig, sweep_dir: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "eagle3.bench",
        "-m",
        *user_overrides(),
        *pipeline.bench_sweep,
        *launcher_overrides(pipeline.launcher),
        f"hydra.sweep.dir={sweep_dir}",
    ]


# the stages pipeline.launcher runs as jobs of their own (resources: conf/cluster, by app name);
# without a launcher they run in the pipeline's process
SUBMITTED = ("data", "extract", "train", "export")


def stage_command(launcher: str | None, stage: str, sweep_dir: Path) -> list[str]:
    """A stage as a one-job multirun through pipeline.launcher (training: a SLURM job of
    trainer.num_nodes x trainer.devices tasks; regeneration and capture: one task on the GPUs of
    the engine it starts)."""
    return [
        sys.executable,
        "-m",
        f"eagle3.{stage}",
        "-m",
        *user_overrides(),
        *launcher_overrides(launcher),
        f"hydra.sweep.dir={sweep_dir / stage}",
    ]


def submitted(launcher: str | None, stage: str) -> bool:
    return bool(launcher) and stage in SUBMITTED


def print_submission(
    launcher: str | None, app_name: str, overrides: list[str], sweep_dir: Path
) -> None:
    """The batch script pipeline.launcher would submit for one job (SLURM launchers only)."""
    if not str(launcher).startswith("submitit_slurm"):
        return
    script = submission(app_name, [*user_overrides(), *overrides], launcher, sweep_dir)
    print("      " + script.strip().replace("\n", "\n      "))


def print_stage_plan(plans: dict, stage: str, limits: tuple[float, float]) -> None:
    if stage in plans:
        print("\n".join(plans[stage].lines(*limits)))
    else:
        print("      resources: unknown (a hub id: give target.plan.config, or a local folder)")


def print_stage(
    index: int,
    out: StageOutput,
    plans: dict[str, StagePlan],
    limits: tuple[float, float],
    launcher: str | None,
    sweep_dir: Path,
) -> None:
    """A stage's command, output folder and status, plan, and the batch script it is submitted as."""
    stage = out.stage
    status = "done" if out.complete else "to run"
    command = f"python -m eagle3.{stage} {' '.join(user_overrides())}"
    if submitted(launcher, stage):
        command = " ".join(stage_command(launcher, stage, sweep_dir))
    print(f"[{index}] {stage}: {command}\n      -> {out.path} ({status})")
    print_stage_plan(plans, stage, limits)
    if submitted(launcher, stage):
        print_submission(launcher, stage, [], sweep_dir / stage)


def print_bench_stage(
    index: int,
    plans: dict[str, StagePlan],
    limits: tuple[float, float],
    pipeline: PipelineConfig,
    sweep_dir: Path,
) -> None:
    print(f"[{index}] bench: {' '.join(bench_command(pipeline, sweep_dir))}")
    print_stage_plan(plans, "bench", limits)
    print_submission(pipeline.launcher, "bench", bench_jobs(pipeline)[0], sweep_dir)


def regen_line(regen: RegenConfig, argv: list[str]) -> str:
    """The engine data.regen.backend=engine starts, or the server backend openai talks to."""
    if regen.backend == "engine":
        return f"    data regeneration starts (spec=off, then stops it): {' '.join(argv)}"
    return (
        f"    data regeneration talks to {regen.base_url}; serve the target first "
        f"with `python -m eagle3.serve {' '.join(user_overrides())} spec=off`: {' '.join(argv)}"
    )


def print_bench_jobs(pipeline: PipelineConfig, drafter: Path, target: str) -> None:
    """Every bench job's engine command: each job's config composed, its spec resolved and its
    command validated."""
    for job in bench_jobs(pipeline):
        job_cfg = compose([*user_overrides(), *job])
        spec = resolve_spec(job_cfg.spec)
        launch = compose_launch(
            engine_setup(job_cfg),
            spec,
            drafter if spec.enabled else None,
            target,
            port=pipeline.plan_port,
        )
        print(
            f"    bench job {' '.join(job)} ({spec.label}, {job_cfg.serve.engine}): {' '.join(launch.argv)}"
        )


def verdict_line(launcher: str | None, missing: str | None) -> str:
    limits = "its GPUs and one host process"
    if launcher:
        limits += ", its job's GPUs per node, host memory and time limit"
    return (
        f"plan valid: every stage fits {limits}, the outputs fit the disk, and every bench job's "
        "spec and engine command passed validation"
        + ("; train and export need the target downloaded first (above)" if missing else "")
    )


def print_plan(cfg: Config, sweep_dir: Path) -> None:
    """Every stage's command, output folder, status and plan; the engines the stages start; every
    bench job's engine command, validated; then the plan checked (check_plans)."""
    pipeline, artifacts = cfg.pipeline, Path(cfg.paths.artifacts)
    loads = in_process_loads(pipeline.stages, cfg.data, cfg.train, cfg.extract)
    weights = check_process_fit(cfg.target, artifacts, pipeline.process_memory_gb, loads)
    size = "unknown size" if weights is None else f"{weights:,.1f} GB of weights"
    print(f"target {cfg.target.name} ({size}; one process holds {pipeline.process_memory_gb:g} GB)")
    stages = planned_stages(pipeline, cfg.train)
    plans = stage_plans(cfg, stages)
    limits = (float(pipeline.plan.gpu_memory_gb), float(pipeline.process_memory_gb))
    outputs = {}
    for index, stage in enumerate(stages, 1):
        if stage == "bench":
            print_bench_stage(index, plans, limits, pipeline, sweep_dir)
            continue
        outputs[stage] = STAGE_OUTPUTS[stage](cfg)
        print_stage(index, outputs[stage], plans, limits, pipeline.launcher, sweep_dir)
        if stage == "extract":
            capture = None
            if cfg.extract.backend == "vllm":  # as the stage starts it, at the plan's port
                shape = target_shape(cfg.target, resolve_target_path(cfg.target, artifacts))
                states = outputs[stage].path / "engine" / "states"
                capture = capture_launch(cfg, shape, states, pipeline.plan_port)
            hidden = target_hidden_size(cfg.target, artifacts)
            print_extract_engine(cfg.extract, cfg.data, STAGE_OUTPUTS["data"](cfg), hidden, capture)
    target = cfg.target.path or cfg.target.name
    regen = cfg.data.regen
    if cfg.data.regenerate and regen.backend in ("openai", "engine"):
        engine_cfg = (
            dataclasses.replace(cfg, serve=regen_engine_config(cfg.serve, regen))
            if regen.backend == "engine"
            else cfg
        )
        spec_off = resolve_spec(compose([*user_overrides(), "spec=off"]).spec)
        launch = compose_launch(
            engine_setup(engine_cfg), spec_off, None, target, port=pipeline.plan_port
        )
        print(regen_line(regen, launch.argv))
    export_dir = STAGE_OUTPUTS["export"](cfg).path
    print_bench_jobs(
        pipeline, export_dir / ("vllm" if cfg.serve.engine == "vllm" else "sglang"), target
    )
    if plans:
        writes = disk_writes(plans, lambda stage: outputs[stage].complete)
        print(disk_line(writes, cfg.cluster, cfg.paths.artifacts))
    check_plans(
        plans, pipeline, cfg.cluster, cfg.paths.artifacts, lambda stage: outputs[stage].complete
    )
    missing = missing_download(cfg.target, artifacts, stages)
    if missing:
        print(f"    {missing}")
    print(verdict_line(pipeline.launcher, missing))


def print_extract_engine(
    ecfg: ExtractConfig,
    data: DataConfig,
    data_out: StageOutput,
    hidden: int,
    capture: Launch | None,
) -> None:
    """The shards the extract stage writes (`hidden`: the target's hidden size), and with
    extract.backend=vllm the capture server's command as the stage will start it (`capture`)."""
    tokens, exact = planned_tokens(data_out, ecfg.splits, data)
    print("\n".join(disk_lines(ecfg.dtype, hidden, tokens, exact)))
    if capture is not None:
        command = [f"{k}={v}" for k, v in capture.env.items()] + capture.argv
        print(f"    extract starts: {' '.join(command)}")


def missing_download(target: TargetConfig, artifacts: Path, stages: list[str]) -> str | None:
    """download_hint when a stage that reads the target's files by name (train, export: its
    embedding, head and norm) is among `stages` on a hub id this machine has not downloaded."""
    path = resolve_target_path(target, artifacts)
    reads_files = {"train", "export"} & set(stages)
    if isinstance(path, Path) or not reads_files or downloaded(path) is not None:
        return None
    return download_hint(target, artifacts)


def run_stage(
    out: StageOutput,
    run: Callable[[], StageOutput],
    pipeline: PipelineConfig,
    serve: ServeConfig,
    sweep_dir: Path,
) -> str:
    """The stage of output `out` in this process (`run`: its stage's `run` with the config), or
    submitted through pipeline.launcher; skipped when its output is complete."""
    if out.complete:
        return f"skipped (done) -> {out.path}"
    if submitted(pipeline.launcher, out.stage):
        command = stage_command(pipeline.launcher, out.stage, sweep_dir)
        return run_command(command, out.stage, sweep_dir / out.stage, pipeline, serve)
    run()
    return f"done -> {out.path}"


def run_command(
    command: list[str], what: str, folder: Path, pipeline: PipelineConfig, serve: ServeConfig
) -> str:
    """A child process that dies with this one (a watchdog covers SIGKILL): pipeline.stop_timeout_s
    to stop, its watchdog polling every serve.watchdog_poll_s."""
    returncode = run_child(command, pipeline.stop_timeout_s, serve.watchdog_poll_s)
    if returncode != 0:
        raise Eagle3Error(f"{what} failed (exit {returncode}); its logs are under {folder}")
    return f"done -> {folder}"


def run_bench(pipeline: PipelineConfig, serve: ServeConfig, sweep_dir: Path) -> str:
    """The bench sweep as a child process."""
    command = bench_command(pipeline, sweep_dir)
    return run_command(command, "the bench sweep", sweep_dir, pipeline, serve)


def print_summary(train_out: StageOutput, tracking: TrackingConfig, sweep_dir: Path) -> None:
    counts = train_out.manifest().get("counts", {})
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
        f"  MLflow: {tracking.uri}  (python -m eagle3.tools.ui, or mlflow ui --backend-store-uri {tracking.uri})"
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
    loads = in_process_loads(cfg.pipeline.stages, cfg.data, cfg.train, cfg.extract)
    check_process_fit(cfg.target, Path(cfg.paths.artifacts), cfg.pipeline.process_memory_gb, loads)
    stages = planned_stages(cfg.pipeline, cfg.train)
    plans = stage_plans(cfg, stages)
    check_plans(
        plans,
        cfg.pipeline,
        cfg.cluster,
        cfg.paths.artifacts,
        lambda stage: STAGE_OUTPUTS[stage](cfg).complete,
    )
    for index, stage in enumerate(stages, 1):
        started = time.monotonic()
        print(f"[{index}/{len(stages)}] {stage} ...", flush=True)
        if stage == "bench":
            result = run_bench(cfg.pipeline, cfg.serve, sweep_dir)
        else:
            run = functools.partial(STAGE_RUNS[stage], cfg)
            result = run_stage(STAGE_OUTPUTS[stage](cfg), run, cfg.pipeline, cfg.serve, sweep_dir)
        print(
            f"[{index}/{len(stages)}] {stage} {result} ({time.monotonic() - started:.0f}s)",
            flush=True,
        )
    if "bench" in stages:
        print_summary(STAGE_OUTPUTS["train"](cfg), cfg.tracking, sweep_dir)


if __name__ == "__main__":
    main()
