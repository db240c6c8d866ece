"""Where each stage's output lives for a config (located, never run): every stage and the
pipeline find their upstream folders here, so no stage imports a later one to find its input."""

from __future__ import annotations

import hashlib
from pathlib import Path

from eagle3.core.artifacts import (
    StageOutput,
    check_listed_files,
    check_safetensors,
    read_json,
    stage_output,
)
from eagle3.core.common import Eagle3Error, resolve_device, resolve_dtype
from eagle3.core.config import Config, DataConfig, ServeConfig, TargetConfig, plain
from eagle3.core.drafter_io import (
    ENGINES,
    MODELS_URI,
    RECIPE_KEY,
    download_registered,
    parse_models_uri,
    read_drafter_config,
)
from eagle3.core.hash_schema import hashed
from eagle3.core.target import target_key


def data_output(cfg: Config) -> StageOutput:
    """The data stage's folder for this config (located, not run)."""
    data = cfg.data
    values = {
        **answer_values(data, cfg.target, cfg.serve),
        "draft_vocab_size": cfg.drafter.draft_vocab_size,
        "source_fingerprint": source_fingerprint(str(data.source)),
        "keep_truncated": bool(data.regenerate and data.regen.keep_truncated),
        "vocab_map_from": None if data.vocab_map_from is None else str(data.vocab_map_from),
    }
    return stage_output(cfg.paths.artifacts, "data", hashed("data", values))


def source_fingerprint(source: str) -> dict | None:
    """Size and sha256 (streamed) of a local source file, so an edited file gets a new data hash;
    None for a packaged or hub source. Remembered per path, size and modification time."""
    path = Path(source).expanduser()
    if not path.is_file():
        return None
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if key not in _FINGERPRINTS:
        with open(path, "rb") as handle:
            digest = hashlib.file_digest(handle, "sha256").hexdigest()
        _FINGERPRINTS[key] = {"size": stat.st_size, "sha256": digest}
    return _FINGERPRINTS[key]


_FINGERPRINTS: dict[tuple, dict] = {}


def answer_sections(data: DataConfig, target: TargetConfig, serve: ServeConfig) -> dict:
    """What the conversations and their regenerated answers depend on (the key of their shared
    log, eagle3.data.regen): the target and the data config (not the draft vocab's source), with
    the serving settings' engine and precision (answer_values)."""
    return hashed("answers", answer_values(data, target, serve))


def answer_values(data: DataConfig, target: TargetConfig, serve: ServeConfig) -> dict:
    """The target's identity and the data config, with the engine and precision that would write
    the answers (data.regen.served_by); the hash schema picks what counts."""
    values = plain(data)
    values["regen"]["served_by"] = {"engine": serve.engine, "dtype": getattr(serve, "dtype", None)}
    return {"target": target_key(target), "data": values}


def extract_output(cfg: Config) -> StageOutput:
    """The extract stage's folder for this config (located, not run)."""
    # the precision the target runs in changes the states (target_key leaves it out)
    if cfg.extract.backend == "vllm":
        compute = str(cfg.extract.engine.dtype)
    else:
        compute = str(resolve_dtype(cfg.target.dtype, resolve_device(cfg.target.device)))
    values = {"extract": plain(cfg.extract), "compute_dtype": compute.removeprefix("torch.")}
    upstream = {"data": data_output(cfg).hash}
    return stage_output(cfg.paths.artifacts, "extract", hashed("extract", values), upstream)


def shards_output(cfg: Config) -> StageOutput:
    """The extract stage output training reads: train.shards if set, else this config's."""
    expected = extract_output(cfg)
    if not cfg.train.shards:
        return expected
    path = Path(str(cfg.train.shards))
    manifest_path = path / "manifest.json"
    if not manifest_path.exists():
        raise Eagle3Error(f"train.shards={path} has no manifest.json: not an extract output folder")
    manifest = read_json(manifest_path, "rerun `python -m eagle3.extract` for that folder")
    return StageOutput(
        "extract",
        manifest.get("hash", "unknown"),
        path,
        manifest.get("config", {}),
        manifest.get("upstream", {}),
    )


def train_output(cfg: Config) -> StageOutput:
    """The train stage's folder for this config (located, not run): upstream the data, and the
    hidden states it reads (offline: the extract output; engine: the capture settings)."""
    values = {
        "drafter": plain(cfg.drafter),
        "train": plain(cfg.train),
        "target": target_key(cfg.target),
        "seed": cfg.seed,
    }
    upstream = {"data": data_output(cfg).hash}
    if cfg.train.hidden_states == "offline":
        upstream["extract"] = shards_output(cfg).hash
    if cfg.train.hidden_states == "engine":
        upstream["capture"] = extract_output(cfg).hash
    return stage_output(cfg.paths.artifacts, "train", hashed("train", values), upstream)


