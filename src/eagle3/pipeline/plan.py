"""Planning a pipeline before anything runs: how large the target is, which stages would load it
into one process, what the offline shards will take on disk, and the engine commands the stages
start themselves. The pipeline's dry run prints it; a plan that loads a target larger than one
process can hold is refused, naming the setting to change.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from eagle3.core.artifacts import StageOutput
from eagle3.core.common import Eagle3Error, resolve_dtype
from eagle3.core.config import (
    ClusterConfig,
    Config,
    DataConfig,
    DrafterConfig,
    ExportConfig,
    ExtractConfig,
    PipelineConfig,
    PlanConfig,
    ServeConfig,
    TargetConfig,
    TrainConfig,
    TrainerConfig,
    plain,
)
from eagle3.core.drafter import Eagle3Drafter, drafter_config
from eagle3.core.outputs import data_output
from eagle3.core.target import default_aux_layer_ids, folder_text_config, resolve_target_path
from eagle3.extract.shards import STORAGE_DTYPES
from eagle3.extract.vllm_capture import text_config
from eagle3.pipeline.plan_shapes import active_params, checkpoint_bytes, kv_bytes_per_token


def target_weights_gb(target: TargetConfig, artifacts: Path) -> float | None:
    """target.plan.weights_gb; else, for a target planned from target.plan.config, its weights at
    the dtypes target.plan.storage says they are stored in; else the size of the target folder's
    weight files (None: unknown, a hub id with no plan)."""
    hint = target.plan or {}
    if hint.get("weights_gb") is not None:
        return float(hint["weights_gb"])
    if hint.get("config") is not None:
        return checkpoint_bytes(plain(hint["config"]), plain(hint["storage"])) / 1e9
    path = resolve_target_path(target, artifacts)
    if not isinstance(path, Path):
        return None
    files = [*path.glob("*.safetensors"), *path.glob("*.bin")]
    return sum(f.stat().st_size for f in files) / 1e9


def in_process_loads(
    stages: list[str], data: DataConfig, train: TrainConfig, extract: ExtractConfig
) -> list[tuple[str, str]]:
    """(setting, what it does) for every one of `stages` that loads the whole target in one
    process."""
    loads = []
    if "data" in stages and data.regenerate and data.regen.backend == "local":
        loads.append(("data.regen.backend=local", "regenerates answers with HF generate"))
    online = train.hidden_states == "online"
    if "extract" in stages and not online and extract.backend == "hf":
        loads.append(("extract.backend=hf", "captures hidden states with the HF target"))
    if "train" in stages and online:
        loads.append(("train.hidden_states=online", "runs the HF target inside each training step"))
    return loads


def check_process_fit(
    target: TargetConfig, artifacts: Path, limit: float, loads: list[tuple[str, str]]
) -> float | None:
    """The target's weights (target_weights_gb); a plan whose `loads` (in_process_loads) put more
    than one process holds (pipeline.process_memory_gb, `limit`) into one process is refused."""
    weights = target_weights_gb(target, artifacts)
    limit = float(limit)
    if weights is None or weights <= limit:
        return weights
    for setting, action in loads:
        raise Eagle3Error(
            f"{setting} {action} in one process, but target {target.name} has {weights:,.0f} GB "
            f"of weights and one process holds pipeline.process_memory_gb={limit:g}: use "
            "extract.backend=vllm, data.regen.backend=engine and train.hidden_states=offline"
        )
    return weights


def shard_bytes_per_token(hidden: int, itemsize: int) -> int:
    """aux [3H] + last [H] states, an int32 token id and an int8 loss-mask entry."""
    return 4 * hidden * itemsize + 4 + 1


def planned_tokens(data_out: StageOutput, splits: list[str], data: DataConfig) -> tuple[int, bool]:
    """(tokens of the extracted `splits`, exact): the data output's counts when it exists, else the
    upper bound data.limit x data.max_length."""
    if data_out.complete:
        counts = data_out.manifest().get("counts", {})
        return sum(int(counts.get(f"{s}_tokens", 0)) for s in splits), True
    if data.limit is None:
        return 0, False
    return int(data.limit) * int(data.max_length), False


def target_hidden_size(target: TargetConfig, artifacts: Path) -> int:
    hint = (target.plan or {}).get("hidden_size")
    if hint is not None:
        return int(hint)
    return int(text_config(resolve_target_path(target, artifacts))["hidden_size"])


def disk_lines(dtype: str, hidden: int, tokens: int, exact: bool) -> list[str]:
    """The shards' bytes a token at extract.dtype (`dtype`) and the target's `hidden` size, over
    the planned `tokens` (planned_tokens: `exact`, or an upper bound)."""
    itemsize = STORAGE_DTYPES[dtype].itemsize
    per_token = shard_bytes_per_token(hidden, itemsize)
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

    def cluster_refusal(self, cluster: ClusterConfig) -> str | None:
        """The job against the cluster's limits: GPUs per node, host memory per node, time limit
        (training is requeued past it: a note, not a refusal)."""
        if self.job is None:
            return None
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


def on_cluster(pipeline_launcher: str | None, launcher: str | None = None) -> bool:
    """Whether the stages run as cluster jobs whose limits conf/cluster states: pipeline.launcher,
    or the Hydra launcher a stage started alone was given (`launcher`)."""
    return bool(pipeline_launcher) or bool(launcher and "slurm" in launcher)


def job_shape(cluster: ClusterConfig, stage: str) -> dict:
    res = getattr(cluster, stage, None) or cluster.job
    return {
        "nodes": int(res.nodes),
        "tasks_per_node": int(res.tasks_per_node),
        "gpus_per_node": int(res.gpus_per_node),
        "timeout_min": int(res.timeout_min),
    }


def free_disk_gb(cluster: ClusterConfig, artifacts: str) -> tuple[float, str]:
    """(GB free for stage outputs, where that number comes from): cluster.disk_gb when stated, else
    the free space of the filesystem that holds paths.artifacts (its nearest existing folder)."""
    if cluster.disk_gb is not None:
        return float(cluster.disk_gb), f"cluster.disk_gb={cluster.disk_gb:g}"
    folder = Path(artifacts).absolute()
    while not folder.exists():
        folder = folder.parent
    free = shutil.disk_usage(folder).free / 1e9
    return free, f"{free:,.1f} GB free at paths.artifacts={artifacts}"


def disk_writes(plans: dict[str, StagePlan], complete: Callable[[str], bool]) -> dict[str, float]:
    """GB each stage still to run writes under paths.artifacts (a stage whose output is `complete`
    writes nothing)."""
    return {
        stage: plan.disk_gb
        for stage, plan in plans.items()
        if plan.disk_gb > 0 and (stage == "bench" or not complete(stage))
    }


def disk_line(writes: dict[str, float], cluster: ClusterConfig, artifacts: str) -> str:
    free, source = free_disk_gb(cluster, artifacts)
    return f"disk: the stages to run write {sum(writes.values()):,.1f} GB; {source}"


def disk_refusal(writes: dict[str, float], cluster: ClusterConfig, artifacts: str) -> str | None:
    """The disk the stages still to run will write (disk_writes), against the free space under
    paths.artifacts (`artifacts`) or cluster.disk_gb."""
    total = sum(writes.values())
    if not writes:
        return None
    free, source = free_disk_gb(cluster, artifacts)
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


def target_config(target: TargetConfig, artifacts: Path) -> dict | None:
    """The target's text config: target.plan.config (planned without downloading it), else the
    folder's config.json (None: a hub id)."""
    hint = (target.plan or {}).get("config")
    if hint is not None:
        return plain(hint)
    return folder_text_config(resolve_target_path(target, artifacts))


