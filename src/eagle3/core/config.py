"""Typed configs: one dataclass schema per config group, registered with Hydra's ConfigStore.

`conf/config.yaml` starts from `eagle3_schema` (the `Config` below), so a misspelt key or a value of
the wrong type fails at composition with Hydra's own error. Groups whose options hold different keys
(target, serve) have a base class here and one subclass per kind; each option's yaml names its schema
in its defaults list. What a field means is said beside it in its yaml under conf/.

`typed(cfg)` turns a composed config into these dataclasses once, at each app's entry. The whole
`Config` goes to the entries (each app's `main`, the stage runs a pipeline chains, bench.app.run_job),
the stage-hash functions of eagle3.core.outputs (a stage's hash covers sections of several groups),
the few places that log or mask all of it (core.tracking.stage_run, core.redact.masked_config), and
the composition roots that turn it into built objects: bench.app.bench_job, serve.launch.engine_setup
(what an engine start reads), data.regen.regeneration, engine.service.service_for and
drafter_source_for, serve.drafter.drafter_for, extract.vllm_capture.capture_launch,
train.stage.train_into and the pipeline's plan (print_plan, plan.stage_plans); core.config.read_nested
checks it as a whole. Other
functions take the typed sections or the built objects they read. Fields declared with `ranged(...)`
hold the values they may take; `typed` refuses one outside it with one line naming the key, its value
and the range (OutOfRange).
"""

# OmegaConf reads these annotations to type the nodes; it knows typing.Dict/List/Optional.
# ruff: noqa: UP006, UP007, UP035, UP045
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue


class OutOfRange(ValueError):
    """A config value outside the range its schema allows (printed as one line by the apps)."""


@dataclass(frozen=True)
class Range:
    """The values a numeric field may take: low/high bounds (None = unbounded), each closed or open;
    null passes when the field is Optional."""

    low: Optional[float] = None
    high: Optional[float] = None
    low_open: bool = False
    high_open: bool = False

    def allows(self, value: Any) -> bool:
        if value is None:
            return True
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def __str__(self) -> str:
        if self.high is None:
            return f"{'>' if self.low_open else '>='} {self.low:g}"
        if self.low is None:
            return f"{'<' if self.high_open else '<='} {self.high:g}"
        return (
            f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}"
            f"{')' if self.high_open else ']'}"
        )


def ranged(default: Any = MISSING, **bounds: Any) -> Any:
    """A dataclass field whose value must lie in Range(**bounds) (checked by `typed`)."""
    return field(default=default, metadata={"range": Range(**bounds)})


def at_least(low: float, default: Any = MISSING) -> Any:
    return ranged(default, low=low)


def above(low: float, default: Any = MISSING) -> Any:
    return ranged(default, low=low, low_open=True)


def check_ranges(node: Any, prefix: str = "") -> None:
    """Raise OutOfRange for the first field of a typed config (walked depth first) outside its range."""
    if not dataclasses.is_dataclass(node) or isinstance(node, type):
        return
    for item in dataclasses.fields(node):
        value = getattr(node, item.name)
        key = f"{prefix}{item.name}"
        bounds = item.metadata.get("range")
        if bounds is not None and isinstance(value, (int, float)) and not bounds.allows(value):
            nullable = " or null" if item.default is None else ""
            raise OutOfRange(f"{key}={value} is out of range: it must be {bounds}{nullable}")
        check_ranges(value, f"{key}.")


# ------------------------------------------------------------------ target


@dataclass
class TargetConfig:
    name: str = MISSING
    kind: str = MISSING
    path: Optional[str] = MISSING  # no default: a `???` in an option's yaml must stay missing
    aux_layer_ids: Optional[List[int]] = None
    dtype: str = MISSING
    device: str = MISSING
    trust_remote_code: bool = False
    plan: Any = None  # planning hints: a dict, or null


@dataclass
class GgufTargetConfig(TargetConfig):
    package: str = MISSING
    gguf_file: str = MISSING
    rope_theta: int = MISSING
    model_max_length: int = MISSING


