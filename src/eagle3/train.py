"""`python -m eagle3.train`: train the EAGLE-3 drafter with the TTT unroll under Lightning.

Data: `train.hidden_states=offline` reads the extract stage's shards (aux + final hidden
states per token); `online` reads the data stage's token ids and runs the target inside
the step through the same capture code (eagle3.target.capture_hidden_states).
Start: a fresh drafter, or train.init_from's weights (same shapes and vocab map).
Batches: length-bucketed, right-padded, one deterministic order per (seed, epoch), sharded
over DDP ranks, resumable mid-epoch. AdamW, linear warmup then cosine, grad clipping.

Output folder (stage "train", hashed by drafter + train + target + seed, upstream data and,
offline, extract): checkpoints/ (last.ckpt every train.checkpoint_every_n_steps and each
epoch, epoch*.ckpt, best.ckpt by val tau_hat), drafter.safetensors (final weights),
best.safetensors (best val tau_hat), drafter_config.json, manifest.json.
"""

from __future__ import annotations

import functools
import json
import math
import os
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from omegaconf import DictConfig
from safetensors.torch import load_file, save_file
from torch.utils.data import DataLoader, Dataset, Subset
from transformers import LlamaConfig

from eagle3.artifacts import StageOutput, stage_output, to_plain
from eagle3.common import Eagle3Error, app, log, resolve_device
from eagle3.drafter import Eagle3Drafter, build_drafter
from eagle3.target import Target, capture_hidden_states, load_target, target_key
from eagle3.ttt import tau_hat, ttt_loss

# train.* fields that change how training is watched or where it reads, not what it learns.
HASH_EXCLUDED = (
    "eval_prompts",
    "eval_max_new_tokens",
    "checkpoint_every_n_steps",
    "shards",
    "val_head_tokens",
    "compile_loss",
)
CHECKPOINTS = "checkpoints"
FINAL_WEIGHTS, BEST_WEIGHTS, DRAFTER_CONFIG = (
    "drafter.safetensors",
    "best.safetensors",
    "drafter_config.json",
)


# ---------------------------------------------------------------- stage output


def upstream_hashes(cfg: DictConfig) -> dict:
    from eagle3.data import data_output

    upstream = {"data": data_output(cfg).hash}
    if cfg.train.hidden_states == "offline":
        upstream["extract"] = shards_output(cfg).hash
    return upstream


def shards_output(cfg: DictConfig) -> StageOutput:
    """The extract stage output training reads: train.shards if set, else this config's."""
    from eagle3.extract import extract_output

    expected = extract_output(cfg)
    if not cfg.train.shards:
        return expected
    path = Path(str(cfg.train.shards))
    manifest_path = path / "manifest.json"
    if not manifest_path.exists():
        raise Eagle3Error(f"train.shards={path} has no manifest.json: not an extract output folder")
    manifest = json.loads(manifest_path.read_text())
    return StageOutput(
        "extract",
        manifest.get("hash", "unknown"),
        path,
        manifest.get("config", {}),
        manifest.get("upstream", {}),
    )


def train_output(cfg: DictConfig) -> StageOutput:
    """The train stage's folder for this config (located, not run)."""
    train = {k: v for k, v in to_plain(cfg.train).items() if k not in HASH_EXCLUDED}
    for key in ("init_from", "limit"):  # null: the hashes of runs from before these keys
        if train.get(key) is None:
            train.pop(key, None)
    drafter = {k: v for k, v in to_plain(cfg.drafter).items() if k != "path"}
    sections = {
        "drafter": drafter,
        "train": train,
        "target": target_key(cfg.target),
        "seed": cfg.seed,
    }
    return stage_output(cfg.paths.artifacts, "train", sections, upstream_hashes(cfg))


def save_drafter_config(drafter: Eagle3Drafter, folder: Path) -> None:
    (folder / DRAFTER_CONFIG).write_text(json.dumps(drafter.config.to_dict(), indent=2))


