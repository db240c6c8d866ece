"""`python -m eagle3.serve` runs the configured engine (local | vllm | sglang) in the foreground,
serving the target and the drafter this config exported (eagle3.serve.launch starts and stops it)."""

from __future__ import annotations

import time
from pathlib import Path

from eagle3.core.common import Eagle3Error, app
from eagle3.core.config import Config, EngineConfig, ServeConfig
from eagle3.core.spec import Spec, resolve_spec
from eagle3.core.target import resolve_target_path
from eagle3.engine.schedule import schedule_for, shapes_line
from eagle3.serve.drafter import drafter_for
from eagle3.serve.launch import check_spec_for_engine, engine_setup, start_engine


def shapes(
    serve: ServeConfig, engine: EngineConfig, auto: bool, spec: Spec, drafter: Path | None
) -> str:
    """Which shape the engine runs at which batch size, checked before it starts: a schedule only
    where one is named (engine.schedule=<file>, spec=auto: `auto`), on the hardware and engine it
    was measured on; the other engines run one shape."""
    if serve.engine != "local":
        if auto:
            raise Eagle3Error(
                f"spec=auto runs a load sweep's schedule on serve=local; serve={serve.engine} "
                "runs one shape: give spec=... (the schedule.json lists its flags per batch size)"
            )
        return shapes_line(None, spec)
    source = str(drafter) if drafter else ("untrained" if spec.enabled else None)
    return shapes_line(schedule_for(engine.schedule, auto, spec, source), spec)


@app
def main(cfg: Config) -> None:
    from hydra.core.hydra_config import HydraConfig

    spec = resolve_spec(cfg.spec)
    check_spec_for_engine(cfg.serve.engine, spec, cfg.serve.max_depth)
    folder = Path(HydraConfig.get().runtime.output_dir)
    drafter = drafter_for(cfg, spec)
    plan = shapes(cfg.serve, cfg.engine, cfg.spec.schedule, spec, drafter)
    engine = start_engine(
        engine_setup(cfg),
        spec,
        drafter,
        resolve_target_path(cfg.target, cfg.paths.artifacts),
        folder,
    )
    try:  # from the moment the engine runs: a stop signal at any point ends in engine.stop()
        print(plan, flush=True)
        print(
            f"{cfg.serve.engine} serving {cfg.target.name} (spec {spec.label}) at {engine.base_url}; "
            f"log {engine.log_path}; Ctrl-C stops it",
            flush=True,
        )
        while engine.alive():
            time.sleep(1)
        raise engine.failure(f"{cfg.serve.engine} server exited with code {engine.proc.returncode}")
    except KeyboardInterrupt:
        pass
    finally:
        engine.stop(cfg.serve.stop_timeout_s)


if __name__ == "__main__":
    main()
