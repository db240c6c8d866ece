"""What a Hydra launcher would submit: the SLURM batch script of an app's job under
`hydra/launcher=submitit_slurm`, rendered by submitit itself from the launcher's resolved config
(conf/hydra/launcher, resources from conf/cluster), without a cluster. `python -m eagle3.pipeline
pipeline.launcher=submitit_slurm pipeline.dry_run=true` prints it for training and the bench.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from eagle3.core.common import CONF_DIR, Eagle3Error


def launcher_config(app: str, overrides: list[str], launcher: str) -> dict:
    """The resolved hydra.launcher section an `app` job would get from `hydra/launcher=<launcher>`."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    saved = GlobalHydra.instance().hydra if GlobalHydra.instance().is_initialized() else None
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(CONF_DIR, version_base="1.3", job_name=app):
            cfg = compose(
                "config",
                overrides=[*overrides, f"hydra/launcher={launcher}"],
                return_hydra_config=True,
            )
            params = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    finally:
        GlobalHydra.instance().clear()
        if saved is not None:
            GlobalHydra.instance().initialize(saved)
    return params


def submission(app: str, overrides: list[str], launcher: str, sweep_dir: Path) -> str:
    """The sbatch script submitit would write for one `app` job (the launcher's own parameter
    mapping: queue settings as they are, SLURM-only ones prefixed)."""
    from submitit.slurm.slurm import SlurmExecutor

    class PlanExecutor(SlurmExecutor):  # SLURM's executor, without requiring srun on this machine
        @classmethod
        def affinity(cls) -> int:
            return 1

    params = launcher_config(app, [*overrides, f"hydra.sweep.dir={sweep_dir}"], launcher)
    target = str(params.pop("_target_"))
    if not target.endswith("SlurmLauncher"):
        raise Eagle3Error(f"hydra/launcher={launcher} does not submit to SLURM ({target})")
    executor = PlanExecutor(
        params.pop("submitit_folder"), max_num_timeout=params.pop("max_num_timeout")
    )
    executor.update_parameters(**executor._convert_parameters(params))  # generic names -> sbatch
    return executor._make_submission_file_text(executor._submitit_command_str, "<job id>")
