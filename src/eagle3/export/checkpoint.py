"""`python -m eagle3.export.checkpoint`: the newest checkpoint of a training that has not finished
(stopped, or cut by a job's time limit) exported as the folders the engines load, so it can be
served and benched before the training ends:

    python -m eagle3.export.checkpoint experiment=<the training's>     # its train folder, by hash
    python -m eagle3.export.checkpoint export.checkpoint=<.ckpt file or train folder>
    python -m eagle3.bench drafter.path=<the folder it prints>

The drafter's shapes come from the composed config (target + drafter, as the training composed
them), its weights and vocab map from the checkpoint, its frozen embedding from the target. The
output folder is named by the checkpoint's sha256 and the export settings: a newer checkpoint gets
a new folder, and the same one exported again is a no-op. The finished training is exported by
`python -m eagle3.export`.
"""

from __future__ import annotations

from pathlib import Path

from eagle3.core.artifacts import StageOutput, file_sha256, stage_output
from eagle3.core.common import Eagle3Error, app, log
from eagle3.core.config import (
    Config,
    DrafterConfig,
    ExportConfig,
    TargetConfig,
    TrainConfig,
    plain,
)
from eagle3.core.drafter import Eagle3Drafter, build_drafter
from eagle3.core.drafter_io import check_drafter_for_target, drafter_weights
from eagle3.core.hash_schema import hashed
from eagle3.core.outputs import train_output
from eagle3.core.target import target_key
from eagle3.core.target_parts import load_target_parts
from eagle3.export.stage import export_drafter

STAGE = "checkpoint-export"


def newest_checkpoint(source: Path) -> Path:
    """`source` itself when it is a file; else the most recently written *.ckpt under it (last.ckpt,
    epoch and best checkpoints, the requeue's hpc_ckpt_*)."""
    if source.is_file():
        return source
    found = list(source.glob("**/*.ckpt")) if source.is_dir() else []
    if not found:
        raise Eagle3Error(
            f"{source} holds no checkpoint (*.ckpt): train with this config first, or set "
            "export.checkpoint=<a .ckpt file or a train folder>"
        )
    return max(found, key=lambda path: path.stat().st_mtime_ns)


def chosen_checkpoint(ecfg: ExportConfig) -> Path | None:
    """export.checkpoint (None: the train folder of the composed config)."""
    chosen = ecfg.checkpoint
    return Path(str(chosen)).expanduser() if chosen else None


def checkpoint_output(
    ecfg: ExportConfig, target_cfg: TargetConfig, artifacts: str, checksum: str
) -> StageOutput:
    """The export's folder: named by the checkpoint's contents, the target and the export settings."""
    settings = hashed("export", {"export": plain(ecfg)})["export"]
    sections = {
        "export": settings,
        "checkpoint": {"sha256": checksum},
        "target": target_key(target_cfg),
    }
    return stage_output(artifacts, STAGE, sections)


def checkpoint_drafter(drafter_cfg: DrafterConfig, checkpoint: Path, target) -> Eagle3Drafter:
    """A drafter shaped by drafter_cfg with the checkpoint's weights (the embedding: the target's)."""
    drafter = build_drafter(target, drafter_cfg).float()
    missing, unexpected = drafter.load_state_dict(drafter_weights(checkpoint), strict=False)
    missing = [key for key in missing if not key.startswith("embed_tokens.")]
    if missing or unexpected:
        raise Eagle3Error(
            f"{checkpoint} does not fit the drafter this config describes (missing {missing}, "
            f"unexpected {unexpected}): compose the target and drafter overrides its training used"
        )
    check_drafter_for_target(drafter, target)
    return drafter


def export_checkpoint(
    checkpoint: Path,
    ecfg: ExportConfig,
    target_cfg: TargetConfig,
    drafter_cfg: DrafterConfig,
    tcfg: TrainConfig,
    artifacts: str,
) -> StageOutput:
    """Export `checkpoint` (a no-op when it was exported with these settings): a drafter shaped by
    the target and drafter sections, its recipe the TTT settings of the train section."""
    checksum = file_sha256(checkpoint)
    out = checkpoint_output(ecfg, target_cfg, artifacts, checksum)
    with out.lock():
        if out.complete:
            log.info("%s already exported: %s", checkpoint, out.path)
            return out
        target = load_target_parts(target_cfg, artifacts)
        drafter = checkpoint_drafter(drafter_cfg, checkpoint, target)
        recipe = {
            "checkpoint": str(checkpoint),
            "checkpoint_sha256": checksum,
            "ttt_length": tcfg.ttt_length,
            "step_decay": tcfg.step_decay,
            "target": target_key(target_cfg),
        }
        drafter.config.recipe = recipe
        out.start()
        folders = export_drafter(ecfg, target_cfg, drafter, recipe, out.path)
        out.finish({"folders": sorted(folders)}, recipe=recipe)
    return out


@app
def main(cfg: Config) -> None:
    checkpoint = newest_checkpoint(chosen_checkpoint(cfg.export) or train_output(cfg).path)
    out = export_checkpoint(
        checkpoint, cfg.export, cfg.target, cfg.drafter, cfg.train, cfg.paths.artifacts
    )
    print(f"exported {out.manifest()['recipe']['checkpoint']}: {out.path}")
    for name in out.manifest().get("counts", {}).get("folders", []):
        print(f"  {name}: {out.path / name}")


if __name__ == "__main__":
    main()
