"""Planning a pipeline before anything runs: how large the target is, which stages would load it
into one process, what the offline shards will take on disk, and the engine commands the stages
start themselves. The pipeline's dry run prints it; a plan that loads a target larger than one
process can hold is refused, naming the setting to change.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from eagle3.core.common import Eagle3Error, resolve_dtype
from eagle3.core.config import Config, plain
from eagle3.core.drafter import Eagle3Drafter, drafter_config
from eagle3.core.outputs import data_output
from eagle3.core.target import default_aux_layer_ids, folder_text_config, resolve_target_path
from eagle3.extract.app import STORAGE_DTYPES
from eagle3.extract.vllm_capture import text_config
from eagle3.pipeline.plan_shapes import active_params, checkpoint_bytes, kv_bytes_per_token


def target_weights_gb(cfg: Config) -> float | None:
    """target.plan.weights_gb; else, for a target planned from target.plan.config, its weights at
    the dtypes target.plan.storage says they are stored in; else the size of the target folder's
    weight files (None: unknown, a hub id with no plan)."""
    hint = cfg.target.plan or {}
    if hint.get("weights_gb") is not None:
        return float(hint["weights_gb"])
    if hint.get("config") is not None:
        return checkpoint_bytes(plain(hint["config"]), plain(hint["storage"])) / 1e9
    path = resolve_target_path(cfg.target, Path(cfg.paths.artifacts))
    if not isinstance(path, Path):
        return None
    files = [*path.glob("*.safetensors"), *path.glob("*.bin")]
    return sum(f.stat().st_size for f in files) / 1e9


def in_process_loads(cfg: Config) -> list[tuple[str, str]]:
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


def check_process_fit(cfg: Config) -> float | None:
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


def planned_tokens(cfg: Config) -> tuple[int, bool]:
    """(tokens of the extracted splits, exact): the data output's counts when it exists, else the
    upper bound data.limit x data.max_length."""
    out = data_output(cfg)
    if out.complete:
        counts = out.manifest().get("counts", {})
        return sum(int(counts.get(f"{s}_tokens", 0)) for s in cfg.extract.splits), True
    if cfg.data.limit is None:
        return 0, False
    return int(cfg.data.limit) * int(cfg.data.max_length), False


def target_hidden_size(cfg: Config) -> int:
    hint = (cfg.target.plan or {}).get("hidden_size")
    if hint is not None:
        return int(hint)
    return int(
        text_config(resolve_target_path(cfg.target, Path(cfg.paths.artifacts)))["hidden_size"]
    )


def disk_lines(cfg: Config) -> list[str]:
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


# ---------------------------------------------------------------- per-stage resources


@dataclass
class StagePlan:
    """Where one stage runs and what it takes: GPU memory per GPU (parts in GB), the target tensors one
    host process holds, disk written, and the estimated time."""

    stage: str
    where: str
    gpu_parts: dict[str, float] = field(default_factory=dict)  # GB per GPU by what holds it
    gpu_note: str = ""
    host_gb: float = 0.0
    host_what: str = "no target tensors"
    disk_gb: float = 0.0
    hours: float | None = None
    time_note: str = ""

    def gpu_gb(self) -> float:
        return sum(self.gpu_parts.values())

    def lines(self, gpu_limit: float, host_limit: float) -> list[str]:
        lines = [f"      where: {self.where}"]
        if self.gpu_parts:
            parts = " + ".join(f"{name} {gb:,.1f}" for name, gb in self.gpu_parts.items())
            lines.append(
                f"      GPU memory per GPU: {parts} = {self.gpu_gb():,.1f} of {gpu_limit:g} GB"
                + (f" ({self.gpu_note})" if self.gpu_note else "")
            )
        lines.append(
            f"      host memory per process: {self.host_gb:,.2f} GB of the target ({self.host_what}); "
            f"one process holds pipeline.process_memory_gb={host_limit:g}"
        )
        lines.append(f"      disk: {self.disk_gb:,.1f} GB")
        hours = "unknown" if self.hours is None else f"{self.hours:,.2f} h"
        lines.append(f"      time: {hours}" + (f" ({self.time_note})" if self.time_note else ""))
        return lines

    def refusal(self, gpu_limit: float, host_limit: float) -> str | None:
        if self.gpu_parts and self.gpu_gb() > gpu_limit:
            parts = " + ".join(f"{name} {gb:,.1f}" for name, gb in self.gpu_parts.items())
            return (
                f"{self.stage} does not fit its GPUs: {parts} = {self.gpu_gb():,.1f} GB per GPU "
                f"> pipeline.plan.gpu_memory_gb={gpu_limit:g} ({self.where})"
            )
        if self.host_gb > host_limit:
            return (
                f"{self.stage} does not fit one host process: it holds {self.host_gb:,.2f} GB of the "
                f"target ({self.host_what}) > pipeline.process_memory_gb={host_limit:g}"
            )
        return None


def plan_settings(cfg: Config) -> Config:
    return cfg.pipeline.plan


def target_config(cfg: Config) -> dict:
    """The target's text config: target.plan.config (planned without downloading it), else the
    folder's config.json."""
    hint = (cfg.target.plan or {}).get("config")
    if hint is not None:
        return plain(hint)
    return folder_text_config(resolve_target_path(cfg.target, Path(cfg.paths.artifacts)))


