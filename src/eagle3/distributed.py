"""Training on more than one process or machine, handed to Lightning: its DDP and FSDP strategies
with a collective timeout from conf/trainer, its cluster environments (MASTER_ADDR / MASTER_PORT /
NODE_RANK from the environment, SLURM's own under srun), and a one-line error when a peer dies.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

from omegaconf import DictConfig

from eagle3.common import Eagle3Error

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


def strategy_for(trainer_cfg: DictConfig, name: str):
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

        return FSDPStrategy(
            sharding_strategy=trainer_cfg.fsdp_sharding, timeout=timeout, state_dict_type="full"
        )
    return name


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