def load_trained_drafter(
    train_dir: str | Path, target: Target, which: str = "best"
) -> Eagle3Drafter:
    """A drafter trained by this stage (`which`: best = best val tau_hat, final = last weights),
    its frozen embedding copied from `target`."""
    train_dir = Path(train_dir)
    weights = train_dir / (BEST_WEIGHTS if which == "best" else FINAL_WEIGHTS)
    if which == "best" and not weights.exists():
        weights = train_dir / FINAL_WEIGHTS
    if not weights.exists() or not (train_dir / DRAFTER_CONFIG).exists():
        raise Eagle3Error(
            f"{train_dir} holds no trained drafter ({weights.name}, {DRAFTER_CONFIG}): "
            "run `python -m eagle3.train`"
        )
    config = LlamaConfig.from_dict(json.loads((train_dir / DRAFTER_CONFIG).read_text()))
    drafter = Eagle3Drafter(config)
    missing, unexpected = drafter.load_state_dict(load_file(str(weights)), strict=False)
    missing = [
        k for k in missing if not k.startswith("embed_tokens.")
    ]  # the embedding is the target's
    if missing or unexpected:
        raise Eagle3Error(
            f"{weights} does not fit the drafter in {DRAFTER_CONFIG}: missing {missing}, "
            f"unexpected {unexpected}"
        )
    drafter.embed_tokens.weight.data.copy_(target.model.get_input_embeddings().weight.data.float())
    return drafter.to(target.device)


# ---------------------------------------------------------------- data


class TokenDataset(Dataset):
    """Online mode: rows of the data stage's split (id, input_ids, loss_mask) as tensors."""

    def __init__(self, split):
        self.split = split
        self.lengths = [len(ids) for ids in split["input_ids"]]

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, index: int) -> dict:
        row = self.split[index]
        return {
            "id": row["id"],
            "input_ids": torch.tensor(row["input_ids"]),
            "loss_mask": torch.tensor(row["loss_mask"]),
        }


def item_lengths(dataset) -> list[int]:
    lengths = getattr(dataset, "lengths", None)
    if lengths is None:
        lengths = [len(dataset[i]["input_ids"]) for i in range(len(dataset))]
    return list(lengths)


def collate(items: list[dict], max_length: int, pad_id: int) -> dict:
    """Right-pad to the longest item (truncated to max_length). Padding has loss_mask 0 and, with
    causal attention, is never seen by real tokens."""
    length = min(max(len(item["input_ids"]) for item in items), max_length)
    batch: dict = {"id": [item["id"] for item in items]}
    fills = {"input_ids": pad_id, "loss_mask": 0, "aux_hidden": 0, "last_hidden": 0}
    for key, fill in fills.items():
        if key not in items[0]:
            continue
        rows = [item[key][:length] for item in items]
        padded = torch.full((len(rows), length, *rows[0].shape[1:]), fill, dtype=rows[0].dtype)
        for i, row in enumerate(rows):
            padded[i, : len(row)] = row
        batch[key] = padded
    batch["attention_mask"] = (
        torch.arange(length)[None, :]
        < torch.tensor([min(len(item["input_ids"]), length) for item in items])[:, None]
    ).long()
    return batch


class BucketBatchSampler:
    """Length-bucketed batches in one deterministic order per (seed, epoch), this rank's share;
    `resume(epoch, done)` skips the batches a resumed run already trained on."""

    def __init__(
        self,
        lengths: list[int],
        batch_size: int,
        bucket_batches: int,
        seed: int,
        shuffle: bool,
        rank: int = 0,
        world: int = 1,
    ):
        self.lengths, self.batch_size, self.bucket_batches = lengths, batch_size, bucket_batches
        self.seed, self.shuffle, self.rank, self.world = seed, shuffle, rank, world
        self.epoch, self.skip = 0, {}
        self.sampler = (
            self  # Lightning calls set_epoch on `batch_sampler.sampler`, not on the batch sampler
        )

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def resume(self, epoch: int, done: int) -> None:
        # Lightning creates the first iterator of a resumed fit before it calls set_epoch
        self.epoch, self.skip = epoch, {epoch: done}

    def all_batches(self, epoch: int) -> list[list[int]]:
        generator = torch.Generator().manual_seed(self.seed + epoch)
        count = len(self.lengths)
        order = (
            torch.randperm(count, generator=generator).tolist()
            if self.shuffle
            else list(range(count))
        )
        span = self.batch_size * self.bucket_batches
        batches = []
        for start in range(0, count, span):
            bucket = sorted(order[start : start + span], key=lambda i: self.lengths[i])
            batches += [
                bucket[i : i + self.batch_size] for i in range(0, len(bucket), self.batch_size)
            ]
        if self.shuffle:
            batches = [
                batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()
            ]
        return batches

    def rank_batches(self, epoch: int) -> list[list[int]]:
        batches = self.all_batches(epoch)
        per_rank = math.ceil(len(batches) / self.world)
        batches = (batches * self.world)[: per_rank * self.world]  # every rank takes as many steps
        return batches[self.rank * per_rank : (self.rank + 1) * per_rank]

    def __len__(self) -> int:
        return math.ceil(len(self.all_batches(0)) / self.world)

    def __iter__(self):
        batches = self.rank_batches(self.epoch)
        yield from batches[self.skip.pop(self.epoch, 0) :]