def export_output(cfg: Config) -> StageOutput:
    """Where the current config's export lives (upstream: the training stage's hash)."""
    values = {"export": plain(cfg.export)}
    upstream = {"train": train_output(cfg).hash}
    return stage_output(cfg.paths.artifacts, "export", hashed("export", values), upstream)


def resolve_drafter_path(cfg: Config, engine: str = "sglang") -> Path:
    """The drafter folder `engine` (sglang | vllm | local) serves: drafter.path (a folder or
    models:/NAME/VERSION), else the export of the current config. A whole export gives the
    engine's own subfolder, never another engine's (their aux-layer ids differ); a half-written
    export is refused whether found by path or by hash."""
    path = cfg.drafter.path
    if path and str(path).startswith(MODELS_URI):
        name, version = parse_models_uri(str(path))
        folder = download_registered(
            str(path), cfg.tracking.uri, Path(cfg.paths.artifacts) / "registry" / name / version
        )
        return serving_folder(folder, engine)
    if path:
        folder = Path(str(path)).expanduser()
        if not folder.exists():
            raise Eagle3Error(f"drafter.path={path} does not exist")
        return serving_folder(folder, engine)
    out = export_output(cfg)
    if not out.complete:
        raise Eagle3Error(
            "no exported drafter for this config: run `python -m eagle3.pipeline`, or "
            "`python -m eagle3.train` then `python -m eagle3.export` (or set drafter.path=...)"
        )
    return serving_folder(out.path, engine)


# The subfolders of a whole export each engine may load, in order of preference.
ENGINE_SUBFOLDERS = {
    "sglang": ("sglang",),
    "vllm": ("vllm", "speculators"),
    "local": ("sglang", "vllm", "speculators"),
}


def serving_folder(folder: Path, engine: str) -> Path:
    """The folder `engine` loads from `folder` (a drafter folder or a whole export), refused when
    half-written or when it writes aux-layer ids in another engine's convention. Another engine's
    folder that writes no aux-layer ids (the engines' default layers) reads the same everywhere."""
    refuse_incomplete(folder)
    if (folder / "config.json").exists():
        chosen = folder
    else:
        names = ENGINE_SUBFOLDERS.get(engine, (engine,))
        found = [folder / n for n in names if (folder / n / "config.json").exists()]
        found += [
            folder / n
            for n in ENGINES
            if n not in names and writes_no_aux_layer_ids(folder / n / "config.json")
        ]
        if not found:
            looked_for = " or ".join(f"{n}/config.json" for n in names)
            raise Eagle3Error(f"{folder} holds no drafter for serve={engine} (no {looked_for})")
        chosen = found[0]
    if not any(any(chosen.glob(pattern)) for pattern in ("*.safetensors", "*.bin", "*.pt")):
        raise Eagle3Error(f"{chosen} has a config.json but no weights: an incomplete export")
    convention = read_config(chosen).get(RECIPE_KEY, {}).get("aux_convention")
    if (
        engine in ENGINES
        and convention in ENGINES
        and convention != engine
        and not writes_no_aux_layer_ids(chosen / "config.json")
    ):
        raise Eagle3Error(
            f"{chosen} was written for {convention} (aux-layer ids in {convention}'s convention); "
            f"serve={engine} needs the {engine}/ folder of the export"
        )
    return chosen


def check_drafter_files(folder: Path, verify: bool) -> None:
    """Before an engine starts: every weight file of the drafter folder holds what its header
    promises, and the files its export's manifest lists are as written (sizes; sha256 with verify)."""
    for weights in sorted(folder.glob("*.safetensors")):
        check_safetensors(weights)
    for root, under in ((folder, ""), (folder.parent, folder.name)):
        manifest = root / "manifest.json"
        if manifest.exists():
            listed = read_json(manifest, "export the drafter again")
            check_listed_files(root, listed, verify, "python -m eagle3.export", under)
            return


def read_config(folder: Path) -> dict:
    return read_drafter_config(folder)


def writes_no_aux_layer_ids(config_path: Path) -> bool:
    """A drafter config that writes no aux-layer ids: every engine reads it the same way."""
    if not config_path.exists():
        return False
    raw = read_drafter_config(config_path.parent)
    nested = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return not nested and not raw.get("eagle_aux_hidden_state_layer_ids")


def refuse_incomplete(folder: Path) -> None:
    """A folder being written (*.partial) or inside an export whose manifest says incomplete."""
    if folder.name.endswith(".partial"):
        raise Eagle3Error(f"{folder} is a half-written export folder")
    for manifest in (folder / "manifest.json", folder.parent / "manifest.json"):
        if manifest.exists() and not read_json(manifest, "export the drafter again").get(
            "complete"
        ):
            raise Eagle3Error(
                f"{folder} belongs to an incomplete export ({manifest} says complete: false): "
                "finish it with `python -m eagle3.export`"
            )


# Each stage's folder lookup, by stage name (the pipeline's plan and its skip test).
STAGE_OUTPUTS = {
    "data": data_output,
    "extract": extract_output,
    "train": train_output,
    "export": export_output,
}
