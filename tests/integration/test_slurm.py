"""Training under srun, simulated on this machine: two processes of the real train app
(`python -m eagle3.train`, tiny-llama, gloo on CPU) started with the variables srun gives each task
(SLURM_PROCID, SLURM_LOCALID, SLURM_NODEID, SLURM_NTASKS...) and nothing else: no LOCAL_RANK or
NODE_RANK. Rank 0 alone opens the MLflow run and writes the manifest; the signal the sbatch script
asks for (conf/cluster) makes the fit checkpoint."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient
from support import ddp_stage, finish

from eagle3.core.cluster import submission
from eagle3.core.outputs import train_output
from eagle3.data import stage as data
from eagle3.serve.launch import free_port

STAGE = ["train.batch_size=2", "trainer.devices=2", "trainer.log_every_n_steps=1"]


def srun_tasks(argv: list[str], folder: Path, job_id: str) -> tuple[list, list[Path]]:
    """Two tasks of one node as srun starts them; their output goes to files (no blocked pipe)."""
    base = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "NODE_RANK", "RANK")}
    common = {
        **base,
        "SLURM_JOB_ID": job_id,
        "SLURM_JOB_NAME": "train",
        "SLURM_NTASKS": "2",
        "SLURM_NTASKS_PER_NODE": "2",
        "SLURM_NNODES": "1",
        "SLURM_NODEID": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port("127.0.0.1")),
        "OMP_NUM_THREADS": "1",  # two ranks on two shared cores
        "PYTHONUNBUFFERED": "1",
    }
    logs = [folder / f"task{rank}.log" for rank in (0, 1)]
    tasks = [
        subprocess.Popen(
            argv,
            env={**common, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank)},
            stdout=open(logs[rank], "w"),
            stderr=subprocess.STDOUT,
        )
        for rank in (0, 1)
    ]
    return tasks, logs


def wait_all(tasks: list, logs: list[Path]) -> list[str]:
    results = finish(tasks, logs)
    for returncode, out in results:
        assert returncode == 0, out[-3000:]
    return [out for _, out in results]


def app_argv(cfg_overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "eagle3.train", *cfg_overrides]


def prepared(make_cfg, test_root, own_artifacts, tmp_path, *overrides: str) -> tuple:
    """The data stage run here; the overrides the tasks get (the same config)."""
    store = tmp_path / "mlruns" / "mlflow.db"
    stage = ddp_stage(test_root, own_artifacts, *STAGE, *overrides)
    cfg = make_cfg(*stage)
    data.run(cfg)
    argv_overrides = [
        f"paths.root={cfg.paths.root}",
        f"tracking.uri=sqlite:///{store}",
        f"tracking.artifact_location={tmp_path}/mlruns/artifacts",
        *stage,
    ]
    return cfg, argv_overrides


def sbatch_signal(cfg_overrides: list[str], sweep_dir: Path) -> signal.Signals:
    """The signal the batch script SLURM would run for this training asks for (--signal=X@s)."""
    script = submission("train", cfg_overrides, "submitit_slurm", sweep_dir)
    return signal.Signals["SIG" + re.search(r"^#SBATCH --signal=(\w+)@\d+$", script, re.M)[1]]


def signal_at_step(tasks: list, logs: list[Path], step: int, sig: signal.Signals) -> None:
    """Send `sig` to every task (as SLURM does) once rank 0 logged `step`."""
    deadline = time.monotonic() + 300
    while f"train: step {step}/" not in logs[0].read_text(errors="replace"):
        assert time.monotonic() < deadline and all(t.poll() is None for t in tasks), [
            log.read_text(errors="replace")[-3000:] for log in logs
        ]
        time.sleep(0.2)
    for task in tasks:
        task.send_signal(sig)


@pytest.mark.slow
def test_srun_tasks_write_once_and_checkpoint_on_the_sbatch_signal(
    make_cfg, test_root, own_artifacts, tmp_path
):
    """Two tasks, 3 epochs of 2 steps; the batch script's signal after step 2."""
    overrides = ["train.epochs=3", "train.checkpoint_every_n_steps=1000"]
    cfg, argv_overrides = prepared(make_cfg, test_root, own_artifacts, tmp_path, *overrides)
    tasks, logs = srun_tasks(app_argv(argv_overrides), tmp_path, "4242")
    signal_at_step(tasks, logs, 2, sbatch_signal(overrides, tmp_path / "sweep"))
    rank0, rank1 = wait_all(tasks, logs)

    out = train_output(cfg)
    assert out.complete and out.manifest()["counts"]["train_sequences"] == 8
    client = MlflowClient(tracking_uri=cfg.tracking.uri)
    experiment = client.get_experiment_by_name(cfg.tracking.experiment).experiment_id
    runs = client.search_runs([experiment], "tags.stage = 'train'")
    assert len(runs) == 1 and runs[0].data.tags["artifact_hash"] == out.hash
    assert runs[0].info.status == "FINISHED"
    # the manifest is written by rank 0 alone, once; rank 1 waits for it, then ends
    assert (rank0 + rank1).count("train: wrote") == 1 and "train: wrote" in rank0
    assert f"train: rank 1 done; rank 0 wrote {out.path}" in rank1
    assert "train: rank" not in rank0
    # both ranks trained, as one world of two (gloo)
    assert "Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2" in rank1
    # Lightning's requeue handler saved the state at the signal (the per-step checkpoints, every
    # 1000 steps, never fired); requeueing failed here: there is no scontrol
    saved = sorted(out.path.glob("hpc_ckpt_*.ckpt"))
    assert [p.name for p in saved] == ["hpc_ckpt_1.ckpt"], rank0[-3000:]
    assert 2 <= torch.load(saved[0], weights_only=False)["global_step"] < 6
    assert "Handling auto-requeue signal" in rank0