def cpu_itemsize(cfg: Config) -> int:
    """Bytes per element of the target tensors a host process reads (target.dtype on the CPU)."""
    return resolve_dtype(cfg.target.dtype, torch.device("cpu")).itemsize


def engine_itemsize(dtype: str | None) -> int:
    return 4 if str(dtype) == "float32" else 2


def flag_value(args, flag: str) -> float | None:
    """The value after `flag` in an engine's extra_args, if given there."""
    args = [str(a) for a in args or []]
    return float(args[args.index(flag) + 1]) if flag in args[:-1] else None


def where(cfg: Config, stage: str, gpus: int) -> str:
    """Which machine runs the stage: a job of pipeline.launcher with conf/cluster's resources for its
    app, or the host that runs the pipeline."""
    if cfg.pipeline.launcher:
        res = getattr(cfg.cluster, stage, None) or cfg.cluster.job
        kind = cfg.cluster.constraint or "any"
        return (
            f"{cfg.pipeline.launcher} job, {res.nodes} node(s) ({kind}) x {res.gpus_per_node} GPU(s), "
            f"{res.tasks_per_node} task(s) per node"
        )
    return f"this host, {gpus} GPU(s)" if gpus else "this host, no GPU"


def engine_gpu(
    cfg: Config, config: dict, weights: float, gpus: int, fraction: float, dtype, tokens: int
) -> tuple[dict[str, float], str]:
    """GPU memory per GPU of a serving engine over `gpus` GPUs: the weights' share, the KV cache the
    engine keeps for `tokens` in flight (what fits in `fraction` of the GPU after the weights, at
    least one data.max_length sequence), and the rest of the GPU the engine leaves to activations
    and CUDA graphs."""
    gpu = float(plan_settings(cfg).gpu_memory_gb)
    per_token, latent = kv_bytes_per_token(config, engine_itemsize(dtype))
    per_gpu_token = per_token if latent else per_token / gpus
    room = fraction * gpu - weights / gpus
    one_sequence = int(cfg.data.max_length) * per_gpu_token / 1e9
    kv = max(min(tokens * per_gpu_token / 1e9, room), one_sequence)
    held = max(int(room * 1e9 / per_gpu_token), 0)
    note = (
        f"KV {per_token / 1e3:,.1f} kB a token"
        + (", MLA's latent: every rank holds all of it" if latent else f" over {gpus} ranks")
        + f"; room for {min(held, tokens):,} of {tokens:,} tokens in flight"
        + f"; activations = (1 - {fraction:g}) of the GPU"
    )
    parts = {"weights": weights / gpus, "KV cache": kv, "activations": (1 - fraction) * gpu}
    return parts, note


def engine_hours(cfg: Config, rate_key: str, config: dict, gpus: int, tokens: int | None):
    """Time at the measured rate scaled by the rule in conf/pipeline (GPUs x measured active
    parameters / the target's)."""
    rates = plan_settings(cfg).rates
    rate = getattr(rates, rate_key) * gpus * rates.active_params / active_params(config)
    if not tokens:
        return None, f"{rate:,.0f} tok/s; token count unknown (set data.limit)"
    return (
        tokens / rate / 3600,
        f"{tokens:,} tokens at {rate:,.0f} tok/s (scaled from {getattr(rates, rate_key):,} tok/s)",
    )


