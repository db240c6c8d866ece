"""The plan's limits for a stage started alone: `python -m eagle3.data|extract|train ...` (and each
job the pipeline submits) is refused before it loads anything when its plan breaks a limit the
pipeline's dry run checks (its GPUs, one host process, the cluster job's GPUs per node, host memory
and time limit, the disk), with the same one line. A Hydra callback (conf/hydra/default.yaml), so
that the stage packages need not import the pipeline.
"""

from __future__ import annotations

import sys
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

CHECKED = ("data", "extract", "train")


def check_stage(cfg, stage: str, launcher: str | None = None) -> None:
    """Refuse `stage` as the pipeline's plan would (eagle3.pipeline.plan), for it alone."""
    from eagle3.core.outputs import STAGE_OUTPUTS
    from eagle3.pipeline.plan import check_plans, check_process_fit, in_process_loads, stage_plans

    loads = in_process_loads([stage], cfg.data, cfg.train, cfg.extract)
    check_process_fit(cfg.target, Path(cfg.paths.artifacts), cfg.pipeline.process_memory_gb, loads)
    plans = stage_plans(cfg, [stage], launcher)
    check_plans(
        plans,
        cfg.pipeline,
        cfg.cluster,
        cfg.paths.artifacts,
        lambda name: STAGE_OUTPUTS[name](cfg).complete,
    )


class StageLimits(Callback):
    """Checked on the submitting host before a multirun's jobs go out (its config without the sweep
    values), and in each job before the stage starts."""

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        self.on_job_start(config)

    def on_job_start(self, config: DictConfig, **kwargs) -> None:
        stage = config.hydra.job.name
        if stage not in CHECKED:
            return
        from eagle3.core.common import Eagle3Error
        from eagle3.core.config import typed

        cfg = typed(OmegaConf.masked_copy(config, [k for k in config if k != "hydra"]))
        launcher = config.hydra.runtime.choices.get("hydra/launcher")
        try:
            check_stage(cfg, stage, launcher)
        except Eagle3Error as err:
            if cfg.debug:
                raise
            print(f"eagle3 error: {err}  (add debug=true for the traceback)", file=sys.stderr)
            sys.exit(1)