class DrafterData(L.LightningDataModule):
    """Train/val loaders over either shards (offline) or token rows (online)."""

    def __init__(
        self,
        train_set: Dataset,
        val_set: Dataset,
        tcfg: DictConfig,
        seed: int,
        pad_id: int,
        num_workers: int = 0,
    ):
        super().__init__()
        self.train_set, self.val_set, self.tcfg = train_set, val_set, tcfg
        self.seed, self.pad_id, self.num_workers = seed, pad_id, num_workers
        self.train_sampler: BucketBatchSampler | None = None
        self.pending_resume: tuple[int, int] | None = None

    def setup(self, stage: str) -> None:
        rank, world = (
            (self.trainer.global_rank, self.trainer.world_size) if self.trainer else (0, 1)
        )
        tcfg = self.tcfg
        self.train_sampler = BucketBatchSampler(
            item_lengths(self.train_set),
            tcfg.batch_size,
            tcfg.bucket_batches,
            self.seed,
            shuffle=True,
            rank=rank,
            world=world,
        )
        self.val_sampler = BucketBatchSampler(
            item_lengths(self.val_set),
            tcfg.batch_size,
            tcfg.bucket_batches,
            self.seed,
            shuffle=False,
            rank=rank,
            world=world,
        )
        if self.pending_resume:
            self.train_sampler.resume(*self.pending_resume)

    def loader(self, dataset, sampler) -> DataLoader:
        return DataLoader(
            dataset,
            batch_sampler=sampler,
            num_workers=self.num_workers,
            collate_fn=functools.partial(
                collate, max_length=self.tcfg.max_length, pad_id=self.pad_id
            ),
        )

    def train_dataloader(self) -> DataLoader:
        return self.loader(self.train_set, self.train_sampler)

    def val_dataloader(self) -> DataLoader:
        return self.loader(self.val_set, self.val_sampler)

    def state_dict(self) -> dict:
        """The data position: batches of the current epoch already trained on (saved in checkpoints)."""
        done = self.trainer.fit_loop.epoch_loop.batch_progress.current.processed
        epoch = self.trainer.current_epoch
        if self.train_sampler is not None and done >= len(
            self.train_sampler
        ):  # saved at the epoch's end
            epoch, done = epoch + 1, 0
        return {"epoch": epoch, "batches_done": done}

    def load_state_dict(self, state: dict) -> None:
        self.pending_resume = (state["epoch"], state["batches_done"])
        if self.train_sampler is not None:
            self.train_sampler.resume(*self.pending_resume)


# ---------------------------------------------------------------- model


def warmup_cosine(total_steps: int, warmup_ratio: float):
    warmup = max(1, int(total_steps * warmup_ratio))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return factor


def compile_loss(setting, device: torch.device) -> bool:
    """train.compile_loss: auto = on a GPU."""
    if setting not in ("auto", True, False):
        raise Eagle3Error(f"train.compile_loss={setting!r}: use auto, true or false")
    return device.type == "cuda" if setting == "auto" else setting


