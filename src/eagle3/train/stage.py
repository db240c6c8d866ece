"""The train stage: train the EAGLE-3 drafter with the TTT unroll under Lightning.

Data: `train.hidden_states=offline` reads the extract stage's shards (aux + final hidden
states per token); `online` reads the data stage's token ids and runs the target inside
the step through the same capture code (eagle3.core.target.capture_hidden_states); `engine`
reads the token ids and a vLLM server this stage starts captures each item's states, as the
extract stage's vllm backend writes them to shards (eagle3.train.engine_states).
Start: a fresh drafter, or train.init_from's weights (same shapes and vocab map).
Batches: length-bucketed, right-padded, one deterministic order per (seed, epoch), sharded
over DDP ranks, resumable mid-epoch. AdamW, linear warmup then cosine, grad clipping.

Output folder (stage "train", hashed by drafter + train + target + seed, upstream data and,
offline, extract): checkpoints/ (last.ckpt every train.checkpoint_every_n_steps and each
epoch, epoch*.ckpt, best.ckpt by val tau_hat), drafter.safetensors (final weights),
best.safetensors (best val tau_hat), drafter_config.json, manifest.json.

The parts live beside it: drafter_module (the LightningModule), datamodule (datasets, samplers,
the DataModule), callbacks (checkpoints, throughput); this module checks the inputs, builds the
trainer and runs the stage. `python -m eagle3.train` (app.py) runs it.
"""

from __future__ import annotations

import contextlib
import functools
import signal
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException
from safetensors.torch import save_file
from torch.utils.data import Dataset

from eagle3.core.artifacts import StageOutput
from eagle3.core.common import Eagle3Error, log, resolve_device
from eagle3.core.config import (
    ClusterConfig,
    Config,
    DrafterConfig,
    SpecConfig,
    TrackingConfig,
    TrainConfig,
    TrainerConfig,
)
from eagle3.core.drafter import Eagle3Drafter, build_drafter
from eagle3.core.drafter_io import (
    BEST_WEIGHTS,
    CHECKPOINTS,
    DRAFTER_CONFIG,
    FINAL_WEIGHTS,
    drafter_weights,
    load_drafter,
    load_trained_drafter,
    save_drafter_config,
)
from eagle3.core.lifecycle import Stopped
from eagle3.core.outputs import data_output, shards_output, train_output
from eagle3.core.spec import resolve_spec
from eagle3.core.target import Target, load_target, resolve_target_path, tokenizer_hash
from eagle3.core.target_parts import load_target_parts
from eagle3.core.tracking import stage_run
from eagle3.data.vocab import load_vocab_map
from eagle3.train.callbacks import (
    AtomicCheckpointIO,
    GpuBusy,
    StopAtStepEnd,
    Throughput,
    checkpoint_callbacks,
)
from eagle3.train.datamodule import DrafterData, datasets_for, needs_whole_target
from eagle3.train.distributed import (
    cluster_plugins,
    global_rank,
    local_rank,
    lost_peer_error,
    peer_lost,
    requeue_callbacks,
    requeue_signal_free,
    strategy_for,
    under_slurm,
    wait_for_rank_zero,
)
from eagle3.train.drafter_module import DrafterModule


@dataclass(frozen=True)
class TrainSettings:
    """The config sections a training reads (train.init_from may name a models:/ drafter, the
    tracking section's URI finds it)."""

    train: TrainConfig
    trainer: TrainerConfig
    drafter: DrafterConfig
    cluster: ClusterConfig
    tracking: TrackingConfig
    seed: int


# ---------------------------------------------------------------- guard rails


def check_engine_states(tcfg: TrainConfig, trainer_cfg: TrainerConfig) -> None:
    """train.hidden_states=engine: one capture server per training process, so one process."""
    if tcfg.hidden_states != "engine":
        return
    devices = str(trainer_cfg.devices)
    if (devices.isdigit() and int(devices) > 1) or int(trainer_cfg.num_nodes) > 1:
        raise Eagle3Error(
            f"train.hidden_states=engine starts one capture server in the training process: train "
            f"with trainer.devices=1 and trainer.num_nodes=1 (not {trainer_cfg.devices} x "
            f"{trainer_cfg.num_nodes}), or extract the shards and train offline"
        )


