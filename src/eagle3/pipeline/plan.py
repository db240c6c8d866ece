"""Planning a pipeline before anything runs: how large the target is, which stages would load it
into one process, what the offline shards will take on disk, and the engine commands the stages
start themselves. The pipeline's dry run prints it; a plan that loads a target larger than one
process can hold is refused, naming the setting to change.
"""

from __future__ import annotations

import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from eagle3.core.common import Eagle3Error, resolve_dtype
from eagle3.core.config import Config, plain
from eagle3.core.drafter import Eagle3Drafter, drafter_config
from eagle3.core.outputs import STAGE_OUTPUTS, data_output
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


def in_process_loads(cfg: Config, stages: list[str] | None = None) -> list[tuple[str, str]]:
    """(setting, what it does) for every planned stage (pipeline.stages, or `stages`) that loads the
    whole target in one process."""
    stages = list(cfg.pipeline.stages if stages is None else stages)
    loads = []
    if "data" in stages and cfg.data.regenerate and cfg.data.regen.backend == "local":
        loads.append(("data.regen.backend=local", "regenerates answers with HF generate"))
    online = cfg.train.hidden_states == "online"
    if "extract" in stages and not online and cfg.extract.backend == "hf":
        loads.append(("extract.backend=hf", "captures hidden states with the HF target"))
    if "train" in stages and online:
        loads.append(("train.hidden_states=online", "runs the HF target inside each training step"))
    return loads