@dataclass
class HfTargetConfig(TargetConfig):
    pass


@dataclass
class RandomTargetConfig(TargetConfig):
    seed: int = MISSING
    num_layers: int = MISSING
    hidden_size: int = MISSING
    intermediate_size: int = MISSING
    num_heads: int = MISSING
    num_kv_heads: int = MISSING
    max_position_embeddings: int = MISSING
    rope_theta: int = MISSING
    model_max_length: int = MISSING


@dataclass
class RandomMoeTargetConfig(TargetConfig):
    seed: int = MISSING
    shard_size: str = MISSING
    rope_theta: int = MISSING
    model_max_length: int = MISSING
    architecture: Dict[str, Any] = MISSING


# ------------------------------------------------------------------ serve


@dataclass
class ServeConfig:
    engine: str = MISSING
    inprocess: bool = MISSING
    max_depth: Optional[int] = None
    stop_timeout_s: int = MISSING


@dataclass
class HfServeConfig(ServeConfig):
    pass


@dataclass
class ServerConfig(ServeConfig):
    host: str = MISSING
    port: Optional[int] = MISSING
    python: Optional[str] = None
    start_timeout_s: int = MISSING
    error_lines: int = MISSING
    watchdog_poll_s: float = MISSING
    request_timeout_s: int = MISSING
    api_key_env: str = MISSING
    derived_port_offsets: List[int] = field(
        default_factory=list
    )  # ports the engine opens at port + each


@dataclass
class LocalServeConfig(ServerConfig):
    drafter_fallback: str = MISSING
    default_max_tokens: int = MISSING
    default_temperature: float = MISSING
    max_tokens_limit: int = MISSING
    disconnect_poll_s: float = MISSING
    grace_s: int = MISSING
    log_level: str = MISSING


@dataclass
class SglangServeConfig(ServerConfig):
    version: str = MISSING
    validate_args: bool = MISSING
    tp_size: int = MISSING
    mem_fraction_static: float = MISSING
    dtype: str = MISSING
    cuda_graph_max_bs: int = MISSING
    env: Dict[str, Any] = field(default_factory=dict)
    tolerate_config_names: List[str] = field(default_factory=list)
    extra_args: List[str] = field(default_factory=list)


@dataclass
class VllmServeConfig(ServerConfig):
    dtype: str = MISSING
    max_model_len: int = MISSING
    max_num_seqs: int = MISSING
    enforce_eager: bool = MISSING
    env: Dict[str, Any] = field(default_factory=dict)
    extra_args: List[str] = field(default_factory=list)


# ------------------------------------------------------------------ data


@dataclass
class NormaliseConfig:
    drop_leading_assistant: bool = MISSING
    system_policy: str = MISSING
    system_prompt: Optional[str] = None


@dataclass
class FiltersConfig:
    min_turns: int = MISSING
    max_turns: Optional[int] = None
    max_chars: Optional[int] = None
    dedup_first_prompt: bool = MISSING


@dataclass
class RegenConfig:
    backend: str = MISSING
    max_new_tokens: int = at_least(1)
    temperature: float = at_least(0)
    top_p: float = ranged(low=0, high=1, low_open=True)
    batch_size: int = at_least(1)
    base_url: str = MISSING
    model: Optional[str] = None
    api_key_env: str = MISSING
    concurrency: int = at_least(1)
    timeout_s: int = MISSING
    max_retries: int = at_least(0)
    loop_ngram: int = MISSING
    backoff_s: float = MISSING
    drop_failed: bool = MISSING
    reuse_answers: Any = None  # a turns.jsonl path, a list of them, or null
    seed: Optional[int] = None
    reasoning: Optional[str] = None  # null | keep | drop | off
    reasoning_parser: Optional[str] = None
    think_tags: List[str] = field(default_factory=lambda: ["<think>", "</think>"])
    thinking_switch: str = "thinking"
    keep_truncated: bool = False