class DrafterModule(L.LightningModule):
    """TTT training of one drafter. The target's lm_head (for the target distribution) is a
    non-persistent buffer; the frozen embedding is left out of checkpoints. Online, the target
    model runs inside the step (it is not a submodule: never saved, never wrapped by DDP)."""

    def __init__(
        self,
        drafter: Eagle3Drafter,
        lm_head_weight: torch.Tensor,
        tcfg: DictConfig,
        target: Target | None = None,
        evaluation: dict | None = None,
    ):
        super().__init__()
        self.drafter, self.tcfg = drafter, tcfg
        self.register_buffer("lm_head_weight", lm_head_weight.detach().clone(), persistent=False)
        self.target = target
        self.evaluation = evaluation or {}
        self.strict_loading = False  # checkpoints omit the frozen embedding
        self.val_sums: torch.Tensor | None = None

    def setup(self, stage: str) -> None:
        if self.target is not None and (
            self.tcfg.hidden_states == "online" or self.evaluation.get("prompts")
        ):
            self.target.model.to(self.device)

    def with_hidden_states(self, batch: dict) -> dict:
        if "aux_hidden" in batch:
            return batch
        aux, last = capture_hidden_states(
            self.target.model,
            batch["input_ids"],
            self.target.aux_layer_ids,
            batch["attention_mask"],
        )
        return {**batch, "aux_hidden": aux, "last_hidden": last}

    def step(self, batch: dict, head_tokens: int | None = None):
        return ttt_loss(
            self.drafter,
            self.with_hidden_states(batch),
            self.lm_head_weight,
            self.tcfg.ttt_length,
            self.tcfg.step_decay,
            self.tcfg.attention,
            head_tokens,
            compile_loss(self.tcfg.get("compile_loss", "auto"), self.device),
        )

    def training_step(self, batch: dict, batch_idx: int):
        loss, metrics = self.step(batch)
        self.stop_if_not_finite(loss, batch, batch_idx)
        size = len(batch["id"])
        self.log("train/loss", loss, prog_bar=True, batch_size=size)
        self.log("train/tau_hat", metrics["tau_hat"], prog_bar=True, batch_size=size)
        for k in range(self.tcfg.ttt_length):
            self.log(f"train/acc_{k}", metrics[f"acc_{k}"], batch_size=size)
        return loss

    def stop_if_not_finite(self, loss: torch.Tensor, batch: dict, batch_idx: int) -> None:
        finite = bool(torch.isfinite(loss.detach()))
        if self.trainer.strategy.reduce_boolean_decision(finite, all=True):
            return
        where = "this rank" if not finite else "another rank"
        raise Eagle3Error(
            f"non-finite training loss ({where}) at step {self.global_step}, epoch "
            f"{self.current_epoch}, batch {batch_idx} (sample ids {batch['id']}); stopped. The "
            f"last good checkpoint is kept in {self.trainer.default_root_dir}/{CHECKPOINTS}"
        )

    def on_validation_epoch_start(self) -> None:
        # per step: weighted loss sum, correct, count, and correct / count over the head (ttt_loss)
        self.val_sums = torch.zeros(
            self.tcfg.ttt_length, 5, dtype=torch.float64, device=self.device
        )

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        head_tokens = self.tcfg.get("val_head_tokens")
        _, metrics = self.step(batch, head_tokens)
        for k in range(self.tcfg.ttt_length):
            count = metrics[f"count_{k}"]
            head = (
                [metrics[f"correct_head_{k}"], metrics[f"count_head_{k}"]]
                if head_tokens
                else [0, 0]
            )
            self.val_sums[k] += torch.tensor(
                [metrics[f"loss_{k}"] * count, metrics[f"correct_{k}"], count, *head],
                dtype=torch.float64,
                device=self.device,
            )

    def on_validation_epoch_end(self) -> None:
        sums = self.trainer.strategy.reduce(self.val_sums, reduce_op="sum")
        counts = sums[:, 2].clamp(min=1)
        accuracies, losses = sums[:, 1] / counts, sums[:, 0] / counts
        decay = torch.tensor(
            [self.tcfg.step_decay**k for k in range(len(losses))],
            dtype=losses.dtype,
            device=losses.device,
        )
        val_tau, val_loss = float(tau_hat(accuracies.cpu())), float((losses * decay).sum())
        self.log("val/tau_hat", val_tau, prog_bar=True)
        self.log("val/loss", val_loss)
        for k, acc in enumerate(accuracies.tolist()):
            self.log(f"val/acc_{k}", acc)
        head_line = ""
        if self.tcfg.get("val_head_tokens"):
            head = sums[:, 3] / sums[:, 4].clamp(min=1)
            head_tau = float(tau_hat(head.cpu()))
            self.log("val/tau_hat_head", head_tau)
            for k, acc in enumerate(head.tolist()):
                self.log(f"val/acc_head_{k}", acc)
            head_line = f", over the first {self.tcfg.val_head_tokens} tokens {head_tau:.3f}"
        if (
            self.trainer.is_global_zero and not self.trainer.sanity_checking
        ):  # runs without MLflow see it too
            log.info(
                "train: validation after epoch %d (step %d): tau_hat %.3f%s, loss %.4f, acc %s",
                self.current_epoch,
                self.global_step,
                val_tau,
                head_line,
                val_loss,
                " ".join(f"{a:.3f}" for a in accuracies.tolist()),
            )
        if self.evaluation.get("prompts") and not self.trainer.sanity_checking:
            self.log_measured_acceptance()

    def log_measured_acceptance(self) -> None:
        """val/tau_measured from the local engine drafting held-out prompts (rank 0 measures, all log)."""
        value = torch.zeros(1, device=self.device)
        if self.trainer.is_global_zero:
            from eagle3.engine import measure_acceptance

            self.drafter.eval()
            with torch.no_grad():
                result = measure_acceptance(
                    self.target,
                    self.drafter,
                    self.evaluation["prompts"],
                    self.evaluation["spec"],
                    self.evaluation["max_new_tokens"],
                    tree_temperature=self.evaluation["tree_temperature"],
                )
            self.drafter.train()
            value[0] = float(result["tau"])
        value = self.trainer.strategy.reduce(value, reduce_op="sum")
        self.log("val/tau_measured", float(value[0]))

    def configure_optimizers(self):
        params = [p for p in self.drafter.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(
            params,
            lr=self.tcfg.lr,
            weight_decay=self.tcfg.weight_decay,
            betas=tuple(self.tcfg.betas),
        )
        schedule = warmup_cosine(
            int(self.trainer.estimated_stepping_batches), self.tcfg.warmup_ratio
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        state = checkpoint["state_dict"]
        for key in [k for k in state if k.startswith("drafter.embed_tokens.")]:
            del state[key]


def drafter_weights(checkpoint_path: Path) -> dict[str, torch.Tensor]:
    """The drafter's trainable tensors (and vocab map) out of a Lightning checkpoint."""
    state = torch.load(checkpoint_path, map_location="cpu", weights_only=True)["state_dict"]
    prefix = "drafter."
    return {k[len(prefix) :]: v.contiguous() for k, v in state.items() if k.startswith(prefix)}


# ---------------------------------------------------------------- guard rails


def check_inputs(
    cfg: DictConfig,
    target: Target,
    data_manifest: dict,
    d2t: torch.Tensor,
    t2d: torch.Tensor,
    sample: dict | None,
) -> None:
    """Refuse, before the first step, inputs that would train a useless drafter."""
    from eagle3.data import tokenizer_hash

    hidden = cfg.drafter.get("hidden_size")
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
    if d2t.numel() != cfg.drafter.draft_vocab_size:
        raise Eagle3Error(
            f"the vocab map has {d2t.numel()} draft tokens, drafter.draft_vocab_size is "
            f"{cfg.drafter.draft_vocab_size}"
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
    if cfg.train.attention == "flex" and not torch.cuda.is_available():
        raise Eagle3Error(
            "train.attention=flex needs a GPU (flex_attention has no CPU backward); "
            "use train.attention=sdpa on CPU"
        )


def check_shards(cfg: DictConfig, shards: StageOutput, data_hash: str) -> None:
    if not shards.complete:
        raise Eagle3Error(
            f"no complete hidden-state shards at {shards.path}: run `python -m eagle3.extract` "
            "(or train.hidden_states=online)"
        )
    recorded = shards.manifest().get("upstream", {}).get("data")
    if recorded != data_hash:
        raise Eagle3Error(
            f"the shards at {shards.path} were extracted from data {recorded}, this config's data "
            f"(target {cfg.target.name}) is {data_hash}: another target or data set; rerun "
            "`python -m eagle3.extract` or point train.shards at the right folder"
        )


# ---------------------------------------------------------------- trainer


def in_multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def choose_strategy(trainer_cfg: DictConfig, multirun: bool) -> str:
    """Lightning's ddp re-launches the script per rank; under a Hydra multirun that re-runs the
    whole sweep in every rank, so there ddp becomes ddp_spawn (processes forked from this job)."""
    strategy = trainer_cfg.strategy
    if multirun and trainer_cfg.devices != 1 and strategy in ("ddp", "auto"):
        log.warning(
            "trainer.strategy=%s under a Hydra multirun: using ddp_spawn so ranks do not re-run the "
            "sweep",
            strategy,
        )
        return "ddp_spawn"
    return strategy


def precision_for(trainer_cfg: DictConfig) -> str:
    if trainer_cfg.precision != "auto":
        return trainer_cfg.precision
    gpu = trainer_cfg.accelerator in ("gpu", "cuda") or (
        trainer_cfg.accelerator == "auto" and torch.cuda.is_available()
    )
    return "bf16-mixed" if gpu else "32-true"


def checkpoint_callbacks(folder: Path, every_n_steps: int) -> list[Callback]:
    return [
        ModelCheckpoint(
            folder,
            filename="epoch{epoch}",
            auto_insert_metric_name=False,
            every_n_epochs=1,
            save_top_k=-1,
            save_last=True,
            enable_version_counter=False,
        ),
        ModelCheckpoint(
            folder,
            every_n_train_steps=every_n_steps,
            save_top_k=0,
            save_last=True,
            enable_version_counter=False,
        ),
        ModelCheckpoint(
            folder,
            filename="best",
            monitor="val/tau_hat",
            mode="max",
            save_top_k=1,
            enable_version_counter=False,
        ),
    ]


class Throughput(Callback):
    """Sequences and tokens per second over the fit, all ranks together (start-up excluded,
    validation included): the numbers compared across device counts. With `log_every` > 0
    (the progress bar off: logs, batch jobs) rank 0 also logs a progress line every `log_every`
    batches with the samples/s of that window, so a run cut short still tells its speed, and the
    share of that window spent between steps (loading and collating the next batch, Lightning)."""

    def __init__(self, log_every: int = 0):
        self.log_every = log_every

    def on_train_start(self, trainer, module) -> None:
        self.started, self.sequences, self.tokens = time.perf_counter(), 0, 0
        self.window, self.batches, self.first_step = (
            (self.started, 0, 0.0),
            0,
            trainer.global_step,
        )  # > 0 on resume
        self.between, self.last_end = 0.0, None

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        if self.last_end is not None:
            self.between += time.perf_counter() - self.last_end

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.last_end = time.perf_counter()
        self.sequences += batch["input_ids"].shape[0]
        self.tokens += int(batch["input_ids"].numel())
        self.batches += 1
        if self.log_every and trainer.is_global_zero and self.batches % self.log_every == 0:
            self.log_progress(trainer, outputs)

    def log_progress(self, trainer, outputs) -> None:
        now, (since, sequences, between) = time.perf_counter(), self.window
        rate = (self.sequences - sequences) * trainer.world_size / (now - since)
        between_share = 100 * (self.between - between) / (now - since)
        total, step = trainer.estimated_stepping_batches, trainer.global_step
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        tau = trainer.callback_metrics.get("train/tau_hat", torch.tensor(float("nan")))
        eta = (now - self.started) / max(step - self.first_step, 1) * (total - step)
        log.info(
            "train: step %d/%d epoch %d loss %.4f tau_hat %.3f  %.1f samples/s (%.0f%% between steps)  "
            "elapsed %.0fs eta %.0fs",
            step,
            total,
            trainer.current_epoch,
            float(loss),
            float(tau),
            rate,
            between_share,
            now - self.started,
            eta,
        )
        self.window = (now, self.sequences, self.between)

    def on_train_end(self, trainer, module) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        seconds = time.perf_counter() - self.started
        world = trainer.world_size
        self.result = {
            "train/seconds": seconds,
            "train/samples_per_s": self.sequences * world / seconds,
            "train/tokens_per_s": self.tokens * world / seconds,
            "train/devices": world,
        }
        if module.device.type == "cuda":  # this rank's; ranks hold the same shapes
            self.result["train/peak_memory_gib"] = (
                torch.cuda.max_memory_allocated(module.device) / 2**30
            )
        if trainer.logger is not None:
            trainer.logger.log_metrics(self.result, step=trainer.global_step)


def build_trainer(cfg: DictConfig, folder: Path, logger, callbacks=()) -> L.Trainer:
    trainer_cfg = cfg.trainer
    return L.Trainer(
        accelerator=trainer_cfg.accelerator,
        devices=trainer_cfg.devices,
        strategy=choose_strategy(trainer_cfg, in_multirun()),
        precision=precision_for(trainer_cfg),
        max_epochs=cfg.train.epochs,
        gradient_clip_val=cfg.train.grad_clip,
        accumulate_grad_batches=cfg.train.grad_accum,
        check_val_every_n_epoch=cfg.train.val_every_n_epochs,
        default_root_dir=str(folder),
        logger=logger if logger is not None else False,
        callbacks=[
            *checkpoint_callbacks(folder / CHECKPOINTS, cfg.train.checkpoint_every_n_steps),
            *callbacks,
        ],
        use_distributed_sampler=False,
        num_sanity_val_steps=0,
        log_every_n_steps=trainer_cfg.log_every_n_steps,
        enable_progress_bar=trainer_cfg.progress_bar,
        enable_model_summary=False,
    )


def is_launcher_rank() -> bool:
    """False in the processes Lightning's ddp launches for ranks > 0 (they re-run this app)."""
    return int(os.environ.get("LOCAL_RANK", 0)) == 0 and int(os.environ.get("NODE_RANK", 0)) == 0


def fit(
    cfg: DictConfig,
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
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    drafter = build_drafter(target, cfg.drafter).float()
    drafter.set_vocab_map(d2t.to(drafter.d2t.device), t2d.to(drafter.t2d.device))
    if cfg.train.get("init_from"):
        start_from(drafter, cfg.train.init_from, target, cfg.tracking.uri)
    module = DrafterModule(
        drafter, target.model.get_output_embeddings().weight, cfg.train, target, evaluation
    )
    throughput = Throughput(0 if cfg.trainer.progress_bar else cfg.trainer.log_every_n_steps)
    trainer = build_trainer(cfg, folder, logger, [throughput, *callbacks])
    last = folder / CHECKPOINTS / "last.ckpt"
    if last.exists():
        log.info("resuming from %s", last)
    cudnn = torch.backends.cuda.cudnn_sdp_enabled()  # process-wide: restored after the fit
    torch.backends.cuda.enable_cudnn_sdp(cfg.trainer.cudnn_attention)  # a no-op without CUDA
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=str(last) if last.exists() else None)
    finally:
        torch.backends.cuda.enable_cudnn_sdp(cudnn)
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
        from eagle3.export import load_drafter

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


# ---------------------------------------------------------------- the app


def datasets_for(cfg: DictConfig, data_dir: Path) -> tuple[Dataset, Dataset]:
    train_set, val_set = split_datasets(cfg, data_dir)
    return first_rows(train_set, cfg.train.get("limit")), val_set


def first_rows(dataset: Dataset, limit: int | None) -> Dataset:
    """The first `limit` items of `dataset` (all when null), lengths kept for bucketing."""
    if limit is None:
        return dataset
    if int(limit) < 1 or int(limit) > len(dataset):
        raise Eagle3Error(
            f"train.limit={limit}: the data's train split holds {len(dataset)} rows (use 1..{len(dataset)})"
        )
    subset = Subset(dataset, range(int(limit)))
    subset.lengths = item_lengths(dataset)[: int(limit)]
    return subset


def split_datasets(cfg: DictConfig, data_dir: Path) -> tuple[Dataset, Dataset]:
    if cfg.train.hidden_states == "online":
        from eagle3.data import load_splits

        splits = load_splits(data_dir)
        return TokenDataset(splits["train"]), TokenDataset(splits["val"])
    if cfg.train.hidden_states != "offline":
        raise Eagle3Error(f"train.hidden_states={cfg.train.hidden_states}: use offline or online")
    from eagle3.data import load_splits
    from eagle3.extract import ShardDataset

    shards, splits = shards_output(cfg), load_splits(data_dir)
    return tuple(
        with_lengths(ShardDataset(shards.path, split=name), splits[name])
        for name in ("train", "val")
    )


def with_lengths(shard_set, split):
    """Sequence lengths for bucketing without reading hidden states: shard j of the index holds the
    data split's rows first_row .. first_row + samples - 1, in order."""
    if getattr(shard_set, "lengths", None) is None:
        row_lengths = [len(ids) for ids in split["input_ids"]]
        shard_set.lengths = [
            row_lengths[shard["first_row"] + j]
            for shard in shard_set.shards
            for j in range(shard["samples"])
        ]
        if shard_set.lengths and len(shard_set[0]["input_ids"]) != shard_set.lengths[0]:
            raise Eagle3Error(
                f"the shards at {shard_set.root} do not line up with the data split's rows: "
                "rerun `python -m eagle3.extract`"
            )
    return shard_set


def evaluation_for(cfg: DictConfig, val_set: Dataset) -> dict:
    """Held-out prompts (token ids before the first trained token) for measured acceptance."""
    if not cfg.train.eval_prompts:
        return {}
    try:
        import eagle3.engine as engine

        engine.measure_acceptance  # noqa: B018 (does the engine offer it yet?)
    except (ImportError, AttributeError):
        log.warning(
            "train.eval_prompts is set but eagle3.engine.measure_acceptance is unavailable: "
            "logging val/tau_hat only"
        )
        return {}
    from eagle3.spec import resolve_spec

    prompts = []
    for index in range(min(cfg.train.eval_prompts, len(val_set))):
        item = val_set[index]
        trained = item["loss_mask"].nonzero()
        cut = int(trained[0]) if len(trained) else len(item["input_ids"])
        prompts.append(item["input_ids"][: max(cut, 1)].tolist())
    return {
        "prompts": prompts,
        "spec": resolve_spec(cfg.spec),
        "max_new_tokens": cfg.train.eval_max_new_tokens,
        "tree_temperature": cfg.engine.tree_temperature,
    }


def target_device(cfg: DictConfig) -> str:
    """Offline the target only lends its embedding and lm_head: CPU. Online it runs in every step:
    this rank's GPU (and so the GPU dtype), when there is one."""
    if cfg.train.hidden_states != "online" or cfg.trainer.accelerator == "cpu":
        return "cpu"
    device = resolve_device(cfg.target.device)
    return f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if device.type == "cuda" else str(device)


def run(cfg: DictConfig, callbacks=()) -> StageOutput:
    """Train the drafter this config describes (a no-op when its output is complete)."""
    from eagle3.data import data_output, load_vocab_map
    from eagle3.tracking import stage_run

    out = train_output(cfg)
    if out.complete:
        log.info("train: %s is complete, nothing to do", out.path)
        return out
    data = data_output(cfg)
    if not data.complete:
        raise Eagle3Error(
            f"no complete data stage output at {data.path}: run `python -m eagle3.data` first"
        )
    if cfg.train.hidden_states == "offline":
        check_shards(cfg, shards_output(cfg), data.hash)
    target = load_target(cfg, device=target_device(cfg))
    d2t, t2d = load_vocab_map(data.path)
    train_set, val_set = datasets_for(cfg, data.path)
    check_inputs(cfg, target, data.manifest(), d2t, t2d, train_set[0] if len(train_set) else None)
    datamodule = DrafterData(
        train_set,
        val_set,
        cfg.train,
        cfg.seed,
        target.tokenizer.pad_token_id or 0,
        cfg.trainer.num_workers,
    )
    evaluation = evaluation_for(cfg, val_set)
    if (
        not is_launcher_rank()
    ):  # a ddp rank > 0: train only; rank 0 owns the folder and the MLflow run
        fit(cfg, target, datamodule, out.path, d2t, t2d, callbacks=callbacks, evaluation=evaluation)
        return out
    out.start()
    with stage_run(cfg, "train", artifact_hash=out.hash) as mlflow_run:
        logger = None
        if mlflow_run is not None:
            from lightning.pytorch.loggers import MLFlowLogger

            logger = MLFlowLogger(
                experiment_name=cfg.tracking.experiment,
                tracking_uri=cfg.tracking.uri,
                run_id=mlflow_run.info.run_id,
            )
        metrics = fit(cfg, target, datamodule, out.path, d2t, t2d, logger, callbacks, evaluation)
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
                "train/devices",
                "train/peak_memory_gib",
            )
        },
        # per TTT step, so a run without MLflow (a GPU box) still reports them
        "val_acc": [metrics.get(f"val/acc_{k}") for k in range(cfg.train.ttt_length)],
        # the last validation's, over each sequence's first train.val_head_tokens tokens (ttt.py)
        "tau_hat_head": metrics.get("val/tau_hat_head"),
        "val_acc_head": [metrics.get(f"val/acc_head_{k}") for k in range(cfg.train.ttt_length)],
    }
    out.finish(counts)
    log.info(
        "train: wrote %s (val tau_hat %.3f; over the first %s tokens, the last validation: %.3f)",
        out.path,
        counts["tau_hat"] or float("nan"),
        cfg.train.get("val_head_tokens"),
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


@app
def main(cfg: DictConfig) -> None:
    out = run(cfg)
    print(f"trained drafter: {out.path}")


if __name__ == "__main__":
    main()