def check_process_fit(cfg: Config, stages: list[str] | None = None) -> float | None:
    """Refuse a plan (pipeline.stages, or `stages`) that loads a target larger than
    pipeline.process_memory_gb into one process."""
    weights = target_weights_gb(cfg)
    limit = float(cfg.pipeline.process_memory_gb)
    if weights is None or weights <= limit:
        return weights
    for setting, action in in_process_loads(cfg, stages):
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
    host process holds, disk written, the estimated time, and the cluster job it runs as (nodes,
    tasks and GPUs per node, time limit in minutes; none when it runs on this host)."""

    stage: str
    where: str
    gpu_parts: dict[str, float] = field(default_factory=dict)  # GB per GPU by what holds it
    gpu_note: str = ""
    host_gb: float = 0.0
    host_what: str = "no target tensors"
    disk_gb: float = 0.0
    hours: float | None = None
    time_note: str = ""
    time_short: str = ""  # tokens and rate, for a one-line refusal
    job: dict | None = None  # {nodes, tasks_per_node, gpus_per_node, timeout_min} on a cluster
    engine_room_gb: float | None = None  # an engine's KV pool: less than one sequence = no start
    engine_sequence_gb: float | None = None

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
        if self.engine_room_gb is not None and self.engine_room_gb < self.engine_sequence_gb:
            return (
                f"{self.stage} does not fit its GPUs: weights {self.gpu_parts['weights']:,.1f} GB per "
                f"GPU leave its engine a KV pool of {self.engine_room_gb:,.1f} GB, less than one "
                f"data.max_length sequence ({self.engine_sequence_gb:,.2f} GB) ({self.where})"
            )
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

    def cluster_refusal(self, cfg: Config) -> str | None:
        """The job against the cluster's limits: GPUs per node, host memory per node, time limit
        (training is requeued past it: a note, not a refusal)."""
        if self.job is None:
            return None
        cluster = cfg.cluster
        gpus, tasks = int(self.job["gpus_per_node"]), int(self.job["tasks_per_node"])
        if gpus > int(cluster.gpus_per_node):
            single = (
                "; data and extract are single-node jobs: their engine's GPUs must fit one node"
                if self.stage in ("data", "extract", "bench")
                else "; spread training over trainer.num_nodes instead"
            )
            return (
                f"{self.stage} asks for {gpus} GPUs on one node > cluster.gpus_per_node="
                f"{cluster.gpus_per_node}{single}"
            )
        held = tasks * self.host_gb
        if held > float(cluster.mem_gb):
            return (
                f"{self.stage} holds {tasks} task(s) x {self.host_gb:,.2f} GB = {held:,.1f} GB of the "
                f"target on one node ({self.host_what}) > cluster.mem_gb={cluster.mem_gb}"
            )
        limit = int(self.job["timeout_min"])
        if self.stage != "train" and self.hours is not None and self.hours * 60 > limit:
            return (
                f"{self.stage} takes {self.hours:,.2f} h ({self.time_short}) > cluster.{self.stage}"
                f".timeout_min={limit} ({limit / 60:,.1f} h): raise it to what the partition allows, "
                f"or plan less work (data.limit); a stopped {self.stage} stage resumes when started again"
            )
        return None


def on_cluster(cfg: Config, launcher: str | None = None) -> bool:
    """Whether the stages run as cluster jobs whose limits conf/cluster states: pipeline.launcher,
    or the Hydra launcher a stage started alone was given (`launcher`)."""
    return bool(cfg.pipeline.launcher) or bool(launcher and "slurm" in launcher)


def job_shape(cfg: Config, stage: str) -> dict:
    res = getattr(cfg.cluster, stage, None) or cfg.cluster.job
    return {
        "nodes": int(res.nodes),
        "tasks_per_node": int(res.tasks_per_node),
        "gpus_per_node": int(res.gpus_per_node),
        "timeout_min": int(res.timeout_min),
    }


def free_disk_gb(cfg: Config) -> tuple[float, str]:
    """(GB free for stage outputs, where that number comes from): cluster.disk_gb when stated, else
    the free space of the filesystem that holds paths.artifacts (its nearest existing folder)."""
    if cfg.cluster.disk_gb is not None:
        return float(cfg.cluster.disk_gb), f"cluster.disk_gb={cfg.cluster.disk_gb:g}"
    folder = Path(cfg.paths.artifacts).absolute()
    while not folder.exists():
        folder = folder.parent
    free = shutil.disk_usage(folder).free / 1e9
    return free, f"{free:,.1f} GB free at paths.artifacts={cfg.paths.artifacts}"


def disk_writes(cfg: Config, plans: dict[str, StagePlan]) -> dict[str, float]:
    """GB each stage still to run writes under paths.artifacts (a complete output writes nothing)."""
    return {
        stage: plan.disk_gb
        for stage, plan in plans.items()
        if plan.disk_gb > 0 and (stage == "bench" or not STAGE_OUTPUTS[stage](cfg).complete)
    }


def disk_line(cfg: Config, plans: dict[str, StagePlan]) -> str:
    writes = disk_writes(cfg, plans)
    free, source = free_disk_gb(cfg)
    return f"disk: the stages to run write {sum(writes.values()):,.1f} GB; {source}"


def disk_refusal(cfg: Config, plans: dict[str, StagePlan]) -> str | None:
    """The disk the stages still to run will write, against the free space (or cluster.disk_gb)."""
    writes = disk_writes(cfg, plans)
    total = sum(writes.values())
    if not writes:
        return None
    free, source = free_disk_gb(cfg)
    if total <= free:
        return None
    if len(writes) == 1:
        written = f"{next(iter(writes))} writes {total:,.1f} GB"
    else:
        parts = " + ".join(f"{stage} {gb:,.1f}" for stage, gb in writes.items())
        written = f"the stages write {parts} = {total:,.1f} GB"
    return (
        f"{written} > {source}: free space there, point "
        "paths.artifacts (EAGLE3_ROOT) at a larger filesystem, or state its capacity with "
        "cluster.disk_gb"
    )


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
            f"{res.tasks_per_node} task(s) per node, {res.timeout_min} min "
            f"(cluster.{stage if getattr(cfg.cluster, stage, None) else 'job'}.timeout_min)"
        )
    return f"this host, {gpus} GPU(s)" if gpus else "this host, no GPU"


def engine_gpu(
    cfg: Config,
    config: dict,
    weights: float,
    gpus: int,
    fraction: float,
    dtype,
    tokens: int,
    engine: str,
    captured_states: int = 0,
) -> tuple[dict[str, float], str, float, float]:
    """GPU memory per GPU of a serving engine over `gpus` GPUs: the weights' share, the KV pool the
    engine reserves (SGLang: mem_fraction_static of the GPU less the weights; vLLM:
    --gpu-memory-utilization less the weights and its overhead), split into the target's KV cache
    and, for vLLM's hidden-state capture, the cache-only layer that holds `captured_states` states
    of the hidden size per token on every rank, and the engine's measured overhead
    (pipeline.plan.engine_overhead). Returns (parts, note, KV pool GB, one data.max_length
    sequence's GB)."""
    settings = plan_settings(cfg)
    gpu = float(settings.gpu_memory_gb)
    itemsize = engine_itemsize(dtype)
    per_token, latent = kv_bytes_per_token(config, itemsize)
    kv_rank = per_token if latent else per_token / gpus
    capture_rank = captured_states * int(config["hidden_size"]) * itemsize
    per_rank = kv_rank + capture_rank
    measured = getattr(settings.engine_overhead, f"{engine}_gb", None)
    source = settings.engine_overhead.document
    overhead_part: dict[str, float] = {}
    if engine == "sglang":
        pool = fraction * gpu - weights / gpus
        if measured is not None:
            overhead_part = {"engine overhead": float(measured)}
            overhead_note = f"engine overhead measured: {source}"
        else:
            overhead_part = {"unreserved": (1 - fraction) * gpu}
            overhead_note = (
                f"unreserved = (1 - {fraction:g}) of the GPU: SGLang's overhead not measured "
                "(pipeline.plan.engine_overhead.sglang_gb)"
            )
    else:
        pool = fraction * gpu - weights / gpus - float(measured or 0.0)
        if measured is not None:
            overhead_part = {"engine overhead": float(measured)}
            overhead_note = f"engine overhead measured: {source}"
        else:
            overhead_note = (
                f"vLLM's overhead not measured (pipeline.plan.engine_overhead.vllm_gb): it comes "
                f"out of the KV pool inside --gpu-memory-utilization {fraction:g}"
            )
    sequence = int(cfg.data.max_length) * per_rank / 1e9
    room = max(pool, 0.0)
    held = int(room * 1e9 / per_rank)
    parts = {"weights": weights / gpus, "KV cache": room * kv_rank / per_rank}
    if capture_rank:
        parts["capture cache"] = room * capture_rank / per_rank
    parts.update(overhead_part)
    note = (
        f"KV {per_token / 1e3:,.1f} kB a token"
        + (", MLA's latent: every rank holds all of it" if latent else f" over {gpus} ranks")
        + (
            f"; capture {capture_rank / 1e3:,.1f} kB a token on every rank ({captured_states} "
            f"states x {config['hidden_size']} x {itemsize} B)"
            if capture_rank
            else ""
        )
        + f"; room for {min(held, tokens):,} of {tokens:,} tokens in flight; {overhead_note}"
    )
    return parts, note, pool, sequence


def engine_rate(cfg: Config, kind: str, config: dict, gpus: int, engine: bool) -> tuple[float, str]:
    """(tokens/s, where it comes from) of regeneration or capture (`kind`): an engine stage at its
    engine's measured rate (pipeline.plan.rates.<kind>_engine) scaled by active parameters; else
    the HF rate scaled by GPUs x active parameters, named as the fallback for an engine stage."""
    rates = plan_settings(cfg).rates
    target = active_params(config)
    measured = getattr(rates, f"{kind}_engine", None) if engine else None
    if measured is not None:
        rate = float(measured.tokens_per_s) * int(measured.active_params) / target
        at = f" at {measured.concurrency} concurrent requests" if measured.concurrency else ""
        return rate, (
            f"{measured.engine} {float(measured.tokens_per_s):,.0f} tok/s on {measured.hardware}{at} "
            f"x {int(measured.active_params) / 1e9:,.2f} / {target / 1e9:,.2f} B active parameters; "
            f"{measured.document}"
        )
    hf = getattr(rates, f"{kind}_tokens_per_s")
    rate = hf * gpus * rates.active_params / target
    document = getattr(rates, f"{kind}_document")
    label = (
        f"fallback: no engine rate in pipeline.plan.rates.{kind}_engine, so the HF rate"
        if engine
        else "the HF rate"
    )
    return rate, f"{label} {hf:,} tok/s of {document} x {gpus} GPU(s) x active parameters"


def engine_hours(plan: StagePlan, cfg: Config, kind: str, config: dict, gpus: int, tokens, engine):
    """Fills the plan's time: `tokens` at the stage's rate (engine_rate), the rate's source named."""
    rate, source = engine_rate(cfg, kind, config, gpus, engine)
    if not tokens:
        plan.time_note = f"{rate:,.0f} tok/s ({source}); token count unknown (set data.limit)"
        return
    plan.hours = tokens / rate / 3600
    plan.time_short = f"{tokens:,} tokens at {rate:,.0f} tok/s"
    plan.time_note = f"{plan.time_short} ({source})"


def answer_tokens(cfg: Config) -> tuple[int | None, str]:
    """Regeneration's output tokens, at most: every user turn of a conversation is answered (up to
    data.regen.max_new_tokens each, data.filters.max_turns turns) until its prompt reaches
    data.max_length, so the answers of one conversation stay below data.max_length plus one answer."""
    if not cfg.data.limit:
        return None, ""
    new, length = int(cfg.data.regen.max_new_tokens), int(cfg.data.max_length)
    per_conversation = length + new
    turns = cfg.data.filters.max_turns
    if turns:
        per_conversation = min(per_conversation, int(turns) * new)
    return int(cfg.data.limit) * per_conversation, (
        f"at most {int(cfg.data.limit):,} conversations x {per_conversation:,} answer tokens: "
        f"every turn answered, up to {new:,} tokens each"
        + (f", {turns} turns" if turns else "")
        + f", within data.max_length {length:,} + one answer"
    )


def data_plan(cfg: Config, config: dict, weights: float) -> StagePlan:
    regen = cfg.data.regen
    answers, counted = answer_tokens(cfg)
    tokens_disk = (
        (int(cfg.data.limit) * int(cfg.data.max_length) * 5 / 1e9) if cfg.data.limit else 0.0
    )
    if not cfg.data.regenerate or regen.backend == "openai":
        what = "" if not cfg.data.regenerate else f"; answers from {regen.base_url}"
        plan = StagePlan("data", where(cfg, "data", 0) + what, disk_gb=tokens_disk, hours=None)
        if cfg.data.regenerate:
            engine_hours(plan, cfg, "regen", config, 1, answers, True)
            plan.time_note += f"; {counted}" if counted else ""
        return plan
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
        engine_hours(plan, cfg, "regen", config, 1, answers, False)
    else:
        gpus = int(getattr(cfg.serve, "tp_size", None) or 1)
        engine = str(cfg.serve.engine)
        fraction = getattr(cfg.serve, "mem_fraction_static", None) or flag_value(
            getattr(cfg.serve, "extra_args", None), "--gpu-memory-utilization"
        )
        default = "engine_memory_fraction" if engine == "sglang" else "vllm_memory_fraction"
        fraction = float(fraction or getattr(plan_settings(cfg), default))
        tokens = int(regen.concurrency) * int(cfg.data.max_length)
        parts, note, pool, sequence = engine_gpu(
            cfg, config, weights, gpus, fraction, cfg.serve.dtype, tokens, engine
        )
        plan = StagePlan("data", where(cfg, "data", gpus), parts, note, disk_gb=tokens_disk)
        plan.engine_room_gb, plan.engine_sequence_gb = pool, sequence
        engine_hours(plan, cfg, "regen", config, gpus, answers, True)
    plan.time_note += f"; {counted}" if counted else ""
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
        engine_hours(plan, cfg, "capture", config, 1, tokens, False)
        return plan
    engine = cfg.extract.engine
    gpus = int(cfg.extract.tensor_parallel_size) * int(cfg.extract.pipeline_parallel_size)
    fraction = flag_value(engine.extra_args, "--gpu-memory-utilization")
    fraction = fraction or plan_settings(cfg).vllm_memory_fraction
    tokens_in_flight = int(cfg.extract.batch_tokens)
    layers = int(config["num_hidden_layers"])
    captured = len(list(cfg.target.aux_layer_ids or default_aux_layer_ids(layers))) + 1
    parts, note, pool, sequence = engine_gpu(
        cfg, config, weights, gpus, fraction, engine.dtype, tokens_in_flight, "vllm", captured
    )
    plan = StagePlan("extract", where(cfg, "extract", gpus), parts, note, disk_gb=disk)
    plan.engine_room_gb, plan.engine_sequence_gb = pool, sequence
    engine_hours(plan, cfg, "capture", config, gpus, tokens, True)
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
    if needs_whole_target(cfg.train):
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
        limit = int(cfg.cluster.train.timeout_min)
        if cfg.pipeline.launcher and plan.hours * 60 > limit:
            jobs = math.ceil(plan.hours * 60 / limit)
            plan.time_note += (
                f"; longer than cluster.train.timeout_min={limit}: {jobs} jobs, each requeued at its "
                f"limit (cluster.requeue_signal={cfg.cluster.requeue_signal}) and resumed from its "
                "checkpoint"
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
    default = "engine_memory_fraction" if scfg.engine == "sglang" else "vllm_memory_fraction"
    fraction = float(fraction or getattr(plan_settings(cfg), default))
    tokens = int(cfg.bench.batch_size) * int(cfg.data.max_length)
    parts, note, pool, sequence = engine_gpu(
        cfg, config, weights, gpus, fraction, scfg.dtype, tokens, str(scfg.engine)
    )
    plan = StagePlan(
        "bench", where(cfg, "bench", gpus), parts, note, time_note="measured by the bench"
    )
    plan.engine_room_gb, plan.engine_sequence_gb = pool, sequence
    return plan


def stage_plans(
    cfg: Config, stages: list[str], launcher: str | None = None
) -> dict[str, StagePlan]:
    """Every stage's plan; none for a hub id given without target.plan.config (nothing to size).
    On a cluster (pipeline.launcher, or the Hydra `launcher` a stage was started with) each plan
    carries its job's shape and time limit from conf/cluster."""
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
    plans = {stage: build[stage]() for stage in stages}
    if on_cluster(cfg, launcher):
        for stage, plan in plans.items():
            plan.job = job_shape(cfg, stage)
    return plans


def check_plans(cfg: Config, plans: dict[str, StagePlan]) -> None:
    """Refuse the first stage that does not fit its GPUs, one host process or its cluster job (GPUs
    per node, host memory per node, time limit), then a plan whose outputs do not fit the disk;
    each with its numbers."""
    gpu, host = float(plan_settings(cfg).gpu_memory_gb), float(cfg.pipeline.process_memory_gb)
    for plan in plans.values():
        refusal = plan.cluster_refusal(cfg) or plan.refusal(gpu, host)
        if refusal:
            raise Eagle3Error(refusal)
    refusal = disk_refusal(cfg, plans)
    if refusal:
        raise Eagle3Error(refusal)
