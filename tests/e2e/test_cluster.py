"""Past one machine, on this one: the bench sweep as real submitit jobs (hydra/launcher=
submitit_local) gives the sweep the basic launcher gives; four jobs at once log to a real
`mlflow server` and to the sqlite store. The SLURM batch scripts: test_pipeline's kimi-k2.5 plan."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from mlflow.tracking import MlflowClient
from support import QUICK

# engine.cpu_threads=1 and OMP_NUM_THREADS=1 (below): four jobs and their engines share two cores
TINY = (
    "target=tiny-llama",
    "serve=local",
    *QUICK,
    "bench.warmup=0",
    "bench.repeats=1",
    "engine.cpu_threads=1",
)
IDENTITY = ("engine", "spec", "depth", "steps", "topk", "batch_size", "suite", "status")


def sweep(test_root, folder: Path, tracking_uri: str, drafter, *overrides) -> Path:
    """`python -m eagle3.bench -m ...` into folder/sweep; fails the test on a non-zero exit."""
    folder.mkdir(parents=True, exist_ok=True)
    argv = [
        sys.executable,
        "-m",
        "eagle3.bench",
        "-m",
        *TINY,
        *overrides,
        f"drafter.path={drafter}",
        f"paths.root={test_root}",
        f"tracking.uri={tracking_uri}",
        f"tracking.artifact_location={folder}/mlruns/art",
        f"hydra.sweep.dir={folder}/sweep",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900, cwd=folder, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    logs = (
        done.stdout
        + done.stderr
        + "".join(
            p.read_text(errors="replace") for p in (folder / "sweep").rglob("*.log*") if p.is_file()
        )
    )
    assert "database is locked" not in logs and "OperationalError" not in logs
    return folder / "sweep"


def sweep_runs(tracking_uri: str) -> tuple[MlflowClient, object, list]:
    """The one parent run and its children (all runs of the experiment are one of them)."""
    client = MlflowClient(tracking_uri=tracking_uri)
    experiment = client.get_experiment_by_name("eagle3").experiment_id
    runs = client.search_runs([experiment])
    parents = [r for r in runs if r.data.tags.get("stage") == "bench-sweep"]
    assert len(parents) == 1
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id]
    assert len(children) == len(runs) - 1
    return client, parents[0], sorted(children, key=lambda r: int(r.data.params["spec.depth"]))


def sweep_shape(tracking_uri: str, sweep_dir: Path) -> dict:
    """What a sweep produced, without its timings: child runs, their metric names, the parent's
    artifacts, the summary's rows."""
    client, parent, children = sweep_runs(tracking_uri)
    results = sorted(
        (json.loads(p.read_text()) for p in sweep_dir.glob("*/bench_result.json")),
        key=lambda r: r["depth"],
    )
    summary = (sweep_dir / "summary.md").read_text().splitlines()
    return {
        "children": [
            (c.info.run_name, c.info.status, c.data.params["spec.depth"]) for c in children
        ],
        "metrics": [sorted(c.data.metrics) for c in children],
        "parent": (parent.info.status, parent.data.tags["failed_jobs"]),
        "artifacts": sorted(a.path for a in client.list_artifacts(parent.info.run_id)),
        "results": [{k: r[k] for k in IDENTITY} for r in results],
        "summary_rows": len(summary),
        "summary_specs": sorted(line.split("|")[2].strip() for line in summary[2:]),
    }


def sqlite_store(folder: Path, empty_store: Path) -> str:
    """The URI of folder/mlruns/mlflow.db, a copy of conftest's new store (made once: creating one
    costs seconds of schema migrations and disk syncs)."""
    (folder / "mlruns").mkdir(parents=True)
    shutil.copyfile(empty_store, folder / "mlruns" / "mlflow.db")
    return f"sqlite:///{folder}/mlruns/mlflow.db"