def check_inputs(
    tcfg: TrainConfig,
    drafter_cfg: DrafterConfig,
    target: Target,
    data_manifest: dict,
    d2t: torch.Tensor,
    t2d: torch.Tensor,
    sample: dict | None,
) -> None:
    """Refuse, before the first step, inputs that would train a useless drafter."""
    hidden = drafter_cfg.hidden_size
    if hidden is not None and hidden != target.hidden_size:
        raise Eagle3Error(
            f"drafter.hidden_size={hidden} but the target's hidden size is {target.hidden_size}: the "
            "drafter's embedding is the target's, so they must match (set drafter.hidden_size=null)"
        )
    if t2d.numel() != target.vocab_size:
        raise Eagle3Error(
            f"the vocab map covers {t2d.numel()} target tokens but the target has {target.vocab_size}: "
            "it was built for another target; rerun `python -m eagle3.data`"
        )
    if d2t.numel() != drafter_cfg.draft_vocab_size:
        raise Eagle3Error(
            f"the vocab map has {d2t.numel()} draft tokens, drafter.draft_vocab_size is "
            f"{drafter_cfg.draft_vocab_size}"
        )
    recorded = data_manifest.get("counts", {}).get("tokenizer_hash")
    current = tokenizer_hash(target.tokenizer)
    if recorded != current:
        raise Eagle3Error(
            f"the data and vocab map were built with another tokenizer (hash {recorded}) than the "
            f"target's ({current}); rerun `python -m eagle3.data` for this target"
        )
    if sample is not None and "aux_hidden" in sample:
        aux, last = sample["aux_hidden"].shape[-1], sample["last_hidden"].shape[-1]
        if aux != 3 * target.hidden_size or last != target.hidden_size:
            raise Eagle3Error(
                f"the shards hold aux states of width {aux} and final states of width {last}, the "
                f"target needs {3 * target.hidden_size} and {target.hidden_size}: they were extracted "
                "from another target; rerun `python -m eagle3.extract`"
            )
    if tcfg.attention == "flex" and not torch.cuda.is_available():
        raise Eagle3Error(
            "train.attention=flex needs a GPU (flex_attention has no CPU backward); "
            "use train.attention=sdpa on CPU"
        )


def check_shards(shards: StageOutput, data_hash: str, target_name: str, verify: bool) -> None:
    if not shards.complete:
        raise Eagle3Error(
            f"no complete hidden-state shards at {shards.path}: run `python -m eagle3.extract` "
            "(or train.hidden_states=online)"
        )
    shards.check_files(verify)
    recorded = shards.manifest().get("upstream", {}).get("data")
    if recorded != data_hash:
        raise Eagle3Error(
            f"the shards at {shards.path} were extracted from data {recorded}, this config's data "
            f"(target {target_name}) is {data_hash}: another target or data set; rerun "
            "`python -m eagle3.extract` or point train.shards at the right folder"
        )


# ---------------------------------------------------------------- trainer


def in_multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def choose_strategy(trainer_cfg: TrainerConfig, multirun: bool) -> str:
    """Lightning's ddp re-launches the script per rank; under a Hydra multirun that re-runs the
    whole sweep in every rank, so there ddp becomes ddp_spawn (processes forked from this job)."""
    strategy = trainer_cfg.strategy
    if under_slurm():  # srun started one task per rank: nothing to launch or spawn
        return strategy
    if multirun and trainer_cfg.devices != 1 and strategy in ("ddp", "auto"):
        log.warning(
            "trainer.strategy=%s under a Hydra multirun: using ddp_spawn so ranks do not re-run the "
            "sweep",
            strategy,
        )
        return "ddp_spawn"
    return strategy


def trains_on_gpu(trainer_cfg: TrainerConfig) -> bool:
    return trainer_cfg.accelerator in ("gpu", "cuda") or (
        trainer_cfg.accelerator == "auto" and torch.cuda.is_available()
    )


