"""Planning a pipeline before anything runs: how large the target is, which stages would load it
into one process, what the offline shards will take on disk, and the engine commands the stages
start themselves. The pipeline's dry run prints it; a plan that loads a target larger than one
process can hold is refused, naming the setting to change.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from eagle3.common import Eagle3Error
from eagle3.extract import STORAGE_DTYPES
from eagle3.extract_vllm import text_config
from eagle3.outputs import data_output
from eagle3.target import resolve_target_path


def target_weights_gb(cfg: DictConfig) -> float | None:
    """target.plan.weights_gb, else the size of the target folder's weight files (None: unknown,
    a hub id with no plan)."""
    hint = (cfg.target.get("plan") or {}).get("weights_gb")
    if hint is not None:
        return float(hint)
    path = resolve_target_path(cfg.target, Path(cfg.paths.artifacts))
    if not isinstance(path, Path):
        return None
    files = [*path.glob("*.safetensors"), *path.glob("*.bin")]
    return sum(f.stat().st_size for f in files) / 1e9


def in_process_loads(cfg: DictConfig) -> list[tuple[str, str]]:
    """(setting, what it does) for every planned stage that loads the whole target in one process."""
    stages = list(cfg.pipeline.stages)
    loads = []
    if "data" in stages and cfg.data.regenerate and cfg.data.regen.backend == "local":
        loads.append(("data.regen.backend=local", "regenerates answers with HF generate"))
    online = cfg.train.hidden_states == "online"
    if "extract" in stages and not online and cfg.extract.backend == "hf":
        loads.append(("extract.backend=hf", "captures hidden states with the HF target"))
    if "train" in stages and online:
        loads.append(("train.hidden_states=online", "runs the HF target inside each training step"))
    return loads


def check_process_fit(cfg: DictConfig) -> float | None:
    """Refuse a plan that loads a target larger than pipeline.process_memory_gb into one process."""
    weights = target_weights_gb(cfg)
    limit = float(cfg.pipeline.process_memory_gb)
    if weights is None or weights <= limit:
        return weights
    for setting, action in in_process_loads(cfg):
        raise Eagle3Error(
            f"{setting} {action} in one process, but target {cfg.target.name} has {weights:,.0f} GB "
            f"of weights and one process holds pipeline.process_memory_gb={limit:g}: use "
            "extract.backend=vllm, data.regen.backend=engine and train.hidden_states=offline"
        )
    return weights


def shard_bytes_per_token(hidden: int, itemsize: int) -> int:
    """aux [3H] + last [H] states, an int32 token id and an int8 loss-mask entry."""
    return 4 * hidden * itemsize + 4 + 1


def planned_tokens(cfg: DictConfig) -> tuple[int, bool]:
    """(tokens of the extracted splits, exact): the data output's counts when it exists, else the
    upper bound data.limit x data.max_length."""
    out = data_output(cfg)
    if out.complete:
        counts = out.manifest().get("counts", {})
        return sum(int(counts.get(f"{s}_tokens", 0)) for s in cfg.extract.splits), True
    if cfg.data.limit is None:
        return 0, False
    return int(cfg.data.limit) * int(cfg.data.max_length), False


def target_hidden_size(cfg: DictConfig) -> int:
    hint = (cfg.target.get("plan") or {}).get("hidden_size")
    if hint is not None:
        return int(hint)
    return int(
        text_config(resolve_target_path(cfg.target, Path(cfg.paths.artifacts)))["hidden_size"]
    )


def disk_lines(cfg: DictConfig) -> list[str]:
    itemsize = STORAGE_DTYPES[cfg.extract.dtype].itemsize
    hidden = target_hidden_size(cfg)
    per_token = shard_bytes_per_token(hidden, itemsize)
    tokens, exact = planned_tokens(cfg)
    total = (
        f"{tokens:,} tokens"
        if exact
        else f"at most {tokens:,} tokens (data.limit x data.max_length)"
    )
    return [
        f"    shards: 4 x {hidden} x {itemsize} B + 5 B = {per_token / 1e3:,.1f} kB per token; "
        f"{total} -> {tokens * per_token / 1e12:,.3f} TB"
    ]
