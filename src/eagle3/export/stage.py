"""The export stage: the trained drafter in the folders the engines load, registered in the MLflow
model registry; `python -m eagle3.export` (app.py) runs it. The formats, their key and shape checks
and the engines' aux-layer conventions live in `eagle3.core.drafter_io`.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from eagle3.core.artifacts import StageOutput
from eagle3.core.common import Eagle3Error, log
from eagle3.core.config import Config, ExportConfig, TargetConfig, TrainConfig, plain
from eagle3.core.drafter import Eagle3Drafter
from eagle3.core.drafter_io import (
    ENGINES,
    MODELS_URI,
    check_drafter_for_target,
    export_sglang,
    export_speculators,
    load_trained_drafter,
)
from eagle3.core.lineage import lineage_for_export
from eagle3.core.outputs import export_output, train_output
from eagle3.core.target import target_key
from eagle3.core.target_parts import load_target_parts
from eagle3.core.tracking import client, flatten, stage_run

# ---------------------------------------------------------------- MLflow model registry


def registry_name(ecfg: ExportConfig, tcfg: TargetConfig) -> str:
    """eagle3-<target>: the target's config name, or its folder / hub id for target=hf."""
    if ecfg.registry_name:
        return ecfg.registry_name
    name = tcfg.name if tcfg.kind != "hf" else Path(str(tcfg.path)).name
    return "eagle3-" + re.sub(r"[^A-Za-z0-9_.-]+", "-", name)


def register_export(registry, name: str, target_name: str, folder: Path, recipe: dict, run) -> str:
    """Log the export's engine folders to the stage's MLflow run and register them under `name` with
    `registry` (an MlflowClient); returns the version."""
    import mlflow

    for engine_dir in sorted(p for p in folder.iterdir() if (p / "config.json").exists()):
        mlflow.log_artifacts(str(engine_dir), artifact_path=f"drafter/{engine_dir.name}")
    if not registry.search_registered_models(filter_string=f"name='{name}'"):
        registry.create_registered_model(
            name, description=f"EAGLE-3 drafters for target {target_name}"
        )
    tags = {f"recipe.{k}": str(v)[:5000] for k, v in flatten(plain(recipe)).items()}
    tags["tau_hat"] = str(recipe.get("tau_hat"))
    version = registry.create_model_version(
        name, source=mlflow.get_artifact_uri("drafter"), run_id=run.info.run_id, tags=tags
    )
    log.info("registered %s version %s", name, version.version)
    return str(version.version)


# ---------------------------------------------------------------- the export stage


def vocab_map_hash(drafter: Eagle3Drafter) -> str:
    digest = hashlib.sha256(
        drafter.d2t.cpu().numpy().tobytes() + drafter.t2d.cpu().numpy().tobytes()
    )
    return digest.hexdigest()[:12]


def build_recipe(
    tcfg: TrainConfig,
    target_cfg: TargetConfig,
    drafter: Eagle3Drafter,
    train_manifest: dict,
    lineage: list,
) -> dict:
    """What made this drafter: TTT settings, vocab map and data hashes, τ̂, target identity, and its
    `lineage` (the trainings from its first weights to these)."""
    counts = train_manifest.get("counts", {})
    upstream = train_manifest.get("upstream", {})
    return {
        "ttt_length": tcfg.ttt_length,
        "step_decay": tcfg.step_decay,
        "vocab_map_hash": vocab_map_hash(drafter),
        "data_hash": upstream.get("data", counts.get("data_hash")),
        "train_hash": train_manifest.get("hash"),
        "tau_hat": counts.get("tau_hat"),
        "tokenizer_hash": counts.get("tokenizer_hash"),
        "target": target_key(target_cfg),
        "lineage": lineage,
    }


def export_drafter(
    ecfg: ExportConfig,
    target_cfg: TargetConfig,
    drafter: Eagle3Drafter,
    recipe: dict,
    out_dir: Path,
) -> dict[str, Path]:
    """All configured folders for one drafter: sglang/, vllm/ and (on request) speculators/ (whose
    verifier is the target)."""
    folders = {
        engine: export_sglang(
            drafter, out_dir / engine, recipe, engine, ecfg.dtype, ecfg.include_embedding
        )
        for engine in ENGINES
    }
    if ecfg.speculators:
        folders["speculators"] = export_speculators(
            drafter,
            out_dir / "speculators",
            recipe,
            ecfg.speculative_tokens,
            ecfg.dtype,
            ecfg.include_embedding,
            verifier=str(target_cfg.path or target_cfg.name),
        )
    return folders


def run(cfg: Config) -> StageOutput:
    """Export the drafter the current config trained (no-op when already exported)."""
    out = export_output(cfg)
    with out.lock():  # runs started at once (a parallel launcher): one builds, the others reuse
        if out.reusable(cfg.verify):
            return out
        trained = train_output(cfg)
        if not trained.complete:
            raise Eagle3Error(
                f"no trained drafter for this config at {trained.path}: run `python -m eagle3.train` "
                "first (or `python -m eagle3.pipeline`)"
            )
        trained.check_files(cfg.verify)
        target = load_target_parts(cfg.target, cfg.paths.artifacts)
        drafter = load_trained_drafter(trained.path, target).cpu()
        manifest = trained.manifest()
        lineage = lineage_for_export(cfg.data, cfg.train, manifest, out.hash)
        recipe = build_recipe(cfg.train, cfg.target, drafter, manifest, lineage)
        drafter.config.recipe = recipe
        check_drafter_for_target(drafter, target)
        out.start()
        with stage_run(cfg, "export", artifact_hash=out.hash) as mlflow_run:
            folders = export_drafter(cfg.export, cfg.target, drafter, recipe, out.path)
            name = registry_name(cfg.export, cfg.target)
            version = (
                register_export(
                    client(cfg.tracking), name, cfg.target.name, out.path, recipe, mlflow_run
                )
                if cfg.export.register and mlflow_run
                else None
            )
        out.finish(
            {"folders": sorted(folders), "tau_hat": recipe["tau_hat"]},
            recipe=recipe,
            registered=f"{MODELS_URI}{name}/{version}" if version else None,
        )
        return out