@pytest.mark.slow
def test_four_submitit_jobs_at_once_log_to_the_sqlite_store_as_the_basic_launcher_does(
    test_root, tmp_path, tiny_drafter, empty_store
):
    """The same four-job sweep, run by Hydra's basic launcher and as real submitit jobs started at
    once on one sqlite store: the same parent run, child runs (names, params, metric names),
    summary and artifacts; every job's run arrives exactly once. The launchers and the store are
    the subject: each job runs its engine in its own process (serve.inprocess), with no engine
    server to start (test_four_jobs_at_once_log_to_a_tracking_server starts four at once)."""
    shapes = ("spec.depth=2,3,4,5", "serve.inprocess=true")
    basic_uri = sqlite_store(tmp_path / "basic", empty_store)
    basic = sweep(test_root, tmp_path / "basic", basic_uri, tiny_drafter, *shapes)
    local_uri = sqlite_store(tmp_path / "local", empty_store)
    local = sweep(
        test_root,
        tmp_path / "local",
        local_uri,
        tiny_drafter,
        *shapes,
        "hydra/launcher=submitit_local",
    )
    # real submitit jobs: one folder per job with its pickled result and logs
    assert len(list(local.glob(".submitit/*/*_result.pkl"))) == 4
    assert not list(basic.glob(".submitit"))
    expected, found = sweep_shape(basic_uri, basic), sweep_shape(local_uri, local)
    assert found == expected
    assert [r["status"] for r in expected["results"]] == ["ok"] * 4
    assert expected["summary_specs"] == ["d2", "d3", "d4", "d5"]
    assert_four_jobs_arrived(local_uri, local)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def mlflow_server(tmp_path):
    """A real `mlflow server` on loopback (its own sqlite store and artifact folder)."""
    port = free_port()
    store = tmp_path / "server"
    store.mkdir()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--backend-store-uri",
            f"sqlite:///{store}/mlflow.db",
            "--artifacts-destination",
            str(store / "artifacts"),
            "--workers",
            "1",
        ],
        stdout=open(store / "server.log", "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, (store / "server.log").read_text()[-3000:]
            try:
                if httpx.get(f"{uri}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "mlflow server did not start in 180 s"
            time.sleep(1)
        yield uri
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=3)  # nothing reads the store after the test
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


FOUR = ("spec.depth=2,3,4,5", "hydra/launcher=submitit_local")


def assert_four_jobs_arrived(tracking_uri: str, sweep_dir: Path) -> None:
    """One parent, exactly four children (no duplicates), each FINISHED with its metrics equal to
    the job's own bench_result.json."""
    client, parent, children = sweep_runs(tracking_uri)
    assert [c.data.params["spec.depth"] for c in children] == ["2", "3", "4", "5"]
    assert len({c.info.run_id for c in children}) == 4
    assert all(c.info.status == "FINISHED" for c in children)
    for child in children:
        job = int(child.data.params["spec.depth"]) - 2  # spec.depth=2,3,4,5 are jobs 0..3
        result = json.loads((sweep_dir / str(job) / "bench_result.json").read_text())
        assert result["run_id"] == child.info.run_id
        assert child.data.metrics["tokens_per_s"] == pytest.approx(result["tokens_per_s"])
        assert child.data.metrics["output_tokens"] == result["output_tokens"]
        history = client.get_metric_history(child.info.run_id, "tokens_per_s")
        assert len(history) == 1  # logged once, not duplicated by a retry
    assert parent.info.status == "FINISHED" and parent.data.tags["failed_jobs"] == "0"
    assert {"summary.md", "summary.csv"} <= {
        a.path for a in client.list_artifacts(parent.info.run_id)
    }


@pytest.mark.slow
def test_four_jobs_at_once_log_to_a_tracking_server(
    test_root, tmp_path, tiny_drafter, mlflow_server
):
    sweep_dir = sweep(test_root, tmp_path / "server-sweep", mlflow_server, tiny_drafter, *FOUR)
    assert len(list(sweep_dir.glob(".submitit/*/*_result.pkl"))) == 4
    assert_four_jobs_arrived(mlflow_server, sweep_dir)


# ---------------------------------------------------------------- the shape search


def chain_result(depth: int, step_s: float, per_pos: list[float]) -> dict:
    """A finished chain job as bench writes it (the fields the cost model reads)."""
    return {
        "engine": "local",
        "suite": "vicuna",
        "batch_size": 1,
        "max_new_tokens": 64,
        "spec": f"d{depth}",
        "depth": depth,
        "topk": 1,
        "status": "ok",
        "step_s": step_s,
        "baseline_step_s": 0.010,
        "accept_per_pos": per_pos[: depth - 1],
        "decode_tokens_per_s": (1 + sum(per_pos[: depth - 1])) / step_s,
        "tokens_per_s": (1 + sum(per_pos[: depth - 1])) / step_s,
    }


def test_shape_search_probes_then_the_cost_models_depth_then_tpe(tmp_path):
    """CostModelSampler: trials 0 and 1 are the probe chains, trial 2 the depth the cost model
    predicts best from their results (checked against costmodel.predict directly), then TPE;
    tree_steps gives trees enough steps for their depth and chains none."""
    import optuna
    from omegaconf import OmegaConf

    from eagle3.bench.costmodel import fit_step_cost, predict
    from eagle3.bench.shapesearch import CostModelSampler, tree_steps
    from eagle3.core.spec import max_tree_nodes

    per_pos = [0.8, 0.7, 0.6, 0.5, 0.35, 0.2, 0.1]
    probes = {2: chain_result(2, 0.012, per_pos), 8: chain_result(8, 0.024, per_pos)}
    cost = fit_step_cost([(1, 0.010), (2, 0.012), (8, 0.024)])
    predicted = predict(per_pos, cost, list(range(2, 9)))
    best = max(predicted, key=predicted.get)
    assert best not in (2, 8)
    cfg = OmegaConf.create({"search": {"min_steps": 1, "max_steps": 4}})
    sampler = CostModelSampler(str(tmp_path), [2, 8], seed=0)
    study = optuna.create_study(direction="maximize", sampler=sampler)
    space = {
        "spec.depth": optuna.distributions.IntUniformDistribution(2, 8),
        "spec.topk": optuna.distributions.CategoricalDistribution([1, 2, 4]),
    }
    shapes = []
    for number in range(8):
        trial = study.ask()
        params = {name: trial._suggest(name, dist) for name, dist in space.items()}
        tree_steps(cfg, trial)
        shapes.append(dict(trial.params))
        if number < 2:  # the probe's job writes its result, as bench does
            (tmp_path / str(number)).mkdir()
            result = probes[params["spec.depth"]]
            (tmp_path / str(number) / "bench_result.json").write_text(json.dumps(result))
        study.tell(trial, float(number))
    assert shapes[:3] == [
        {"spec.depth": 2, "spec.topk": 1},
        {"spec.depth": 8, "spec.topk": 1},
        {"spec.depth": best, "spec.topk": 1},
    ]
    for shape in shapes:
        if shape["spec.topk"] == 1:
            assert "spec.steps" not in shape
        else:
            assert (
                max_tree_nodes(shape["spec.steps"], shape["spec.topk"]) >= shape["spec.depth"] - 1
            )
    assert len({(s["spec.depth"], s["spec.topk"]) for s in shapes[3:]}) > 1  # TPE explores


@pytest.mark.parametrize("seed", range(4))
def test_shape_search_never_measures_a_shape_twice(tmp_path, seed):
    """Chains of depth 2..6 after the probes 2 and 6 (no results yet, so TPE proposes the rest):
    each of the five trials measures a depth no other trial did."""
    import optuna

    from eagle3.bench.shapesearch import CostModelSampler

    sampler = CostModelSampler(str(tmp_path), [2, 6], seed=seed)
    study = optuna.create_study(direction="maximize", sampler=sampler)
    space = {
        "spec.depth": optuna.distributions.IntUniformDistribution(2, 6),
        "spec.topk": optuna.distributions.CategoricalDistribution([1]),
    }
    depths = []
    for number in range(5):
        trial = study.ask()
        depths.append(trial._suggest("spec.depth", space["spec.depth"]))
        trial._suggest("spec.topk", space["spec.topk"])
        study.tell(trial, float(number))
    assert sorted(depths) == [2, 3, 4, 5, 6]


def test_shape_search_picks_another_branching_for_a_measured_chain(tmp_path):
    """depth fixed at 4: once the chain is measured, the next trials are trees (topk 2, then 4
    with their steps), never the chain again."""
    import optuna
    from omegaconf import OmegaConf

    from eagle3.bench.shapesearch import CostModelSampler, shape_of, tree_steps

    cfg = OmegaConf.create({"search": {"min_steps": 2, "max_steps": 2}})
    sampler = CostModelSampler(str(tmp_path), [4], seed=0)
    study = optuna.create_study(direction="maximize", sampler=sampler)
    space = {
        "spec.depth": optuna.distributions.IntUniformDistribution(4, 4),
        "spec.topk": optuna.distributions.CategoricalDistribution([1, 2, 4]),
    }
    shapes = []
    for number in range(3):
        trial = study.ask()
        for name, dist in space.items():
            trial._suggest(name, dist)
        tree_steps(cfg, trial)
        shapes.append(shape_of(trial.params))
        study.tell(trial, float(number))
    assert sorted(shapes, key=str) == sorted([(4, 1, None), (4, 2, 2), (4, 4, 2)], key=str)