@dataclass(frozen=True)
class PlannedTarget:
    """The target as the plan sizes it: its text config (target_config), target.dtype and
    target.aux_layer_ids."""

    config: dict
    dtype: str
    aux: list[int] | None

    @property
    def cpu_itemsize(self) -> int:
        """Bytes per element of the target tensors a host process reads (target.dtype on the CPU)."""
        return resolve_dtype(self.dtype, torch.device("cpu")).itemsize

    @property
    def aux_layer_ids(self) -> list[int]:
        """The layers the drafter reads: target.aux_layer_ids, else the engines' defaults."""
        return list(self.aux or default_aux_layer_ids(int(self.config["num_hidden_layers"])))


def planned_target(target: TargetConfig, artifacts: Path) -> PlannedTarget | None:
    """None for a hub id given without target.plan.config (nothing to size)."""
    config = target_config(target, artifacts)
    if config is None:
        return None
    return PlannedTarget(config, target.dtype, target.aux_layer_ids)


@dataclass(frozen=True)
class Sizing:
    """What every stage's plan is sized from, read once by stage_plans: the target, its weights
    (GB), pipeline.plan's settings and rates, where the stages run (pipeline.launcher and
    conf/cluster) and data.max_length (one sequence of an engine's KV pool)."""

    target: PlannedTarget
    weights_gb: float
    settings: PlanConfig
    launcher: str | None
    cluster: ClusterConfig
    max_length: int