def test_lightning_takes_the_requeue_signal_from_a_handler_already_there(
    make_cfg, monkeypatch, tmp_path
):
    """Lightning installs its requeue handler only on a signal nobody handles: a submitit job
    already handles its own signal (USR2). With cluster.requeue_signal=USR2 the fit hands the
    signal to Lightning, and the previous handler is back after."""
    import lightning as L
    from lightning.fabric.plugins.environments import SLURMEnvironment
    from submitit.core.utils import DelayedSubmission, JobPaths
    from submitit.slurm.slurm import SlurmJobEnvironment

    from eagle3.train.distributed import cluster_plugins, requeue_signal_free

    for name in ("SLURM_NTASKS", "SLURM_NTASKS_PER_NODE", "SLURM_NNODES"):
        monkeypatch.setenv(name, "1")
    for name in ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID"):
        monkeypatch.setenv(name, "0")
    monkeypatch.setenv("SLURM_JOB_NAME", "train")
    cfg = make_cfg("cluster.requeue_signal=USR2")

    monkeypatch.setenv("SLURM_JOB_ID", "4244")
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGCONT, signal.SIGUSR2)}
    # submitit's own job environment installs its handlers, as in a submitted job
    SlurmJobEnvironment()._handle_signals(JobPaths(tmp_path), DelayedSubmission(print))
    submitits = signal.getsignal(signal.SIGUSR2)
    assert submitits.__name__ == "checkpoint_and_try_requeue"
    try:
        trainer = L.Trainer(
            accelerator="cpu", devices=1, plugins=cluster_plugins(cfg.cluster), logger=False
        )
        environment = trainer._accelerator_connector.cluster_environment
        assert isinstance(environment, SLURMEnvironment)
        assert environment.requeue_signal == signal.SIGUSR2
        with requeue_signal_free(cfg.cluster):
            trainer._signal_connector.register_signal_handlers()
            handler = signal.getsignal(signal.SIGUSR2)
            trainer._signal_connector.teardown()
        assert handler.signal_handlers == [trainer._signal_connector._slurm_sigusr_handler_fn]
        assert signal.getsignal(signal.SIGUSR2) is submitits
        # without it Lightning leaves the signal to the handler already there
        trainer._signal_connector.register_signal_handlers()
        assert signal.getsignal(signal.SIGUSR2) is submitits
        trainer._signal_connector.teardown()
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
