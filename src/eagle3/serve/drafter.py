"""Which exported drafter folder an engine loads for a speculation shape."""

from __future__ import annotations

from pathlib import Path

from eagle3.core.common import Eagle3Error
from eagle3.core.config import Config
from eagle3.core.outputs import (
    check_drafter_files,
    export_output,
    resolve_drafter_path,
    serving_folder,
)
from eagle3.core.spec import Spec
from eagle3.export.shipped import shipped_drafter, uses_shipped_drafter
from eagle3.serve.launch import untrained_fallback


def drafter_for(cfg: Config, spec: Spec) -> Path | None:
    """The exported drafter folder the engine loads (None: spec=off, or the local server's own
    untrained fallback)."""
    if not spec.enabled:
        return None
    # each engine reads custom aux-layer ids in its own convention; local reads any
    if uses_shipped_drafter(
        cfg.drafter.path, cfg.shipped, cfg.target, lambda: export_output(cfg).complete
    ):
        shipped = shipped_drafter(
            cfg.shipped, cfg.target, cfg.paths.artifacts, cfg.tracking, cfg.export
        )
        folder = serving_folder(shipped, cfg.serve.engine)
    else:
        try:
            folder = Path(resolve_drafter_path(cfg, engine=cfg.serve.engine))
        except Eagle3Error:
            if untrained_fallback(cfg.serve, cfg.drafter.path):
                return None
            raise
    check_drafter_files(folder, cfg.verify)
    return folder
