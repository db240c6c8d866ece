"""Training under srun, simulated on this machine: two processes of the real train app
(`python -m eagle3.train`, tiny-llama, gloo on CPU) started with the variables srun gives each task
(SLURM_PROCID, SLURM_LOCALID, SLURM_NODEID, SLURM_NTASKS...) and nothing else: no LOCAL_RANK or
NODE_RANK. Rank 0 alone opens the MLflow run and writes the manifest; the signal the sbatch script
asks for (conf/cluster) makes the fit checkpoint."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch
from mlflow.tracking import MlflowClient

from eagle3 import data
from eagle3.cluster import submission
from eagle3.outputs import train_output

FIXTURES = Path(__file__).parent / "fixtures"
STAGE = [
    "target=tiny-llama",
    "data=file",
    f"data.source={FIXTURES / 'conversations.jsonl'}",
    "data.val_fraction=0.2",
    "drafter.draft_vocab_size=256",
    "train.hidden_states=online",
    "train.ttt_length=2",
    "train.max_length=64",
    "train.batch_size=2",
    "train.eval_prompts=0",
    "trainer.accelerator=cpu",
    "trainer.devices=2",
    "trainer.strategy=ddp",
    "trainer.progress_bar=false",
    "trainer.log_every_n_steps=1",
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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
        "MASTER_PORT": str(free_port()),
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


def wait_all(tasks: list, logs: list[Path], timeout_s: float = 600) -> list[str]:
    deadline = time.monotonic() + timeout_s
    for task in tasks:
        try:
            task.wait(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            for other in tasks:
                other.kill()
            raise
    outputs = [log.read_text(errors="replace") for log in logs]
    for task, out in zip(tasks, outputs):
        assert task.returncode == 0, out[-3000:]
    return outputs


def app_argv(cfg_overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "eagle3.train", *cfg_overrides]


def prepared(make_cfg, own_artifacts, tmp_path, *overrides: str) -> tuple:
    """The data stage run here; the overrides the tasks get (the same config)."""
    store = tmp_path / "mlruns" / "mlflow.db"
    cfg = make_cfg(*STAGE, f"paths.artifacts={own_artifacts}", *overrides)
    data.run(cfg)
    argv_overrides = [
        f"paths.root={cfg.paths.root}",
        f"tracking.uri=sqlite:///{store}",
        f"tracking.artifact_location={tmp_path}/mlruns/artifacts",
        *STAGE,
        f"paths.artifacts={own_artifacts}",
        *overrides,
    ]
    return cfg, argv_overrides


def test_srun_tasks_write_one_manifest_and_one_mlflow_run(make_cfg, own_artifacts, tmp_path):
    cfg, overrides = prepared(make_cfg, own_artifacts, tmp_path, "train.epochs=1")
    tasks, logs = srun_tasks(app_argv(overrides), tmp_path, "4242")
    rank0, rank1 = wait_all(tasks, logs)

    out = train_output(cfg)
    assert out.complete
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


def sbatch_signal(cfg_overrides: list[str], sweep_dir: Path) -> tuple[signal.Signals, int]:
    """The signal and warning time of the batch script SLURM would run for this training."""
    script = submission("train", cfg_overrides, "submitit_slurm", sweep_dir)
    name, seconds = re.search(r"^#SBATCH --signal=(\w+)@(\d+)$", script, re.M).groups()
    return signal.Signals[f"SIG{name}"], int(seconds)


def test_the_sbatch_signal_makes_a_two_process_fit_checkpoint(make_cfg, own_artifacts, tmp_path):
    overrides = ["train.epochs=3", "tracking.enabled=false", "train.checkpoint_every_n_steps=1000"]
    cfg, argv_overrides = prepared(make_cfg, own_artifacts, tmp_path, *overrides)
    sig, _ = sbatch_signal(overrides, tmp_path / "sweep")
    tasks, logs = srun_tasks(app_argv(argv_overrides), tmp_path, "4243")
    deadline = time.monotonic() + 300
    while "train: step 2/" not in logs[0].read_text(errors="replace"):
        assert time.monotonic() < deadline and all(t.poll() is None for t in tasks), [
            log.read_text(errors="replace")[-3000:] for log in logs
        ]
        time.sleep(0.2)
    for task in tasks:  # SLURM signals every task of the step
        task.send_signal(sig)
    rank0, _ = wait_all(tasks, logs)

    folder = train_output(cfg).path
    saved = sorted(folder.glob("hpc_ckpt_*.ckpt"))
    assert [p.name for p in saved] == ["hpc_ckpt_1.ckpt"], rank0[-3000:]
    assert torch.load(saved[0], weights_only=False)["global_step"] >= 2
    assert "Handling auto-requeue signal" in rank0