def precision_for(trainer_cfg: TrainerConfig) -> str:
    if trainer_cfg.precision != "auto":
        return trainer_cfg.precision
    return "bf16-mixed" if trains_on_gpu(trainer_cfg) else "32-true"


def build_trainer(
    tcfg: TrainConfig,
    trainer_cfg: TrainerConfig,
    cluster: ClusterConfig,
    folder: Path,
    logger,
    callbacks=(),
) -> L.Trainer:
    return L.Trainer(
        accelerator=trainer_cfg.accelerator,
        devices=trainer_cfg.devices,
        num_nodes=trainer_cfg.num_nodes,
        strategy=strategy_for(trainer_cfg, choose_strategy(trainer_cfg, in_multirun())),
        plugins=[*cluster_plugins(cluster), AtomicCheckpointIO()],
        precision=precision_for(trainer_cfg),
        max_epochs=tcfg.epochs,
        gradient_clip_val=tcfg.grad_clip,
        accumulate_grad_batches=tcfg.grad_accum,
        check_val_every_n_epoch=tcfg.val_every_n_epochs,
        default_root_dir=str(folder),
        logger=logger if logger is not None else False,
        callbacks=[
            *checkpoint_callbacks(folder / CHECKPOINTS, tcfg.checkpoint_every_n_steps),
            *requeue_callbacks(cluster),
            *callbacks,
        ],
        use_distributed_sampler=False,
        num_sanity_val_steps=0,
        log_every_n_steps=trainer_cfg.log_every_n_steps,
        enable_progress_bar=trainer_cfg.progress_bar,
        enable_model_summary=False,
    )


def resume_checkpoint(folder: Path, set_aside: bool = True) -> Path | None:
    """The newest checkpoint that loads, of last.ckpt, the hpc_ckpt_<n>.ckpt Lightning saves on the
    requeue signal and the epoch checkpoints. A damaged one (a save cut short before saves were
    atomic, a disk fault) is named and, by rank 0 (`set_aside`), renamed to <name>.damaged (kept,
    never deleted); then the next one is tried, and the line says which the run resumes from or
    that it starts over."""
    found = [
        folder / CHECKPOINTS / "last.ckpt",
        *folder.glob("hpc_ckpt_*.ckpt"),
        *(folder / CHECKPOINTS).glob("epoch*.ckpt"),
    ]
    found = sorted(
        (path for path in found if path.exists()),
        key=lambda path: path.stat().st_mtime_ns,
        reverse=True,
    )
    damaged = False
    for path in found:
        problem = checkpoint_problem(path)
        if problem is None:
            if damaged:
                step = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
                log.warning(
                    "train: resuming from %s (step %d), the newest good checkpoint",
                    path,
                    step["global_step"],
                )
            return path
        damaged = True
        aside = set_checkpoint_aside(path) if set_aside else path
        log.warning("train: %s is damaged (%s); set aside as %s", path, problem, aside.name)
    if damaged:
        log.warning("train: no good checkpoint left in %s: training starts over", folder)
    return None


def checkpoint_problem(path: Path) -> str | None:
    """Why a checkpoint cannot be resumed from (None: it loads and holds a training state; a
    folder, a sharded checkpoint, is left to Lightning)."""
    if path.is_dir():
        return None
    try:
        state = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except Exception as err:  # torch names a cut zip archive, a bad pickle, a short file
        return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if not isinstance(state, dict) or "state_dict" not in state or "global_step" not in state:
        return "not a training checkpoint"
    return None


def set_checkpoint_aside(path: Path) -> Path:
    """Rename a damaged checkpoint to <name>.damaged (a free name: .damaged-2, -3...)."""
    aside, number = path.with_name(f"{path.name}.damaged"), 1
    while aside.exists():
        number += 1
        aside = path.with_name(f"{path.name}.damaged-{number}")
    path.rename(aside)
    return aside


