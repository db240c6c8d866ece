"""Stage outputs keyed by config: <artifacts>/<stage>/<hash>/ with a manifest.json.

The hash covers the config sections a stage depends on plus its upstream hashes, so
the whole recipe of an artifact is its config. The manifest's `complete` flag is
written last: a folder without it is half-written and gets resumed, never reused. A finished
manifest lists every file of the folder with its size and sha256, so a file cut short or
changed later is caught before it is read (sizes always, checksums with `verify=true`).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from eagle3.core.common import Eagle3Error, log
from eagle3.core.config import plain
from eagle3.core.redact import mask

TRACKED_PACKAGES = (
    "eagle3",
    "torch",
    "transformers",
    "lightning",
    "safetensors",
    "datasets",
    "mlflow",
)


def config_hash(*parts: Any) -> str:
    """Stable 12-hex-digit hash of config sections and upstream hashes."""
    text = json.dumps([plain(p) for p in parts], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def package_versions() -> dict[str, str]:
    versions = {}
    for name in TRACKED_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return versions


SOURCE_ROOT = Path(__file__).resolve().parents[3]  # the checkout (or bundled source) holding src/
COMMIT_FILE = "GIT_COMMIT"  # written into a bundle's source by eagle3.tools.bundle


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


def read_json(path: Path, redo: str = "") -> Any:
    """A JSON file's content; one line naming the file (and `redo`, how to make it again) when it
    is cut short, damaged or not text."""
    try:
        return json.loads(Path(path).read_text())
    except json.JSONDecodeError as err:
        problem = f"is not valid JSON ({err.msg} at line {err.lineno} column {err.colno})"
    except UnicodeDecodeError as err:
        problem = f"is not a JSON text file ({err.reason} at byte {err.start})"
    raise Eagle3Error(f"{path} {problem}: cut short or damaged" + (f"; {redo}" if redo else ""))


@contextlib.contextmanager
def folder_lock(folder: Path) -> Iterator[None]:
    """Hold an exclusive flock on `<folder>.lock` (beside the folder) for the block. Processes
    that build the same folder at once take turns; the kernel drops the lock of one that dies."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f"{folder.name}.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


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
        return read_json(
            self.manifest_path,
            f"remove {self.path} and rerun `python -m eagle3.{self.stage}` to redo the output",
        )

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
        with folder_lock(self.path):
            yield self

    def finish(self, counts: dict | None = None, **extra: Any) -> None:
        manifest = {**self.manifest(), **self._base(), **extra}
        manifest.update(counts=counts or {}, files=file_records(self.path), finished=_now())
        manifest["complete"] = True
        self._write(manifest)

    def check_files(self, verify: bool) -> None:
        """Refuse this finished output when a file its manifest lists is missing, has another size
        or (verify) another sha256, naming the file and how to redo the output."""
        check_listed_files(self.path, self.manifest(), verify, f"python -m eagle3.{self.stage}")

    def reusable(self, verify: bool) -> bool:
        """Whether a run finds this output finished and reuses it: its files are checked against
        the manifest first (check_files)."""
        if not self.complete:
            return False
        self.check_files(verify)
        log.info("%s: %s is complete, nothing to do", self.stage, self.path)
        return True

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
    config = mask({name: plain(section) for name, section in sections.items()})
    digest = config_hash(config, upstream)
    return StageOutput(stage, digest, Path(artifacts_dir) / stage / digest, config, upstream)


# Files of an output folder that are not part of what it holds.
UNLISTED = ("manifest.json", "manifest.tmp")


def file_sha256(path: Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def file_records(folder: Path) -> dict[str, dict]:
    """{path inside the folder: {"size", "sha256"}} of every file an output holds."""
    return {
        path.relative_to(folder).as_posix(): {
            "size": path.stat().st_size,
            "sha256": file_sha256(path),
        }
        for path in sorted(folder.rglob("*"))
        if path.is_file() and path.relative_to(folder).as_posix() not in UNLISTED
    }


def check_listed_files(
    folder: Path, manifest: dict, verify: bool, redo: str, under: str = ""
) -> None:
    """The files `manifest` lists (those under the subfolder `under`, if given) as they were
    written: sizes always, sha256 with verify. An output from before file lists has none to check."""
    for name, record in (manifest.get("files") or {}).items():
        if under and not name.startswith(f"{under}/"):
            continue
        path = folder / name
        problem = listed_file_problem(path, record, verify)
        if problem:
            raise Eagle3Error(
                f"{path} {problem}; the output {folder} is damaged: remove that folder and rerun "
                f"`{redo}` to redo it"
            )


def listed_file_problem(path: Path, record: dict, verify: bool) -> str | None:
    if not path.is_file():
        return "is missing"
    size = path.stat().st_size
    if size != record["size"]:
        return (
            f"has {size:,} bytes where its manifest says {record['size']:,} (cut short or changed)"
        )
    if verify and file_sha256(path) != record["sha256"]:
        return "differs from the sha256 its manifest records (changed after it was written)"
    return None


def check_safetensors(path: Path) -> None:
    """A safetensors file holds every byte its own header promises (one cut short fails here, not
    inside an engine), and its header is one safetensors reads (an entry overwritten in place keeps
    the size but not the header: named here too)."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as handle:
            length = int.from_bytes(handle.read(8), "little")
            header = json.loads(handle.read(length)) if 8 + length <= size else None
    except (OSError, ValueError):  # a UnicodeDecodeError or JSONDecodeError is a ValueError
        header = None
    if not isinstance(header, dict):
        raise Eagle3Error(f"{path} is not a readable safetensors file (its header is cut or bad)")
    ends = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(isinstance(o, int) for o in offsets)
        ):
            raise Eagle3Error(
                f"{path} is not a readable safetensors file: its header's entry {name!r} has no "
                "data offsets (the header was overwritten or damaged); copy or export it again"
            )
        ends.append(offsets[1])
    expected = 8 + length + max(ends, default=0)
    if size < expected:
        raise Eagle3Error(
            f"{path} has {size:,} bytes where its header promises {expected:,}: the file was cut "
            "short; copy or export it again"
        )
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt"):
            pass  # safetensors' own header checks: dtypes, shapes against offsets, their order
    except Exception as err:  # SafetensorError and the like: the file's fault, named below
        raise Eagle3Error(
            f"{path} is not a readable safetensors file ({err}): the header was overwritten or "
            "damaged; copy or export it again"
        ) from None


def load_safetensors(path: Path | str) -> dict:
    """safetensors.torch.load_file, one line naming the file when it cannot be read."""
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except Exception as err:  # SafetensorError, a header that is not JSON, ...
        if isinstance(err, FileNotFoundError):
            raise
        raise Eagle3Error(
            f"{path} is not a readable safetensors file ({type(err).__name__}: {err}): cut short, "
            "overwritten or damaged; copy or make it again"
        ) from None


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")