def data_plan(cfg: Config, config: dict, weights: float) -> StagePlan:
    regen = cfg.data.regen
    answers = int(cfg.data.limit) * int(regen.max_new_tokens) if cfg.data.limit else None
    tokens_disk = (
        (int(cfg.data.limit) * int(cfg.data.max_length) * 5 / 1e9) if cfg.data.limit else 0.0
    )
    if not cfg.data.regenerate or regen.backend == "openai":
        what = "" if not cfg.data.regenerate else f"; answers from {regen.base_url}"
        return StagePlan("data", where(cfg, "data", 0) + what, disk_gb=tokens_disk, hours=None)
    if regen.backend == "local":
        plan = StagePlan(
            "data",
            where(cfg, "data", 1),
            {"weights": weights},
            "HF generate in this process; its KV cache and activations are not counted",
            weights,
            "the whole model: HF generate",
            tokens_disk,
        )
        plan.hours, plan.time_note = engine_hours(cfg, "regen_tokens_per_s", config, 1, answers)
        return plan
    gpus = int(getattr(cfg.serve, "tp_size", None) or 1)
    fraction = (
        getattr(cfg.serve, "mem_fraction_static", None) or plan_settings(cfg).engine_memory_fraction
    )
    tokens = int(regen.concurrency) * int(cfg.data.max_length)
    parts, note = engine_gpu(cfg, config, weights, gpus, float(fraction), cfg.serve.dtype, tokens)
    plan = StagePlan("data", where(cfg, "data", gpus), parts, note, disk_gb=tokens_disk)
    plan.hours, plan.time_note = engine_hours(cfg, "regen_tokens_per_s", config, gpus, answers)
    return plan


def extract_plan(cfg: Config, config: dict, weights: float) -> StagePlan:
    itemsize = STORAGE_DTYPES[cfg.extract.dtype].itemsize
    tokens, _ = planned_tokens(cfg)
    disk = tokens * shard_bytes_per_token(int(config["hidden_size"]), itemsize) / 1e9
    if cfg.extract.backend == "hf":
        plan = StagePlan(
            "extract",
            where(cfg, "extract", 1),
            {"weights": weights},
            "the HF target in this process; activations not counted",
            weights,
            "the whole model: HF forward",
            disk,
        )
        plan.hours, plan.time_note = engine_hours(cfg, "capture_tokens_per_s", config, 1, tokens)
        return plan
    engine = cfg.extract.engine
    gpus = int(cfg.extract.tensor_parallel_size) * int(cfg.extract.pipeline_parallel_size)
    fraction = flag_value(engine.extra_args, "--gpu-memory-utilization")
    fraction = fraction or plan_settings(cfg).vllm_memory_fraction
    tokens_in_flight = int(cfg.extract.batch_tokens)
    parts, note = engine_gpu(cfg, config, weights, gpus, fraction, engine.dtype, tokens_in_flight)
    plan = StagePlan("extract", where(cfg, "extract", gpus), parts, note, disk_gb=disk)
    plan.hours, plan.time_note = engine_hours(cfg, "capture_tokens_per_s", config, gpus, tokens)
    return plan


def drafter_params(cfg: Config, config: dict) -> int:
    """Trainable parameters of the drafter this config trains (built on the meta device)."""
    layers = int(config["num_hidden_layers"])
    aux = list(cfg.target.aux_layer_ids or default_aux_layer_ids(layers))
    with torch.device("meta"):
        drafter = Eagle3Drafter(drafter_config(config, cfg.drafter, aux))
    return sum(
        p.numel() for n, p in drafter.named_parameters() if not n.startswith("embed_tokens.")
    )


def train_world(cfg: Config) -> int:
    """Training ranks: trainer.devices (1 when not a count) x trainer.num_nodes."""
    devices = int(cfg.trainer.devices) if str(cfg.trainer.devices).isdigit() else 1
    return devices * int(cfg.trainer.num_nodes)


def train_gpu(cfg: Config, config: dict, params: int, world: int) -> dict[str, float]:
    """Per GPU: fp32 params, grads and Adam m, v (16 B a parameter; sharded over the ranks under
    FSDP), DDP's gradient buckets (4 B), the frozen fp32 embedding, under FSDP the unit it gathers
    to compute (the whole drafter, Lightning's default wrapping: bf16 params with the embedding and
    bf16 grads, 2 + 2 B a parameter), the target's head as a buffer plus the fp32 copy the loss
    makes, and activations per token and TTT step (conf/pipeline)."""
    settings = plan_settings(cfg)
    vocab, hidden = int(config["vocab_size"]), int(config["hidden_size"])
    draft_hidden = int(cfg.drafter.hidden_size or hidden)
    fsdp = str(cfg.trainer.strategy).startswith("fsdp")
    shards = world if fsdp else 1
    tokens = int(cfg.train.batch_size) * int(cfg.train.max_length) * int(cfg.train.ttt_length)
    per_token = 4 * (
        settings.logit_copies * int(cfg.drafter.draft_vocab_size)
        + settings.hidden_copies * draft_hidden
    )
    embedding = vocab * draft_hidden
    parts = {
        "states": 16 * params / shards / 1e9,
        "DDP buckets": 0.0 if fsdp or world == 1 else 4 * params / 1e9,
        "frozen embedding": 4 * embedding / shards / 1e9,
        "target head": (cpu_itemsize(cfg) + 4) * vocab * hidden / 1e9,
        "activations": tokens * per_token / 1e9,
    }
    if fsdp:
        parts["gathered unit"] = (2 * (params + embedding) + 2 * params) / 1e9
    return parts