def fit(
    settings: TrainSettings,
    target: Target,
    datamodule: DrafterData,
    folder: Path,
    d2t: torch.Tensor,
    t2d: torch.Tensor,
    logger=None,
    callbacks=(),
    evaluation: dict | None = None,
) -> dict:
    """Train into `folder` (resuming from its last.ckpt if any); returns the final val metrics."""
    tcfg, trainer_cfg = settings.train, settings.trainer
    L.seed_everything(settings.seed, workers=True, verbose=False)
    drafter = build_drafter(target, settings.drafter).float()
    drafter.set_vocab_map(d2t.to(drafter.d2t.device), t2d.to(drafter.t2d.device))
    if tcfg.init_from:
        start_from(drafter, tcfg.init_from, target, settings.tracking.uri)
    module = DrafterModule(drafter, target.output_embedding(), tcfg, target, evaluation)
    throughput = Throughput(
        0 if trainer_cfg.progress_bar else trainer_cfg.log_every_n_steps,
        GpuBusy(trainer_cfg.gpu_busy_from_step, trainer_cfg.gpu_busy_steps),
    )
    last = folder / CHECKPOINTS / "last.ckpt"
    stopper = StopAtStepEnd(last)
    trainer = build_trainer(
        tcfg, trainer_cfg, settings.cluster, folder, logger, [throughput, *callbacks, stopper]
    )
    resume = resume_checkpoint(folder, set_aside=trainer.global_rank == 0)
    if resume is not None:
        log.info("resuming from %s", resume)
    cudnn = torch.backends.cuda.cudnn_sdp_enabled()  # process-wide: restored after the fit
    torch.backends.cuda.enable_cudnn_sdp(trainer_cfg.cudnn_attention)  # a no-op without CUDA
    try:
        with stopper.installed(trainer.world_size == 1), requeue_signal_free(settings.cluster):
            trainer.fit(module, datamodule=datamodule, ckpt_path=resume and str(resume))
    except SIGTERMException:  # a SystemExit with status 0: the run was stopped, not finished
        raise Stopped(stopper.signum or signal.SIGTERM) from None
    except RuntimeError as err:
        if trainer.world_size > 1 and peer_lost(err):
            raise lost_peer_error(err, trainer.world_size, trainer.num_nodes, last) from err
        raise
    finally:
        torch.backends.cuda.enable_cudnn_sdp(cudnn)
    if stopper.signum is not None:  # signalled after the last step: the fit's last.ckpt holds it
        raise Stopped(stopper.signum)
    if trainer.is_global_zero:
        write_weights(folder, drafter)
    return {
        **{k: float(v) for k, v in trainer.callback_metrics.items()},
        **getattr(throughput, "result", {}),
    }


# what must agree for one drafter's weights to start another's training
SHAPE_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "draft_vocab_size",
    "target_hidden_size",
    "aux_layer_ids",
)


def start_from(
    drafter: Eagle3Drafter, source: str, target: Target, tracking_uri: str | None = None
) -> None:
    """Load train.init_from's weights (a train output folder, an export, its sglang/vllm folder or a
    models:/ URI) into `drafter`; its shapes and vocab map must equal this run's, else an error names them."""
    if (Path(source) / DRAFTER_CONFIG).exists():
        initial = load_trained_drafter(source, target)
    else:
        initial = load_drafter(source, tracking_uri=tracking_uri)
    ours, theirs = drafter.config, initial.config
    problems = [
        f"{key} {getattr(theirs, key, None)} (this run: {getattr(ours, key)})"
        for key in SHAPE_KEYS
        if _plain(getattr(theirs, key, None)) != _plain(getattr(ours, key))
    ]
    if not problems and not (
        torch.equal(initial.d2t.cpu(), drafter.d2t.cpu())
        and torch.equal(initial.t2d.cpu(), drafter.t2d.cpu())
    ):
        problems.append(
            "its vocab map differs from this run's data stage's (another data config or draft vocab)"
        )
    if problems:
        raise Eagle3Error(
            f"train.init_from={source} cannot start this training: " + "; ".join(problems)
        )
    weights = {k: v for k, v in initial.state_dict().items() if not k.startswith("embed_tokens.")}
    drafter.load_state_dict(weights, strict=False)
    log.info("train: starting from the weights of %s", source)


def _plain(value):
    return list(value) if isinstance(value, (list, tuple)) else value