@dataclass
class ExtraSourceConfig:
    package: str = MISSING
    file: str = MISSING
    where: Any = None  # {field: value} rows must match, or null
    unless: Any = None  # {field: value} rows must not match, or null
    field: str = MISSING


@dataclass
class SelfPromptsConfig:
    count: int = MISSING
    temperature: float = MISSING
    max_new_tokens: int = MISSING
    seed: int = MISSING
    topics: List[str] = MISSING
    instruction: str = MISSING


@dataclass
class DataConfig:
    name: str = MISSING
    source: str = MISSING
    split: str = MISSING
    limit: Optional[int] = at_least(1, default=None)
    seed: int = MISSING
    val_fraction: float = ranged(low=0, high=1, high_open=True)
    normalise: NormaliseConfig = field(default_factory=NormaliseConfig)
    filters: FiltersConfig = field(default_factory=FiltersConfig)
    max_length: int = at_least(1)
    truncation: str = MISSING
    end_of_turn: Optional[str] = None
    tokenize_batch: int = at_least(1)
    vocab_map_from: Optional[str] = None
    regenerate: bool = MISSING
    regen: RegenConfig = field(default_factory=RegenConfig)
    first_turn_copies: int = at_least(0)
    extra_sources: List[ExtraSourceConfig] = field(default_factory=list)
    # a dict here (Hydra cannot override a null dataclass node); typed() reads it as SelfPromptsConfig
    self_prompts: Any = None


# ------------------------------------------------------------------ drafter, extract, train, export


@dataclass
class DrafterConfig:
    num_layers: int = at_least(1)
    draft_vocab_size: int = at_least(1)
    hidden_size: Optional[int] = None
    intermediate_size: Optional[int] = None
    num_heads: Optional[int] = None
    num_kv_heads: Optional[int] = None
    max_position_embeddings: Optional[int] = None
    path: Optional[str] = None


@dataclass
class ShippedConfig:
    use: str = MISSING
    asset: str = MISSING


@dataclass
class ExtractConfig:
    engine: ServeConfig = MISSING
    backend: str = MISSING
    tensor_parallel_size: int = MISSING
    pipeline_parallel_size: int = MISSING
    concurrency: int = MISSING
    batch_tokens: int = MISSING
    shard_tokens: int = MISSING
    dtype: str = MISSING
    splits: List[str] = MISSING
    verify: bool = MISSING
    writers: int = MISSING
    disk_margin: float = MISSING


@dataclass
class TrainConfig:
    hidden_states: str = MISSING
    shards: Optional[str] = None
    ttt_length: int = at_least(1)
    step_decay: float = above(0)
    attention: str = MISSING
    compile_loss: Any = MISSING  # auto | true | false
    compile_unroll: Any = MISSING  # auto | true | false
    compile_target: Any = MISSING  # auto | true | false
    max_length: int = at_least(1)
    batch_size: int = at_least(1)
    bucket_batches: int = at_least(1)
    length_buckets: Optional[List[int]] = None
    grad_accum: int = at_least(1)
    epochs: int = at_least(1)
    limit: Optional[int] = at_least(1, default=None)
    lr: float = at_least(0)  # 0 keeps the starting weights (train.init_from measured as it is)
    weight_decay: float = at_least(0)
    betas: List[float] = MISSING
    warmup_ratio: float = ranged(low=0, high=1)
    grad_clip: float = at_least(0)
    adamw: str = MISSING
    init_from: Optional[str] = None
    val_every_n_epochs: int = at_least(1)
    val_head_tokens: int = MISSING
    checkpoint_every_n_steps: int = at_least(1)
    eval_prompts: int = at_least(0)
    eval_max_new_tokens: int = at_least(1)


@dataclass
class TrainerConfig:
    accelerator: str = MISSING
    devices: int = MISSING
    num_nodes: int = MISSING
    strategy: str = MISSING
    fsdp_sharding: str = MISSING
    dist_timeout_s: int = MISSING
    precision: str = MISSING
    num_workers: int = MISSING
    log_every_n_steps: int = MISSING
    progress_bar: bool = MISSING
    cudnn_attention: bool = MISSING
    gpu_busy_from_step: int = MISSING
    gpu_busy_steps: int = MISSING