def parts_gb(cfg: Config, config: dict) -> float:
    """Embedding, head and final norm as eagle3.core.target_parts reads them."""
    vocab, hidden = int(config["vocab_size"]), int(config["hidden_size"])
    rows = 1 if config.get("tie_word_embeddings") else 2
    return (rows * vocab + 1) * hidden * cpu_itemsize(cfg) / 1e9


def train_plan(cfg: Config, config: dict, weights: float) -> StagePlan:
    from eagle3.train.app import needs_whole_target

    world = train_world(cfg)
    params = drafter_params(cfg, config)
    if needs_whole_target(cfg):
        host, what = weights, "the whole model: online states or measured acceptance"
    else:
        host, what = parts_gb(cfg, config), "embedding, head and final norm by name"
    rates = plan_settings(cfg).rates
    head = int(config["vocab_size"]) * int(config["hidden_size"])
    cost = int(cfg.train.ttt_length) * (params + head)
    rate = rates.train_tokens_per_s * world * rates.train_cost_per_token / cost
    plan = StagePlan(
        "train",
        where(cfg, "train", world),
        train_gpu(cfg, config, params, world),
        f"{params / 1e6:,.1f} M trainable parameters, {world} rank(s), {cfg.trainer.strategy}",
        host,
        what,
        disk_gb=2 * 12 * params / 1e9,  # last.ckpt and best.ckpt: weights and Adam m, v in fp32
    )
    tokens, _ = planned_tokens(cfg)
    if tokens:
        tokens *= int(cfg.train.epochs)
        plan.hours = tokens / rate / 3600
        plan.time_note = f"{tokens:,} tokens at {rate:,.0f} tok/s over {world} GPU(s)"
        limit = cfg.cluster.timeout_min
        if cfg.pipeline.launcher and plan.hours * 60 > limit:
            plan.time_note += (
                f"; longer than cluster.timeout_min={limit}: the job stops at its limit and a "
                "rerun resumes from last.ckpt"
            )
    return plan


def export_plan(cfg: Config, config: dict) -> StagePlan:
    params = drafter_params(cfg, config)
    itemsize = 4 if cfg.export.dtype in (None, "float32") else 2
    plan = StagePlan(
        "export",
        where(cfg, "export", 0),
        host_gb=parts_gb(cfg, config),
        host_what="embedding, head and final norm by name",
        disk_gb=2 * params * itemsize / 1e9,  # the sglang/ and vllm/ folders
        hours=0.0,
        time_note="no target forward: a few files read and written",
    )
    return plan


def bench_plan(cfg: Config, config: dict, weights: float) -> StagePlan:
    scfg = cfg.serve
    if scfg.engine in ("local", "hf"):
        return StagePlan(
            "bench",
            where(cfg, "bench", 1),
            {"weights": weights},
            "the target in the bench process",
            weights,
            "the whole model",
            0.0,
            None,
            "measured by the bench",
        )
    gpus = int(getattr(scfg, "tp_size", None) or 1)
    fraction = getattr(scfg, "mem_fraction_static", None) or flag_value(
        scfg.extra_args, "--gpu-memory-utilization"
    )
    fraction = fraction or plan_settings(cfg).vllm_memory_fraction
    tokens = int(cfg.bench.batch_size) * int(cfg.data.max_length)
    parts, note = engine_gpu(cfg, config, weights, gpus, float(fraction), scfg.dtype, tokens)
    return StagePlan(
        "bench", where(cfg, "bench", gpus), parts, note, time_note="measured by the bench"
    )


def stage_plans(cfg: Config, stages: list[str]) -> dict[str, StagePlan]:
    """Every stage's plan; none for a hub id given without target.plan.config (nothing to size)."""
    config = target_config(cfg)
    if config is None:
        return {}
    weights = target_weights_gb(cfg) or 0.0
    build = {
        "data": lambda: data_plan(cfg, config, weights),
        "extract": lambda: extract_plan(cfg, config, weights),
        "train": lambda: train_plan(cfg, config, weights),
        "export": lambda: export_plan(cfg, config),
        "bench": lambda: bench_plan(cfg, config, weights),
    }
    return {stage: build[stage]() for stage in stages}


def check_plans(cfg: Config, plans: dict[str, StagePlan]) -> None:
    """Refuse the first stage that does not fit its GPUs or one host process, with its numbers."""
    gpu, host = float(plan_settings(cfg).gpu_memory_gb), float(cfg.pipeline.process_memory_gb)
    for plan in plans.values():
        refusal = plan.refusal(gpu, host)
        if refusal:
            raise Eagle3Error(refusal)