def write_weights(folder: Path, drafter: Eagle3Drafter) -> None:
    save_drafter_config(drafter, folder)
    save_file(drafter_weights(folder / CHECKPOINTS / "last.ckpt"), str(folder / FINAL_WEIGHTS))
    best = folder / CHECKPOINTS / "best.ckpt"
    if best.exists():
        save_file(drafter_weights(best), str(folder / BEST_WEIGHTS))


# ---------------------------------------------------------------- the stage


def evaluation_for(
    tcfg: TrainConfig, spec_cfg: SpecConfig, tree_temperature: float, val_set: Dataset
) -> dict:
    """Held-out prompts (token ids before the first trained token) for measured acceptance."""
    if not tcfg.eval_prompts:
        return {}
    prompts = []
    for index in range(min(tcfg.eval_prompts, len(val_set))):
        item = val_set[index]
        trained = item["loss_mask"].nonzero()
        cut = int(trained[0]) if len(trained) else len(item["input_ids"])
        prompts.append(item["input_ids"][: max(cut, 1)].tolist())
    return {
        "prompts": prompts,
        "spec": resolve_spec(spec_cfg),
        "max_new_tokens": tcfg.eval_max_new_tokens,
        "tree_temperature": tree_temperature,
    }


def target_device(tcfg: TrainConfig, trainer_cfg: TrainerConfig, device_name: str) -> str:
    """Offline the target only lends its embedding and lm_head: CPU. Online it runs in every step:
    this rank's GPU (and so the GPU dtype), when there is one (target.device)."""
    if tcfg.hidden_states != "online" or trainer_cfg.accelerator == "cpu":
        return "cpu"
    device = resolve_device(device_name)
    return f"cuda:{local_rank()}" if device.type == "cuda" else str(device)


def run(cfg: Config, callbacks=()) -> StageOutput:
    """Train the drafter this config describes (a no-op when its output is complete). Rank 0
    holds the output folder's lock while it trains: a second training of the same config started
    meanwhile waits, then finds the output finished and reuses it."""
    out = train_output(cfg)
    if out.reusable(cfg.verify):
        return out
    if global_rank(cfg.trainer.devices) > 0:  # the ranks of one training: rank 0 holds the lock
        return train_into(cfg, out, callbacks)
    with out.lock():
        if out.reusable(cfg.verify):
            return out
        return train_into(cfg, out, callbacks)


def train_into(cfg: Config, out: StageOutput, callbacks=()) -> StageOutput:
    """Check the inputs, train into `out`, write its manifest (rank 0)."""
    tcfg = cfg.train
    data = data_output(cfg)
    if not data.complete:
        raise Eagle3Error(
            f"no complete data stage output at {data.path}: run `python -m eagle3.data` first"
        )
    data.check_files(cfg.verify)
    shards = shards_output(cfg) if tcfg.hidden_states == "offline" else None
    if shards is not None:
        check_shards(shards, data.hash, cfg.target.name, cfg.verify)
    check_engine_states(tcfg, cfg.trainer)
    if needs_whole_target(tcfg):
        target = load_target(
            cfg.target, cfg.paths.artifacts, target_device(tcfg, cfg.trainer, cfg.target.device)
        )
    else:
        target = load_target_parts(cfg.target, cfg.paths.artifacts)
    settings = TrainSettings(tcfg, cfg.trainer, cfg.drafter, cfg.cluster, cfg.tracking, cfg.seed)
    with contextlib.ExitStack() as stack:
        capture = None
        if tcfg.hidden_states == "engine":  # a vLLM server captures every item's states
            from eagle3.extract.vllm_capture import capture_launch, target_shape
            from eagle3.train.engine_states import capture_server

            path = resolve_target_path(cfg.target, Path(cfg.paths.artifacts))
            shape = target_shape(cfg.target, path)
            command = functools.partial(capture_launch, cfg, shape)
            capture = stack.enter_context(capture_server(command, cfg.extract, shape))
        datasets = datasets_for(tcfg, cfg.extract.dtype, data.path, shards, capture)
        evaluate = functools.partial(evaluation_for, tcfg, cfg.spec, cfg.engine.tree_temperature)
        record = functools.partial(stage_run, cfg, "train", artifact_hash=out.hash)
        return train_with(settings, out, data, target, datasets, evaluate, record, callbacks)


