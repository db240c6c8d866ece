"""Stage outputs keyed by config: <artifacts>/<stage>/<hash>/ with a manifest.json.

The hash covers the config sections a stage depends on plus its upstream hashes, so
the whole recipe of an artifact is its config. The manifest's `complete` flag is
written last: a folder without it is half-written and gets resumed, never reused.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import subprocess
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from eagle3.redact import mask

TRACKED_PACKAGES = (
    "eagle3",
    "torch",
    "transformers",
    "lightning",
    "safetensors",
    "datasets",
    "mlflow",
)


def to_plain(section: Any) -> Any:
    """A resolved plain-python copy of a config section (or a value as it is)."""
    if isinstance(section, DictConfig) or OmegaConf.is_config(section):
        return OmegaConf.to_container(section, resolve=True)
    return section


def config_hash(*parts: Any) -> str:
    """Stable 12-hex-digit hash of config sections and upstream hashes."""
    text = json.dumps([to_plain(p) for p in parts], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def package_versions() -> dict[str, str]:
    versions = {}
    for name in TRACKED_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return versions


SOURCE_ROOT = Path(__file__).resolve().parents[2]  # the checkout (or bundled source) holding src/
COMMIT_FILE = "GIT_COMMIT"  # written into a bundle's source by eagle3.bundle


def git_commit(cwd: Path | None = None) -> str | None:
    """HEAD's commit, with `-dirty` when tracked files differ from it (the code that ran is then
    not that commit: a working tree copied without its history, edits in progress). Source
    unpacked from a bundle has no history: the commit it was packed from is in its COMMIT_FILE."""
    packed = SOURCE_ROOT / COMMIT_FILE
    if cwd is None and packed.exists():
        return packed.read_text().strip() or None

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", *args],
                cwd=cwd or Path(__file__).parent,
                capture_output=True,
                text=True,
                timeout=10,
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if not commit:
        return None
    changed = git("status", "--porcelain", "--untracked-files=no")
    return f"{commit}-dirty" if changed else commit


@dataclass
class StageOutput:
    """One stage's output folder."""

    stage: str
    hash: str
    path: Path
    config: dict
    upstream: dict

    @property
    def manifest_path(self) -> Path:
        return self.path / "manifest.json"

    def manifest(self) -> dict:
        if not self.manifest_path.exists():
            return {}
        return json.loads(self.manifest_path.read_text())

    @property
    def complete(self) -> bool:
        return bool(self.manifest().get("complete"))

    def start(self) -> Path:
        """Create the folder (keeping what a previous, interrupted run wrote) and mark it incomplete."""
        self.path.mkdir(parents=True, exist_ok=True)
        previous = self.manifest()
        self._write({**self._base(), "started": previous.get("started", _now()), "complete": False})
        return self.path

    @contextlib.contextmanager
    def lock(self):
        """Hold an exclusive lock on this output (a file beside its folder) for the block: jobs
        running at once (a parallel launcher) take turns, so one writes and the others read."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.parent / f"{self.path.name}.lock", "a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield self
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def finish(self, counts: dict | None = None, **extra: Any) -> None:
        manifest = {**self.manifest(), **self._base(), **extra}
        manifest.update(counts=counts or {}, finished=_now(), complete=True)
        self._write(manifest)

    def _base(self) -> dict:
        return {
            "stage": self.stage,
            "hash": self.hash,
            "upstream": self.upstream,
            "config": self.config,
            "versions": package_versions(),
            "git_commit": git_commit(),
        }

    def _write(self, manifest: dict) -> None:
        tmp = self.manifest_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(manifest, indent=2, default=str))
        tmp.replace(self.manifest_path)


def stage_output(
    artifacts_dir: str | Path, stage: str, sections: dict, upstream: dict | None = None
) -> StageOutput:
    """The output folder of `stage` for these config sections and upstream hashes (secrets are
    masked: they neither reach the manifest nor change the hash)."""
    upstream = dict(upstream or {})
    config = mask({name: to_plain(section) for name, section in sections.items()})
    digest = config_hash(config, upstream)
    return StageOutput(stage, digest, Path(artifacts_dir) / stage / digest, config, upstream)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")
