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
from eagle3.core.config import Config, plain
from eagle3.core.drafter_io import (
    ENGINES,
    MODELS_URI,
    RECIPE_KEY,
    download_registered,
    parse_models_uri,
    read_drafter_config,
)
from eagle3.core.target import target_key

# data.* options that add prompts (eagle3.data.added_prompts); off by default
MORE_PROMPTS = ("first_turn_copies", "extra_sources", "self_prompts")
# Settings that change how fast regeneration runs (or what it reports), not what it produces:
# outside the hash, so a rerun with another batch size or concurrency resumes the same output.
REGEN_EXECUTION_ONLY = (
    "batch_size",
    "concurrency",
    "timeout_s",
    "max_retries",
    "backoff_s",
    "api_key_env",
    "loop_ngram",
)


def data_output(cfg: Config) -> StageOutput:
    """The data stage's folder for this config (located, not run)."""
    sections = {**answer_sections(cfg), "draft_vocab_size": cfg.drafter.draft_vocab_size}
    fingerprint = source_fingerprint(str(cfg.data.source))
    if fingerprint:  # absent for packaged and hub sources: their hashes stay as they were
        sections["source_fingerprint"] = fingerprint
    if cfg.data.regenerate and cfg.data.regen.keep_truncated:  # absent when false, as before it
        sections["keep_truncated"] = True
    if (
        cfg.data.vocab_map_from is not None
    ):  # absent when null: the hashes of outputs from before the key
        sections["vocab_map_from"] = str(cfg.data.vocab_map_from)
    return stage_output(cfg.paths.artifacts, "data", sections)


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


def answer_sections(cfg: Config) -> dict:
    """What the conversations and their regenerated answers depend on: the target and the data config
    (not the draft vocab's source)."""
    data = plain(cfg.data)
    data.pop("vocab_map_from", None)
    for key in MORE_PROMPTS:  # absent when off: the hashes of answers from before these keys
        if not data.get(key):
            data.pop(key, None)
    data["regen"] = {k: v for k, v in data["regen"].items() if k not in REGEN_EXECUTION_ONLY}
    for key in (
        "reuse_answers",
        "seed",
        "reasoning",
        "reasoning_parser",
    ):  # absent when null: the hashes of answers from before these keys
        if data["regen"].get(key) is None:
            data["regen"].pop(key, None)
    # which answers a data output keeps, not what they are (data_output); the tags and the template
    # switch only where the reasoning mode reads them
    data["regen"].pop("keep_truncated", None)
    if data["regen"].get("reasoning") not in ("keep", "drop"):
        data["regen"].pop("think_tags", None)
    if data["regen"].get("reasoning") != "off":
        data["regen"].pop("thinking_switch", None)
    if data["regen"].get("backend") == "engine":  # the engine and its precision write the answers
        data["regen"]["served_by"] = {
            "engine": cfg.serve.engine,
            "dtype": getattr(cfg.serve, "dtype", None),
        }
    return {"target": target_key(cfg.target), "data": data}


# How fast extraction runs, not what it writes: outside the hash.
EXECUTION_ONLY = (
    "batch_tokens",
    "verify",
    "disk_margin",
    "writers",
    "concurrency",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "engine",
)


def extract_output(cfg: Config) -> StageOutput:
    """The extract stage's folder for this config (located, not run)."""
    section = {k: v for k, v in plain(cfg.extract).items() if k not in EXECUTION_ONLY}
    if section.get("backend") == "hf":  # the hash of an HF extraction predates the backends
        del section["backend"]
    # the precision the target runs in changes the states (target_key leaves it out)
    if cfg.extract.backend == "vllm":
        compute = str(cfg.extract.engine.dtype)
    else:
        compute = str(resolve_dtype(cfg.target.dtype, resolve_device(cfg.target.device)))
    compute = compute.removeprefix("torch.")
    return stage_output(
        cfg.paths.artifacts,
        "extract",
        {"extract": section, "compute_dtype": compute},
        {"data": data_output(cfg).hash},
    )


# train.* fields that change how training is watched or where it reads, not what it learns.
HASH_EXCLUDED = (
    "eval_prompts",
    "eval_max_new_tokens",
    "checkpoint_every_n_steps",
    "shards",
    "val_head_tokens",
    "compile_loss",
    "compile_unroll",
    "compile_target",
    "length_buckets",
    "adamw",
)


def upstream_hashes(cfg: Config) -> dict:
    upstream = {"data": data_output(cfg).hash}
    if cfg.train.hidden_states == "offline":
        upstream["extract"] = shards_output(cfg).hash
    if cfg.train.hidden_states == "engine":  # the capture settings that make the states
        upstream["capture"] = extract_output(cfg).hash
    return upstream


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
    """The train stage's folder for this config (located, not run)."""
    train = {k: v for k, v in plain(cfg.train).items() if k not in HASH_EXCLUDED}
    for key in ("init_from", "limit"):  # null: the hashes of runs from before these keys
        if train.get(key) is None:
            train.pop(key, None)
    drafter = {k: v for k, v in plain(cfg.drafter).items() if k != "path"}
    sections = {
        "drafter": drafter,
        "train": train,
        "target": target_key(cfg.target),
        "seed": cfg.seed,
    }
    return stage_output(cfg.paths.artifacts, "train", sections, upstream_hashes(cfg))


# export.* fields that do not change what an export writes: where it is registered, and the
# checkpoint `python -m eagle3.export.checkpoint` reads.
HASH_EXCLUDED_EXPORT = ("register", "registry_name", "checkpoint")


def export_output(cfg: Config) -> StageOutput:
    """Where the current config's export lives (upstream: the training stage's hash)."""
    sections = {
        "export": {k: v for k, v in plain(cfg.export).items() if k not in HASH_EXCLUDED_EXPORT}
    }
    return stage_output(cfg.paths.artifacts, "export", sections, {"train": train_output(cfg).hash})


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
            folder / n for n in ENGINES if n not in names and neutral(folder / n / "config.json")
        ]
        if not found:
            wanted = " or ".join(f"{n}/config.json" for n in names)
            raise Eagle3Error(f"{folder} holds no drafter for serve={engine} (no {wanted})")
        chosen = found[0]
    if not any(any(chosen.glob(pattern)) for pattern in ("*.safetensors", "*.bin", "*.pt")):
        raise Eagle3Error(f"{chosen} has a config.json but no weights: an incomplete export")
    convention = read_config(chosen).get(RECIPE_KEY, {}).get("aux_convention")
    if (
        engine in ENGINES
        and convention in ENGINES
        and convention != engine
        and not neutral(chosen / "config.json")
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


def neutral(config_path: Path) -> bool:
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
