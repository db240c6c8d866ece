"""`python -m eagle3.serve` runs the configured engine (local | vllm | sglang) in the foreground,
serving the target and the drafter this config exported (eagle3.serve.launch starts and stops it)."""

from __future__ import annotations

import time
from pathlib import Path

from eagle3.core.common import app
from eagle3.core.config import Config
from eagle3.core.spec import resolve_spec
from eagle3.core.target import target_path_for
from eagle3.serve.drafter import drafter_for
from eagle3.serve.launch import check_spec_for_engine, start_engine


@app
def main(cfg: Config) -> None:
    from hydra.core.hydra_config import HydraConfig

    spec = resolve_spec(cfg.spec)
    check_spec_for_engine(cfg.serve.engine, spec, cfg.serve.max_depth)
    folder = Path(HydraConfig.get().runtime.output_dir)
    engine = start_engine(cfg, spec, drafter_for(cfg, spec), target_path_for(cfg), folder)
    print(
        f"{cfg.serve.engine} serving {cfg.target.name} (spec {spec.label}) at {engine.base_url}; "
        f"log {engine.log_path}; Ctrl-C stops it",
        flush=True,
    )
    try:
        while engine.alive():
            time.sleep(1)
        raise engine.failure(f"{cfg.serve.engine} server exited with code {engine.proc.returncode}")
    except KeyboardInterrupt:
        pass
    finally:
        engine.stop(cfg.serve.stop_timeout_s)


if __name__ == "__main__":
    main()