@dataclass
class ExportConfig:
    dtype: Optional[str] = None
    include_embedding: bool = MISSING
    speculators: bool = MISSING
    speculative_tokens: int = MISSING
    register: bool = MISSING
    registry_name: Optional[str] = None
    checkpoint: Optional[str] = None


# ------------------------------------------------------------------ spec, engine, bench, study


@dataclass
class SpecConfig:
    enabled: bool = MISSING
    depth: int = MISSING
    steps: Optional[int] = None
    topk: int = MISSING
    schedule: bool = False  # spec=auto: the load sweep's schedule beside the drafter (serve=local)


@dataclass
class EngineConfig:
    max_context: int = MISSING
    cuda_graphs: Any = MISSING  # auto | true | false
    lean_forward: bool = MISSING
    eager_cudnn_attention: bool = MISSING
    compile_layers: Any = MISSING  # auto | true | false
    compile_draft: Any = MISSING  # auto | true | false
    overlap_steps: bool = MISSING
    draft_attention: str = MISSING
    tree_temperature: float = MISSING
    prefill_graphs: List[int] = MISSING
    compile_prefill: bool = MISSING
    max_batch_size: Any = MISSING  # auto | an integer | null
    auto_batch_size: Dict[str, int] = MISSING
    schedule: str = MISSING
    deterministic: bool = MISSING
    graph_batch_sizes: List[int] = MISSING
    seed: int = MISSING
    cpu_threads: Optional[int] = None


@dataclass
class SuiteConfig:
    package: str = MISSING
    file: str = MISSING
    where: Any = None  # {field: value} rows must match, or null
    field: str = MISSING


@dataclass
class BenchConfig:
    suite: Any = MISSING  # a suite name, or a list of them
    prompts: Optional[str] = None
    limit: Optional[int] = None
    max_new_tokens: int = MISSING
    temperature: float = MISSING
    top_p: float = MISSING
    ignore_eos: bool = MISSING
    batch_size: int = MISSING
    warmup: Optional[int] = MISSING
    stream: bool = MISSING
    repeats: int = MISSING
    min_repeats: int = MISSING
    reuse_baseline: bool = MISSING
    accepts_nothing_tau: float = MISSING
    winner_min_prompts: int = MISSING
    winner_min_repeats: int = MISSING
    check_outputs: bool = MISSING
    cost_model_depths: List[int] = MISSING
    suites: Dict[str, SuiteConfig] = field(default_factory=dict)


@dataclass
class StudyConfig:
    sizes: List[float] = MISSING
    size_unit: str = MISSING
    suites: List[str] = MISSING
    prompts: int = MISSING
    max_new_tokens: int = MISSING
    extrapolate: int = MISSING
    goal_tau: List[float] = MISSING
    compile: bool = MISSING
    log_from: Any = None  # a study.json path, a list of them, or null
    references: List[Dict[str, Any]] = field(default_factory=list)
    compare: Any = None  # study.json paths, or null
    label: Optional[str] = None


@dataclass
class SearchConfig:
    min_steps: int = MISSING
    max_steps: int = MISSING


# ------------------------------------------------------------------ pipeline, bundle, tracking, cluster


@dataclass
class EngineRateConfig:
    tokens_per_s: float = MISSING
    active_params: int = MISSING
    engine: str = MISSING
    hardware: str = MISSING
    concurrency: Optional[int] = None
    document: str = MISSING


@dataclass
class PlanRatesConfig:
    active_params: int = MISSING
    regen_tokens_per_s: int = MISSING
    regen_document: str = MISSING
    capture_tokens_per_s: int = MISSING
    capture_document: str = MISSING
    train_tokens_per_s: int = MISSING
    train_cost_per_token: int = MISSING
    regen_engine: Optional[EngineRateConfig] = None
    capture_engine: Optional[EngineRateConfig] = None