def train_with(
    settings: TrainSettings,
    out: StageOutput,
    data: StageOutput,
    target,
    datasets: tuple[Dataset, Dataset],
    evaluate,
    record,
    callbacks=(),
) -> StageOutput:
    """Train on the data stage's rows (`datasets`: states from shards, the target or a capture
    server), measuring acceptance on `evaluate(val_set)`'s prompts; rank 0 records the run with
    `record()` (an MLflow run, or None)."""
    tcfg, trainer_cfg = settings.train, settings.trainer
    d2t, t2d = load_vocab_map(data.path)
    train_set, val_set = datasets
    check_inputs(
        tcfg,
        settings.drafter,
        target,
        data.manifest(),
        d2t,
        t2d,
        train_set[0] if len(train_set) else None,
    )
    datamodule = DrafterData(
        train_set,
        val_set,
        tcfg,
        settings.seed,
        target.tokenizer.pad_token_id or 0,
        trainer_cfg.num_workers,
        pin_memory=trains_on_gpu(trainer_cfg),
    )
    evaluation = evaluate(val_set)
    rank = global_rank(trainer_cfg.devices)
    if rank > 0:  # train only; rank 0 owns the folder, its manifest and the MLflow run
        fit(
            settings,
            target,
            datamodule,
            out.path,
            d2t,
            t2d,
            callbacks=callbacks,
            evaluation=evaluation,
        )
        timeout = trainer_cfg.dist_timeout_s
        wait_for_rank_zero(lambda: out.complete, out.path, rank, timeout)
        log.info("train: rank %d done; rank 0 wrote %s", rank, out.path)
        return out
    out.start()
    with record() as mlflow_run:
        logger = None
        if mlflow_run is not None:
            from lightning.pytorch.loggers import MLFlowLogger

            logger = MLFlowLogger(
                experiment_name=settings.tracking.experiment,
                tracking_uri=settings.tracking.uri,
                run_id=mlflow_run.info.run_id,
            )
        metrics = fit(
            settings, target, datamodule, out.path, d2t, t2d, logger, callbacks, evaluation
        )
    counts = {
        "train_sequences": len(train_set),
        "val_sequences": len(val_set),
        "tau_hat": best_tau_hat(out.path, metrics),
        "val_loss": metrics.get("val/loss"),
        "tokenizer_hash": data.manifest().get("counts", {}).get("tokenizer_hash"),
        "data_hash": data.hash,
        **{
            k.removeprefix("train/"): v
            for k, v in metrics.items()
            if k
            in (
                "train/seconds",
                "train/samples_per_s",
                "train/tokens_per_s",
                "train/tokens_per_s_per_device",
                "train/padding_share",
                "train/gpu_busy_pct",
                "train/devices",
                "train/peak_memory_gib",
            )
        },
        # per TTT step, so a run without MLflow (a GPU box) still reports them
        "val_acc": [metrics.get(f"val/acc_{k}") for k in range(tcfg.ttt_length)],
        # the last validation's, over each sequence's first train.val_head_tokens tokens (ttt.py)
        "tau_hat_head": metrics.get("val/tau_hat_head"),
        "val_acc_head": [metrics.get(f"val/acc_head_{k}") for k in range(tcfg.ttt_length)],
    }
    out.finish(counts)
    log.info(
        "train: wrote %s (val tau_hat %.3f; over the first %s tokens, the last validation: %.3f)",
        out.path,
        counts["tau_hat"] or float("nan"),
        tcfg.val_head_tokens,
        counts["tau_hat_head"] or float("nan"),
    )
    return out


def best_tau_hat(folder: Path, metrics: dict) -> float | None:
    best = folder / CHECKPOINTS / "best.ckpt"
    if best.exists():
        callbacks = torch.load(best, map_location="cpu", weights_only=False).get("callbacks", {})
        for state in callbacks.values():
            if state.get("monitor") == "val/tau_hat" and state.get("best_model_score") is not None:
                return float(state["best_model_score"])
    return metrics.get("val/tau_hat")
