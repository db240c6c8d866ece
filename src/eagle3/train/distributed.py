"""Training on more than one process or machine, handed to Lightning: its DDP and FSDP strategies
with a collective timeout from conf/trainer, its cluster environments (MASTER_ADDR / MASTER_PORT /
NODE_RANK from the environment, SLURM's own under srun), and a one-line error when a peer dies.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from datetime import timedelta
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback

from eagle3.core.common import Eagle3Error
from eagle3.core.config import ClusterConfig, TrainerConfig

# what gloo and NCCL say when the process on the other end of a collective is gone
PEER_LOST = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "timed out",
    "timeout",
    "remote process exited",
    "socket closed",
    "connection refused",
)


def under_slurm() -> bool:
    """Inside a SLURM job step whose tasks are the ranks (srun started them, not Lightning)."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    return SLURMEnvironment.detect()


def cluster_environment():
    """The cluster environment Lightning itself would pick for this process (torchelastic, SLURM,
    LSF), or None for Lightning's own (its launcher sets LOCAL_RANK and NODE_RANK per rank)."""
    from lightning.fabric.plugins.environments import (
        LSFEnvironment,
        SLURMEnvironment,
        TorchElasticEnvironment,
    )

    for kind in (TorchElasticEnvironment, SLURMEnvironment, LSFEnvironment):
        if kind.detect():
            return kind()
    return None


def global_rank(devices_per_node: int) -> int:
    """This process's global rank as Lightning will see it, known before the trainer exists: srun
    sets SLURM_PROCID (not LOCAL_RANK or NODE_RANK) in every task."""
    environment = cluster_environment()
    if environment is not None:
        return environment.global_rank()
    return int(os.environ.get("NODE_RANK", 0)) * devices_per_node + local_rank()


def local_rank() -> int:
    """This process's rank on its node (its GPU index): SLURM_LOCALID under srun."""
    environment = cluster_environment()
    return environment.local_rank() if environment else int(os.environ.get("LOCAL_RANK", 0))


def requeue_signal(cluster_cfg: ClusterConfig) -> signal.Signals:
    """cluster.requeue_signal (USR1) as a signal number."""
    name = str(cluster_cfg.requeue_signal).upper().removeprefix("SIG")
    try:
        return signal.Signals[f"SIG{name}"]
    except KeyError:
        raise Eagle3Error(
            f"cluster.requeue_signal={cluster_cfg.requeue_signal} is no signal: use USR1 or USR2"
        ) from None


def cluster_plugins(cluster_cfg: ClusterConfig) -> list:
    """Under srun: Lightning's SLURM environment listening for the signal sbatch is told to send
    (cluster.requeue_signal): on it every rank saves hpc_ckpt_<n>.ckpt and rank 0 requeues the job."""
    if not under_slurm():
        return []
    from lightning.fabric.plugins.environments import SLURMEnvironment

    return [SLURMEnvironment(requeue_signal=requeue_signal(cluster_cfg))]


def requeue_callbacks(cluster_cfg: ClusterConfig) -> list:
    """Under srun: RequeueAtStepEnd for the requeue signal (none otherwise)."""
    return [RequeueAtStepEnd(requeue_signal(cluster_cfg))] if under_slurm() else []


class RequeueAtStepEnd(Callback):
    """Lightning's requeue handler saves a checkpoint (a barrier across ranks) inside the signal
    handler: a rank that takes the signal amid DDP's gradient all-reduce meets the other ranks'
    barrier with it and every rank waits forever. Here the signal only marks the rank; after each
    batch the ranks agree on the mark (one all-reduce, the same step on every rank) and all run
    Lightning's handler there: the checkpoint of that step, then rank 0 requeues."""

    def __init__(self, sig: signal.Signals):
        self.sig, self.marked, self.lightning_handler = sig, False, None

    def on_train_start(self, trainer, pl_module) -> None:
        handler = signal.getsignal(self.sig)
        if callable(handler):  # Lightning's, installed when the fit started
            self.lightning_handler = handler
            signal.signal(self.sig, self.mark)

    def mark(self, signum, frame) -> None:
        self.marked = True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.lightning_handler is None:
            return
        marked = torch.tensor(float(self.marked), device=pl_module.device)
        if trainer.strategy.reduce(marked, reduce_op="max").item():
            self.marked = False
            self.lightning_handler(self.sig, None)

    def on_train_end(self, trainer, pl_module) -> None:
        if self.lightning_handler is not None:
            signal.signal(self.sig, self.lightning_handler)
            self.lightning_handler = None


@contextlib.contextmanager
def requeue_signal_free(cluster_cfg: ClusterConfig):
    """Lightning installs its requeue handler only on a signal nobody handles yet; a submitit job
    has its own handler (resubmit without a checkpoint) on its signal. For the fit, the signal is
    left to Lightning; the previous handler comes back after."""
    if not under_slurm():
        yield
        return
    sig = requeue_signal(cluster_cfg)
    previous = signal.getsignal(sig)
    signal.signal(sig, signal.SIG_DFL)
    try:
        yield
    finally:
        signal.signal(sig, previous if previous is not None else signal.SIG_DFL)


def wait_for_rank_zero(
    complete, folder: Path, rank: int, timeout_s: float, poll_s: float = 0.5
) -> None:
    """A rank > 0 after the fit: return once rank 0 marked `folder` complete (`complete()` true),
    so every rank ends with the output finished; fail after timeout_s naming the folder."""
    deadline = time.monotonic() + timeout_s
    while not complete():
        if time.monotonic() > deadline:
            raise Eagle3Error(
                f"rank {rank}: rank 0 did not finish {folder} within {timeout_s:.0f} s "
                "(trainer.dist_timeout_s); see rank 0's log"
            )
        time.sleep(poll_s)


def strategy_for(trainer_cfg: TrainerConfig, name: str):
    """Lightning's strategy for `name` with the configured collective timeout (a dead peer fails
    the run after it instead of torch's 30 minutes); other names pass through."""
    timeout = timedelta(seconds=trainer_cfg.dist_timeout_s)
    if name in ("ddp", "ddp_spawn"):
        from lightning.pytorch.strategies import DDPStrategy

        return DDPStrategy(
            start_method="spawn" if name == "ddp_spawn" else "popen", timeout=timeout
        )
    if name == "fsdp":
        from lightning.pytorch.strategies import FSDPStrategy

        if not on_gpu(trainer_cfg.accelerator):
            raise Eagle3Error(
                "trainer.strategy=fsdp needs a GPU and this run trains on CPU (trainer.accelerator="
                f"{trainer_cfg.accelerator}): Lightning's FSDP strategy and torch's FSDP refuse "
                "CPU; use trainer.strategy=ddp on CPU"
            )
        return FSDPStrategy(
            sharding_strategy=trainer_cfg.fsdp_sharding, timeout=timeout, state_dict_type="full"
        )
    return name


def on_gpu(accelerator: str) -> bool:
    import torch

    return accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())


def peer_lost(err: BaseException) -> bool:
    text = str(err).lower()
    return any(sign in text for sign in PEER_LOST)


def lost_peer_error(err: BaseException, world_size: int, num_nodes: int, last: Path) -> Eagle3Error:
    first = str(err).strip().splitlines()[0][:300] if str(err).strip() else type(err).__name__
    resume = f"the rerun resumes from {last}" if last.exists() else "no checkpoint was written yet"
    return Eagle3Error(
        f"training lost a process of its {world_size} ({num_nodes} node(s)): {first}; rerun the "
        f"same command on every node: {resume}"
    )