@dataclass
class EngineOverheadConfig:
    sglang_gb: Optional[float] = None
    vllm_gb: Optional[float] = None
    document: Optional[str] = None


@dataclass
class PlanConfig:
    gpu_memory_gb: int = MISSING
    engine_memory_fraction: float = MISSING
    vllm_memory_fraction: float = MISSING
    logit_copies: int = MISSING
    hidden_copies: int = MISSING
    engine_overhead: EngineOverheadConfig = field(default_factory=EngineOverheadConfig)
    rates: PlanRatesConfig = field(default_factory=PlanRatesConfig)


@dataclass
class MemoryConfig:
    measure: List[int] = field(default_factory=list)
    device: str = MISSING
    json: Optional[str] = None


@dataclass
class PipelineConfig:
    stages: List[str] = MISSING
    bench_sweep: List[str] = MISSING
    dry_run: bool = MISSING
    plan_port: int = MISSING
    stop_timeout_s: int = MISSING
    process_memory_gb: float = MISSING
    launcher: Optional[str] = None
    plan: PlanConfig = field(default_factory=PlanConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)


@dataclass
class EngineSetConfig:
    requirements: List[str] = MISSING
    keep: Dict[str, str] = field(default_factory=dict)
    left_out: Dict[str, str] = field(default_factory=dict)
    trim: Dict[str, List[str]] = field(default_factory=dict)
    entry_modules: List[str] = field(default_factory=list)


@dataclass
class BundleConfig:
    out: str = MISSING
    part_mib: float = MISSING
    python_version: str = MISSING
    platforms: List[str] = MISSING
    packages: List[str] = MISSING
    wheel_dirs: List[str] = field(default_factory=list)
    files: List[str] = field(default_factory=list)
    source: bool = MISSING
    engines: List[str] = field(default_factory=list)
    machine_packages: str = MISSING
    machine_modules: Optional[str] = None
    download_cache: str = MISSING
    engine_index_args: List[str] = field(default_factory=list)
    engine_sets: Dict[str, EngineSetConfig] = field(default_factory=dict)


@dataclass
class TrackingConfig:
    enabled: bool = MISSING
    uri: str = MISSING
    artifact_location: str = MISSING
    experiment: str = MISSING
    watchdog_poll_s: float = MISSING
    experiment_kind: str = MISSING
    ui_host: str = MISSING
    ui_port: int = MISSING
    ui_screenshot: Optional[str] = None


@dataclass
class JobShapeConfig:
    nodes: int = MISSING
    tasks_per_node: int = MISSING
    gpus_per_node: int = MISSING
    timeout_min: int = MISSING


@dataclass
class ClusterConfig:
    partition: Optional[str] = None
    account: Optional[str] = None
    qos: Optional[str] = None
    constraint: Optional[str] = None
    timeout_min: int = MISSING
    cpus_per_task: int = MISSING
    mem_gb: int = MISSING
    gpus_per_node: int = MISSING
    disk_gb: Optional[float] = None
    array_parallelism: int = MISSING
    requeue_signal: str = MISSING
    requeue_warning_s: int = MISSING
    train: JobShapeConfig = field(default_factory=JobShapeConfig)
    bench: JobShapeConfig = field(default_factory=JobShapeConfig)
    data: JobShapeConfig = field(default_factory=JobShapeConfig)
    extract: JobShapeConfig = field(default_factory=JobShapeConfig)
    export: JobShapeConfig = field(default_factory=JobShapeConfig)
    job: JobShapeConfig = field(default_factory=JobShapeConfig)


@dataclass
class PathsConfig:
    root: str = MISSING
    artifacts: str = MISSING


# ------------------------------------------------------------------ the primary config


