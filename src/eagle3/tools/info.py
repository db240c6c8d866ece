"""`python -m eagle3.tools.info`: the resolved config, the target's shape, where things live,
which engines are available; with drafter.path, the drafter's lineage (the trainings that made it)."""

from __future__ import annotations

import json
from pathlib import Path

from omegaconf import OmegaConf

from eagle3.core.common import CONF_DIR, app
from eagle3.core.config import Config, ServeConfig, ShippedConfig, plain
from eagle3.core.lineage import chain_to, lineage_lines, lineage_of
from eagle3.core.target import load_target
from eagle3.export.shipped import KEYWORD, asset_manifest, asset_path
from eagle3.serve.launch import engine_python


def engines_available(scfg: ServeConfig) -> dict[str, str]:
    """Whether each engine's interpreter is there, found as the launcher finds it: the configured
    serve.python for the engine in use (`scfg`), conf/serve/<engine>.yaml's for the others (a
    relative path is inside the eagle3 checkout, wherever the app runs from)."""
    found = {"local": "available"}
    for engine, make in (("vllm", "make vllm"), ("sglang", "make sglang")):
        settings = scfg if scfg.engine == engine else OmegaConf.load(serve_yaml(engine))
        python = Path(engine_python(settings))
        found[engine] = (
            f"venv found ({python})" if python.exists() else f"not installed: no {python} ({make})"
        )
    return found


def serve_yaml(engine: str) -> Path:
    return Path(CONF_DIR) / "serve" / f"{engine}.yaml"


def drafter_lineage(drafter_path: str, shipped: ShippedConfig) -> list[dict]:
    """The lineage of drafter.path: a drafter folder, or `shipped` (the drafter in assets/)."""
    if str(drafter_path) == KEYWORD:
        return chain_to(str(asset_manifest(asset_path(shipped))["hash"]))
    return lineage_of(drafter_path)


@app
def main(cfg: Config) -> None:
    summary = {name: plain(getattr(cfg, name)) for name in ("target", "drafter", "spec", "serve")}
    print("config:\n" + OmegaConf.to_yaml(summary))
    target = load_target(cfg.target, cfg.paths.artifacts)
    print(f"target {cfg.target.name}: {target.path}")
    print(
        f"  layers {target.num_layers}, hidden {target.hidden_size}, vocab {target.vocab_size}, "
        f"aux layer ids {target.aux_layer_ids}, dtype {next(target.model.parameters()).dtype}"
    )
    print(f"artifacts: {cfg.paths.artifacts}")
    print(f"mlflow: {cfg.tracking.uri}")
    print("engines: " + json.dumps(engines_available(cfg.serve)))
    if cfg.drafter.path:
        print(f"drafter {cfg.drafter.path}, lineage (oldest first):")
        print("\n".join(lineage_lines(drafter_lineage(cfg.drafter.path, cfg.shipped))))


if __name__ == "__main__":
    main()