def engine_itemsize(dtype: str | None) -> int:
    return 4 if str(dtype) == "float32" else 2


def flag_value(args, flag: str) -> float | None:
    """The value after `flag` in an engine's extra_args, if given there."""
    args = [str(a) for a in args or []]
    return float(args[args.index(flag) + 1]) if flag in args[:-1] else None


def where(sizing: Sizing, stage: str, gpus: int) -> str:
    """Which machine runs the stage: a job of pipeline.launcher with conf/cluster's resources for its
    app, or the host that runs the pipeline."""
    if sizing.launcher:
        cluster = sizing.cluster
        res = getattr(cluster, stage, None) or cluster.job
        kind = cluster.constraint or "any"
        return (
            f"{sizing.launcher} job, {res.nodes} node(s) ({kind}) x {res.gpus_per_node} GPU(s), "
            f"{res.tasks_per_node} task(s) per node, {res.timeout_min} min "
            f"(cluster.{stage if getattr(cluster, stage, None) else 'job'}.timeout_min)"
        )
    return f"this host, {gpus} GPU(s)" if gpus else "this host, no GPU"


def engine_gpu(
    sizing: Sizing,
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
    settings, config, weights = sizing.settings, sizing.target.config, sizing.weights_gb
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
    sequence = sizing.max_length * per_rank / 1e9
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


def engine_rate(sizing: Sizing, kind: str, gpus: int, engine: bool) -> tuple[float, str]:
    """(tokens/s, where it comes from) of regeneration or capture (`kind`): an engine stage at its
    engine's measured rate (pipeline.plan.rates.<kind>_engine) scaled by active parameters; else
    the HF rate scaled by GPUs x active parameters, named as the fallback for an engine stage."""
    rates = sizing.settings.rates
    target = active_params(sizing.target.config)
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


def engine_hours(plan: StagePlan, sizing: Sizing, kind: str, gpus: int, tokens, engine: bool):
    """Fills the plan's time: `tokens` at the stage's rate (engine_rate), the rate's source named."""
    rate, source = engine_rate(sizing, kind, gpus, engine)
    if not tokens:
        plan.time_note = f"{rate:,.0f} tok/s ({source}); token count unknown (set data.limit)"
        return
    plan.hours = tokens / rate / 3600
    plan.time_short = f"{tokens:,} tokens at {rate:,.0f} tok/s"
    plan.time_note = f"{plan.time_short} ({source})"


def answer_tokens(data: DataConfig) -> tuple[int | None, str]:
    """Regeneration's output tokens, at most: every user turn of a conversation is answered (up to
    data.regen.max_new_tokens each, data.filters.max_turns turns) until its prompt reaches
    data.max_length, so the answers of one conversation stay below data.max_length plus one answer."""
    if not data.limit:
        return None, ""
    new, length = int(data.regen.max_new_tokens), int(data.max_length)
    per_conversation = length + new
    turns = data.filters.max_turns
    if turns:
        per_conversation = min(per_conversation, int(turns) * new)
    return int(data.limit) * per_conversation, (
        f"at most {int(data.limit):,} conversations x {per_conversation:,} answer tokens: "
        f"every turn answered, up to {new:,} tokens each"
        + (f", {turns} turns" if turns else "")
        + f", within data.max_length {length:,} + one answer"
    )


def data_plan(sizing: Sizing, data: DataConfig, serve: ServeConfig) -> StagePlan:
    regen, weights = data.regen, sizing.weights_gb
    answers, counted = answer_tokens(data)
    tokens_disk = (int(data.limit) * int(data.max_length) * 5 / 1e9) if data.limit else 0.0
    if not data.regenerate or regen.backend == "openai":
        what = "" if not data.regenerate else f"; answers from {regen.base_url}"
        plan = StagePlan("data", where(sizing, "data", 0) + what, disk_gb=tokens_disk, hours=None)
        if data.regenerate:
            engine_hours(plan, sizing, "regen", 1, answers, True)
            plan.time_note += f"; {counted}" if counted else ""
        return plan
    if regen.backend == "local":
        plan = StagePlan(
            "data",
            where(sizing, "data", 1),
            {"weights": weights},
            "HF generate in this process; its KV cache and activations are not counted",
            weights,
            "the whole model: HF generate",
            tokens_disk,
        )
        engine_hours(plan, sizing, "regen", 1, answers, False)
    else:
        gpus = int(getattr(serve, "tp_size", None) or 1)
        engine = str(serve.engine)
        fraction = getattr(serve, "mem_fraction_static", None) or flag_value(
            getattr(serve, "extra_args", None), "--gpu-memory-utilization"
        )
        default = "engine_memory_fraction" if engine == "sglang" else "vllm_memory_fraction"
        fraction = float(fraction or getattr(sizing.settings, default))
        tokens = int(regen.concurrency) * int(data.max_length)
        parts, note, pool, sequence = engine_gpu(
            sizing, gpus, fraction, serve.dtype, tokens, engine
        )
        plan = StagePlan("data", where(sizing, "data", gpus), parts, note, disk_gb=tokens_disk)
        plan.engine_room_gb, plan.engine_sequence_gb = pool, sequence
        engine_hours(plan, sizing, "regen", gpus, answers, True)
    plan.time_note += f"; {counted}" if counted else ""
    return plan


def extract_plan(sizing: Sizing, extract: ExtractConfig, tokens: int) -> StagePlan:
    """The extract stage over the planned `tokens` (planned_tokens)."""
    config, weights = sizing.target.config, sizing.weights_gb
    itemsize = STORAGE_DTYPES[extract.dtype].itemsize
    disk = tokens * shard_bytes_per_token(int(config["hidden_size"]), itemsize) / 1e9
    if extract.backend == "hf":
        plan = StagePlan(
            "extract",
            where(sizing, "extract", 1),
            {"weights": weights},
            "the HF target in this process; activations not counted",
            weights,
            "the whole model: HF forward",
            disk,
        )
        engine_hours(plan, sizing, "capture", 1, tokens, False)
        return plan
    engine = extract.engine
    gpus = int(extract.tensor_parallel_size) * int(extract.pipeline_parallel_size)
    fraction = flag_value(engine.extra_args, "--gpu-memory-utilization")
    fraction = fraction or sizing.settings.vllm_memory_fraction
    tokens_in_flight = int(extract.batch_tokens)
    captured = len(sizing.target.aux_layer_ids) + 1
    parts, note, pool, sequence = engine_gpu(
        sizing, gpus, fraction, engine.dtype, tokens_in_flight, "vllm", captured
    )
    plan = StagePlan("extract", where(sizing, "extract", gpus), parts, note, disk_gb=disk)
    plan.engine_room_gb, plan.engine_sequence_gb = pool, sequence
    engine_hours(plan, sizing, "capture", gpus, tokens, True)
    return plan


def drafter_params(target: PlannedTarget, drafter: DrafterConfig) -> int:
    """Trainable parameters of the drafter `drafter` describes (built on the meta device)."""
    with torch.device("meta"):
        model = Eagle3Drafter(drafter_config(target.config, drafter, target.aux_layer_ids))
    return sum(p.numel() for n, p in model.named_parameters() if not n.startswith("embed_tokens."))


def train_world(trainer: TrainerConfig) -> int:
    """Training ranks: trainer.devices (1 when not a count) x trainer.num_nodes."""
    devices = int(trainer.devices) if str(trainer.devices).isdigit() else 1
    return devices * int(trainer.num_nodes)


@dataclass(frozen=True)
class DrafterTraining:
    """One training of the drafter as the memory model sizes it: the target as planned, the
    drafter, train and trainer sections, and pipeline.plan's activation copies."""

    target: PlannedTarget
    drafter: DrafterConfig
    train: TrainConfig
    trainer: TrainerConfig
    settings: PlanConfig

    def as_strategy(self, strategy: str, max_length: int | None = None) -> DrafterTraining:
        """The same training under another trainer.strategy (and train.max_length)."""
        train = self.train if max_length is None else replace(self.train, max_length=max_length)
        return replace(self, train=train, trainer=replace(self.trainer, strategy=strategy))


def train_gpu(training: DrafterTraining, params: int, world: int) -> dict[str, float]:
    """Per GPU: fp32 params, grads and Adam m, v (16 B a parameter; sharded over the ranks under
    FSDP), DDP's gradient buckets (4 B), the frozen fp32 embedding, under FSDP the unit it gathers
    to compute (the whole drafter, Lightning's default wrapping: bf16 params with the embedding and
    bf16 grads, 2 + 2 B a parameter), the target's head as a buffer plus the fp32 copy the loss
    makes, and activations per token and TTT step (conf/pipeline)."""
    settings, drafter, train = training.settings, training.drafter, training.train
    config = training.target.config
    vocab, hidden = int(config["vocab_size"]), int(config["hidden_size"])
    draft_hidden = int(drafter.hidden_size or hidden)
    fsdp = str(training.trainer.strategy).startswith("fsdp")
    shards = world if fsdp else 1
    tokens = int(train.batch_size) * int(train.max_length) * int(train.ttt_length)
    per_token = 4 * (
        settings.logit_copies * int(drafter.draft_vocab_size)
        + settings.hidden_copies * draft_hidden
    )
    embedding = vocab * draft_hidden
    parts = {
        "states": 16 * params / shards / 1e9,
        "DDP buckets": 0.0 if fsdp or world == 1 else 4 * params / 1e9,
        "frozen embedding": 4 * embedding / shards / 1e9,
        "target head": (training.target.cpu_itemsize + 4) * vocab * hidden / 1e9,
        "activations": tokens * per_token / 1e9,
    }
    if fsdp:
        parts["gathered unit"] = (2 * (params + embedding) + 2 * params) / 1e9
    return parts


def parts_gb(target: PlannedTarget) -> float:
    """Embedding, head and final norm as eagle3.core.target_parts reads them."""
    config = target.config
    vocab, hidden = int(config["vocab_size"]), int(config["hidden_size"])
    rows = 1 if config.get("tie_word_embeddings") else 2
    return (rows * vocab + 1) * hidden * target.cpu_itemsize / 1e9


def train_plan(
    sizing: Sizing, training: DrafterTraining, whole_target: bool, tokens: int
) -> StagePlan:
    """The train stage over the planned `tokens` (planned_tokens) an epoch; `whole_target`: its
    process loads the whole target (eagle3.train.datamodule.needs_whole_target)."""
    world = train_world(training.trainer)
    params = drafter_params(sizing.target, training.drafter)
    if whole_target:
        host, what = sizing.weights_gb, "the whole model: online states or measured acceptance"
    else:
        host, what = parts_gb(sizing.target), "embedding, head and final norm by name"
    rates = sizing.settings.rates
    config = sizing.target.config
    head = int(config["vocab_size"]) * int(config["hidden_size"])
    cost = int(training.train.ttt_length) * (params + head)
    rate = rates.train_tokens_per_s * world * rates.train_cost_per_token / cost
    plan = StagePlan(
        "train",
        where(sizing, "train", world),
        train_gpu(training, params, world),
        f"{params / 1e6:,.1f} M trainable parameters, {world} rank(s), {training.trainer.strategy}",
        host,
        what,
        disk_gb=2 * 12 * params / 1e9,  # last.ckpt and best.ckpt: weights and Adam m, v in fp32
    )
    if tokens:
        tokens *= int(training.train.epochs)
        plan.hours = tokens / rate / 3600
        plan.time_note = f"{tokens:,} tokens at {rate:,.0f} tok/s over {world} GPU(s)"
        limit = int(sizing.cluster.train.timeout_min)
        if sizing.launcher and plan.hours * 60 > limit:
            jobs = math.ceil(plan.hours * 60 / limit)
            plan.time_note += (
                f"; longer than cluster.train.timeout_min={limit}: {jobs} jobs, each requeued at its "
                f"limit (cluster.requeue_signal={sizing.cluster.requeue_signal}) and resumed from its "
                "checkpoint"
            )
    return plan


def export_plan(sizing: Sizing, export: ExportConfig, drafter: DrafterConfig) -> StagePlan:
    params = drafter_params(sizing.target, drafter)
    itemsize = 4 if export.dtype in (None, "float32") else 2
    plan = StagePlan(
        "export",
        where(sizing, "export", 0),
        host_gb=parts_gb(sizing.target),
        host_what="embedding, head and final norm by name",
        disk_gb=2 * params * itemsize / 1e9,  # the sglang/ and vllm/ folders
        hours=0.0,
        time_note="no target forward: a few files read and written",
    )
    return plan


def bench_plan(sizing: Sizing, serve: ServeConfig, batch_size: int) -> StagePlan:
    """The target served as one bench job serves it, `batch_size` (bench.batch_size) requests at
    once."""
    weights = sizing.weights_gb
    if serve.engine in ("local", "hf"):
        return StagePlan(
            "bench",
            where(sizing, "bench", 1),
            {"weights": weights},
            "the target in the bench process",
            weights,
            "the whole model",
            0.0,
            None,
            "measured by the bench",
        )
    gpus = int(getattr(serve, "tp_size", None) or 1)
    fraction = getattr(serve, "mem_fraction_static", None) or flag_value(
        serve.extra_args, "--gpu-memory-utilization"
    )
    default = "engine_memory_fraction" if serve.engine == "sglang" else "vllm_memory_fraction"
    fraction = float(fraction or getattr(sizing.settings, default))
    tokens = int(batch_size) * sizing.max_length
    parts, note, pool, sequence = engine_gpu(
        sizing, gpus, fraction, serve.dtype, tokens, str(serve.engine)
    )
    plan = StagePlan(
        "bench", where(sizing, "bench", gpus), parts, note, time_note="measured by the bench"
    )
    plan.engine_room_gb, plan.engine_sequence_gb = pool, sequence
    return plan


def stage_plans(
    cfg: Config, stages: list[str], launcher: str | None = None
) -> dict[str, StagePlan]:
    """Every stage's plan; none for a hub id given without target.plan.config (nothing to size).
    On a cluster (pipeline.launcher, or the Hydra `launcher` a stage was started with) each plan
    carries its job's shape and time limit from conf/cluster."""
    from eagle3.train.datamodule import needs_whole_target

    artifacts = Path(cfg.paths.artifacts)
    target = planned_target(cfg.target, artifacts)
    if target is None:
        return {}
    weights = target_weights_gb(cfg.target, artifacts) or 0.0
    pipeline = cfg.pipeline
    sizing = Sizing(
        target, weights, pipeline.plan, pipeline.launcher, cfg.cluster, int(cfg.data.max_length)
    )
    training = DrafterTraining(target, cfg.drafter, cfg.train, cfg.trainer, pipeline.plan)

    def tokens() -> int:
        return planned_tokens(data_output(cfg), cfg.extract.splits, cfg.data)[0]

    build = {
        "data": lambda: data_plan(sizing, cfg.data, cfg.serve),
        "extract": lambda: extract_plan(sizing, cfg.extract, tokens()),
        "train": lambda: train_plan(sizing, training, needs_whole_target(cfg.train), tokens()),
        "export": lambda: export_plan(sizing, cfg.export, cfg.drafter),
        "bench": lambda: bench_plan(sizing, cfg.serve, cfg.bench.batch_size),
    }
    plans = {stage: build[stage]() for stage in stages}
    if on_cluster(pipeline.launcher, launcher):
        for stage, plan in plans.items():
            plan.job = job_shape(cfg.cluster, stage)
    return plans


def check_plans(
    plans: dict[str, StagePlan],
    pipeline: PipelineConfig,
    cluster: ClusterConfig,
    artifacts: str,
    complete: Callable[[str], bool],
) -> None:
    """Refuse the first stage that does not fit its GPUs, one host process or its cluster job (GPUs
    per node, host memory per node, time limit), then a plan whose outputs do not fit the disk
    under `artifacts` (a stage whose output is `complete` writes nothing); each with its numbers."""
    gpu, host = float(pipeline.plan.gpu_memory_gb), float(pipeline.process_memory_gb)
    for plan in plans.values():
        refusal = plan.cluster_refusal(cluster) or plan.refusal(gpu, host)
        if refusal:
            raise Eagle3Error(refusal)
    writes = disk_writes(plans, complete)
    refusal = disk_refusal(writes, cluster, artifacts)
    if refusal:
        raise Eagle3Error(refusal)