@dataclass
class Config:
    target: TargetConfig = MISSING
    data: DataConfig = MISSING
    drafter: DrafterConfig = MISSING
    shipped: ShippedConfig = MISSING
    extract: ExtractConfig = MISSING
    train: TrainConfig = MISSING
    export: ExportConfig = MISSING
    trainer: TrainerConfig = MISSING
    spec: SpecConfig = MISSING
    serve: ServeConfig = MISSING
    engine: EngineConfig = MISSING
    bench: BenchConfig = MISSING
    study: StudyConfig = MISSING
    pipeline: PipelineConfig = MISSING
    bundle: BundleConfig = MISSING
    tracking: TrackingConfig = MISSING
    cluster: ClusterConfig = MISSING
    paths: PathsConfig = MISSING
    search: Optional[SearchConfig] = None
    debug: bool = False
    seed: int = 0
    verify: bool = False
    # an experiment's record of how its inputs were made (read from the preset file by core.lineage)
    lineage: Optional[List[Dict[str, Any]]] = None


TARGET_KINDS = {
    "gguf_package": GgufTargetConfig,
    "hf": HfTargetConfig,
    "random": RandomTargetConfig,
    "random_moe": RandomMoeTargetConfig,
}
SERVE_ENGINES = {
    "hf": HfServeConfig,
    "local": LocalServeConfig,
    "sglang": SglangServeConfig,
    "vllm": VllmServeConfig,
}


def register() -> None:
    """Store the schemas under the names conf/ refers to (idempotent)."""
    store = ConfigStore.instance()
    store.store(name="eagle3_schema", node=Config)
    for kind, node in TARGET_KINDS.items():
        store.store(group="target", name=f"schema_{kind}", node=node)
    for engine, node in SERVE_ENGINES.items():
        store.store(group="serve", name=f"schema_{engine}", node=node)


def typed(cfg: Any) -> Config:
    """The composed config as the dataclasses above, interpolations resolved. A config composed
    without the schema (a plain dict, or a job file written by an app) is read into it too; Hydra's
    own `hydra` node, when present, is left out (it is Hydra's, read through HydraConfig)."""
    if isinstance(cfg, Config):
        return cfg
    if isinstance(cfg, DictConfig) and OmegaConf.get_type(cfg) is Config:
        if "hydra" in cfg:
            cfg = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])
        return read_nested(OmegaConf.to_object(cfg))
    return from_plain(
        OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else cfg
    )


def from_plain(job: dict) -> Config:
    """A Config from plain data (a job's resolved config): target and serve sections are read into
    the schema their `kind` / `engine` names."""
    job = {k: v for k, v in job.items() if k != "hydra"}
    schema = OmegaConf.structured(Config)
    schema.target = OmegaConf.structured(TARGET_KINDS[job["target"]["kind"]])
    schema.serve = OmegaConf.structured(SERVE_ENGINES[job["serve"]["engine"]])
    schema.extract = OmegaConf.structured(ExtractConfig)
    schema.extract.engine = OmegaConf.structured(SERVE_ENGINES[job["extract"]["engine"]["engine"]])
    return read_nested(OmegaConf.to_object(OmegaConf.merge(schema, job)))


def read_nested(cfg: Config) -> Config:
    """Sections typed as a dict in the schema, read into their dataclass (missing keys fail here);
    every ranged field checked (OutOfRange)."""
    if isinstance(cfg.data.self_prompts, dict):
        cfg.data.self_prompts = section(
            SelfPromptsConfig, cfg.data.self_prompts, "data.self_prompts"
        )
    check_ranges(cfg)
    return cfg


def section(schema: type, values: dict, key: str) -> Any:
    node = OmegaConf.merge(OmegaConf.structured(schema), values)
    missing = [name for name in node if OmegaConf.is_missing(node, name)]
    if missing:
        raise MissingMandatoryValue(f"Missing mandatory value: {key}.{missing[0]}")
    return OmegaConf.to_object(node)


def plain(section: Any) -> Any:
    """A resolved plain-python copy of a typed section, a config node, or a value as it is."""
    if dataclasses.is_dataclass(section) and not isinstance(section, type):
        return dataclasses.asdict(section)
    if OmegaConf.is_config(section):
        return OmegaConf.to_container(section, resolve=True)
    return section


register()
