"""Ordinary stops and user errors end an app with one line naming the cause (no traceback):
SIGTERM between a sweep's jobs, Ctrl-C during regeneration, an EAGLE3_ROOT that cannot be created,
an HF target folder without a tokenizer, a misspelt option in a sweep."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.experimental.callback import Callback
from support import REPO, TESTS

from eagle3.core.common import compose

HERE = Path(__file__).resolve().parent  # test_stops itself, imported by the bench's Hydra


class TermAfterFirstJob(Callback):
    """Sends this process SIGTERM as the sweep's first job ends: a real signal, delivered at the one
    moment a test cannot hit by timing (Hydra's launcher between two jobs)."""

    def on_job_end(self, config, job_return, **kwargs) -> None:
        if config.hydra.job.num == 0:
            os.kill(os.getpid(), signal.SIGTERM)


def run_app(module: str, *overrides: str, env: dict | None = None, timeout_s: float = 300):
    return subprocess.run(
        [sys.executable, "-m", module, *overrides],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env={**os.environ, **(env or {})},
    )


def last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


@pytest.mark.slow
def test_sigterm_between_bench_jobs_is_one_line(test_root, tmp_path):
    """Two jobs that fail fast (serve=hf does not speculate); SIGTERM once the first has ended."""
    out = run_app(
        "eagle3.bench",
        "-m",
        "spec=d4,d8",
        "serve=hf",
        "target=tiny-llama",
        f"paths.root={tmp_path}",
        f"paths.artifacts={test_root}/artifacts",
        "+hydra.callbacks.term_after_first._target_=test_stops.TermAfterFirstJob",
        env={
            "PYTHONPATH": os.pathsep.join([str(HERE), str(TESTS), os.environ.get("PYTHONPATH", "")])
        },
    )
    assert out.returncode == 128 + signal.SIGTERM, out.stderr
    assert "Traceback" not in out.stderr
    assert last_line(out.stderr) == "eagle3: stopped by SIGTERM"
    assert len(list(tmp_path.glob("multirun/*/*/*/bench_result.json"))) == 1  # job 2 never ran
    jobs = next(tmp_path.glob("multirun/*/*/bench_jobs.json"))
    assert json.loads(jobs.read_text()) == {"jobs": 2} and "bench job 1 of 2" in out.stdout


# Runs the data stage with a real SIGINT sent to itself as soon as the regeneration has logged its
# first generated answer: the regeneration is still under way then (data.regen.batch_size=1 leaves
# the other prompts to generate), whatever the machine's speed.
CTRL_C_AFTER_FIRST_ANSWER = """
import os, runpy, signal, sys
from eagle3.data import regen

add = regen.TurnLog.add

def add_then_ctrl_c(self, answered):
    add(self, answered)
    if any(text is not None for *_, text in answered):
        os.kill(os.getpid(), signal.SIGINT)

regen.TurnLog.add = add_then_ctrl_c
sys.argv = sys.argv[1:]
runpy.run_module("eagle3.data", run_name="__main__", alter_sys=True)
"""


@pytest.mark.slow
def test_ctrl_c_during_regeneration_is_one_line(own_artifacts, tmp_path):
    overrides = [
        "target=tiny-llama",
        f"paths.root={tmp_path}",
        f"paths.artifacts={own_artifacts}",
        "tracking.enabled=false",
        "data.limit=6",
        "data.regenerate=true",
        "data.regen.max_new_tokens=16",
        "data.regen.batch_size=1",  # one answer per generate call: five more to go after the first
    ]
    from eagle3.data.regen import regeneration

    log = regeneration(compose(overrides)).log_path
    out = subprocess.run(
        [sys.executable, "-c", CTRL_C_AFTER_FIRST_ANSWER, "eagle3.data", *overrides],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 128 + signal.SIGINT, out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    assert last_line(out.stderr) == "eagle3: interrupted (Ctrl-C)"
    answers = [json.loads(line) for line in log.read_text().splitlines()]
    assert [a["content"] is not None for a in answers].count(True) == 1  # stopped mid-way


def test_an_eagle3_root_that_cannot_be_created_is_one_line(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    out = run_app(
        "eagle3.tools.info", "target=tiny-llama", env={"EAGLE3_ROOT": str(blocker / "root")}
    )
    assert out.returncode == 1 and "Traceback" not in out.stderr
    line = last_line(out.stderr)
    assert line.startswith(f"eagle3 error: cannot create the output folder {blocker}/root/outputs/")
    assert f"set EAGLE3_ROOT={blocker}/root to a folder you can write" in line


def test_an_hf_target_folder_without_a_tokenizer_is_one_line(tiny_target, tmp_path):
    tiny = tiny_target.path
    folder = tmp_path / "model"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copyfile(tiny / name, folder / name)
    out = run_app(
        "eagle3.tools.info", "target=hf", f"target.path={folder}", f"hydra.run.dir={tmp_path}/run"
    )
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert last_line(out.stderr).startswith(
        f"eagle3 error: target.path {folder} has no tokenizer (tokenizer.json, tokenizer.model"
    )


def test_info_finds_the_engine_venvs_where_the_launcher_does(make_cfg, tmp_path):
    """Run from elsewhere (paths.root is another folder): info names the interpreter the launcher
    would start, relative to the checkout, and says whether it is there."""
    from eagle3.serve.launch import engine_python
    from eagle3.tools.info import engines_available

    found = engines_available(make_cfg(f"paths.root={tmp_path}").serve)
    for engine in ("vllm", "sglang"):
        python = Path(engine_python(make_cfg(f"serve={engine}").serve))
        assert python.is_relative_to(REPO)
        assert str(python) in found[engine]
        assert found[engine].startswith("venv found" if python.exists() else "not installed")


def test_a_misspelt_option_in_a_sweep_is_one_line_before_any_run(make_cfg, tmp_path):
    store = tmp_path / "mlruns" / "mlflow.db"
    make_cfg()  # the store, empty
    out = run_app(
        "eagle3.bench",
        "-m",
        "spec=d2,d4",
        "target=tiny-llama",
        f"paths.root={tmp_path}",
        f"tracking.uri=sqlite:///{store}",
    )
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert last_line(out.stderr).startswith(
        "eagle3 error: spec=d2: no such option; spec is one of "
    )
    assert "d4" in last_line(out.stderr).split("one of ")[1].split(", ")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{store}")
    experiment = client.get_experiment_by_name("eagle3")
    assert experiment is None or client.search_runs([experiment.experiment_id]) == []  # no run
