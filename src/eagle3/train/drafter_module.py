"""The LightningModule that trains the drafter: the TTT unroll loss over aux hidden states
(read from shards or captured from the target inside the step), AdamW with linear warmup then
cosine, validation tau_hat and acceptance on held-out prompts."""

from __future__ import annotations

import math

import lightning as L
import torch
from omegaconf import DictConfig

from eagle3.core.common import Eagle3Error, log
from eagle3.core.drafter import Eagle3Drafter
from eagle3.core.drafter_io import CHECKPOINTS
from eagle3.core.target import CompiledCapture, Target
from eagle3.engine import measure_acceptance
from eagle3.train.ttt import tau_hat, ttt_loss


def warmup_cosine(total_steps: int, warmup_ratio: float):
    warmup = max(1, int(total_steps * warmup_ratio))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return factor


def compile_setting(key: str, setting, device: torch.device) -> bool:
    """train.compile_loss / compile_unroll / compile_target: auto = on a GPU."""
    if setting not in ("auto", True, False):
        raise Eagle3Error(f"train.{key}={setting!r}: use auto, true or false")
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
        self.capture = None  # the target forward of the online step (with_hidden_states)

    def setup(self, stage: str) -> None:
        if self.target is not None and (
            self.tcfg.hidden_states == "online" or self.evaluation.get("prompts")
        ):
            self.target.model.to(self.device)

    def with_hidden_states(self, batch: dict) -> dict:
        if "aux_hidden" in batch:
            return batch
        if self.capture is None:
            compiled = compile_setting(
                "compile_target", self.tcfg.get("compile_target", False), self.device
            )
            model, layer_ids = self.target.model, self.target.aux_layer_ids
            self.capture = CompiledCapture(model, layer_ids) if compiled else self.target.capture
        aux, last = self.capture(batch["input_ids"], batch["attention_mask"])
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
            compile_setting("compile_loss", self.tcfg.get("compile_loss", "auto"), self.device),
            compile_setting("compile_unroll", self.tcfg.get("compile_unroll", False), self.device),
        )

    def training_step(self, batch: dict, batch_idx: int):
        loss, metrics = self.step(batch)
        self.stop_if_not_finite(loss, batch, batch_idx)
        if self.metrics_used():
            size = len(batch["id"])
            self.log("train/loss", loss, prog_bar=True, batch_size=size)
            self.log("train/tau_hat", metrics["tau_hat"], prog_bar=True, batch_size=size)
            for k in range(self.tcfg.ttt_length):
                self.log(f"train/acc_{k}", metrics[f"acc_{k}"], batch_size=size)
        return {"loss": loss, "tau_hat": metrics["tau_hat"]}

    def metrics_used(self) -> bool:
        """Whether this step's train metrics are read: the progress bar shows every step, the loggers
        get Lightning's log steps, and the fit's result is its last step. Lightning's self.log costs
        ~1 ms of CPU a call (it moves a metric object to the device), and a GPU step here is CPU-bound."""
        trainer = self.trainer
        return (
            trainer.progress_bar_callback is not None
            or trainer._logger_connector.should_update_logs
            or self.global_step + 1 >= trainer.estimated_stepping_batches
        )

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

    def configure_gradient_clipping(
        self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None
    ) -> None:
        """Under FSDP, FSDP's own clip_grad_norm_ (the norm over every rank's shard; Lightning's FSDP
        precision refuses clipping by norm, torch.nn.utils would see one shard's norm)."""
        from torch.distributed.fsdp import FullyShardedDataParallel

        wrapped = self.trainer.strategy.model
        if not isinstance(wrapped, FullyShardedDataParallel):
            super().configure_gradient_clipping(
                optimizer, gradient_clip_val, gradient_clip_algorithm
            )
        elif gradient_clip_val:
            wrapped.clip_grad_norm_(gradient_clip_val)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        state = checkpoint["state_dict"]
        for key in [k for k in state if k.startswith("drafter.embed_tokens.")]:
            del state[key]
