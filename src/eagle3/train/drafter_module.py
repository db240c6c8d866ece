"""The LightningModule that trains the drafter: the TTT unroll loss over aux hidden states
(read from shards or captured from the target inside the step), AdamW with linear warmup then
cosine, validation tau_hat and acceptance on held-out prompts."""

from __future__ import annotations

import math

import lightning as L
import torch

from eagle3.core.common import Eagle3Error, log
from eagle3.core.config import TrainConfig
from eagle3.core.drafter import Eagle3Drafter
from eagle3.core.drafter_io import CHECKPOINTS
from eagle3.core.target import CompiledCapture, Target
from eagle3.engine import measure_acceptance
from eagle3.train.ttt import tau_hat, tau_hat_on_device, ttt_loss


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


ADAMW_KINDS = ("auto", "default", "foreach", "fused")


def adamw_options(kind: str, lr: float, device: torch.device) -> dict:
    """torch.optim.AdamW's implementation options for train.adamw. On a GPU foreach and fused run
    capturable (step counts on the GPU: no host read in the update) with a tensor learning rate, the
    form a captured CUDA graph replays; auto = fused on a GPU, torch's default elsewhere."""
    if kind not in ADAMW_KINDS:
        raise Eagle3Error(f"train.adamw={kind!r}: use one of {', '.join(ADAMW_KINDS)}")
    if kind == "auto":
        kind = "fused" if device.type == "cuda" else "default"
    if kind == "default":
        return {"lr": lr}
    if device.type != "cuda":
        return {"lr": lr, kind: True}
    return {"lr": torch.tensor(lr, device=device), kind: True, "capturable": True}


class DrafterModule(L.LightningModule):
    """TTT training of one drafter. The target's lm_head (for the target distribution) is a
    non-persistent buffer; the frozen embedding is left out of checkpoints. Online, the target
    model runs inside the step (it is not a submodule: never saved, never wrapped by DDP)."""

    def __init__(
        self,
        drafter: Eagle3Drafter,
        lm_head_weight: torch.Tensor,
        tcfg: TrainConfig,
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
        # (isfinite(loss) on the device, the step it belongs to) of the steps since the last check
        self.unchecked_losses: list[tuple[torch.Tensor, tuple]] = []

    def setup(self, stage: str) -> None:
        if self.target is not None and (
            self.tcfg.hidden_states == "online" or self.evaluation.get("prompts")
        ):
            self.target.model.to(self.device)

    def with_hidden_states(self, batch: dict) -> dict:
        if "aux_hidden" in batch:
            return batch
        if self.capture is None:
            compiled = compile_setting("compile_target", self.tcfg.compile_target, self.device)
            model, layer_ids = self.target.model, self.target.aux_layer_ids
            self.capture = CompiledCapture(model, layer_ids) if compiled else self.target.capture
        aux, last = self.capture(batch["input_ids"], self.target_mask(batch["attention_mask"]))
        return {**batch, "aux_hidden": aux, "last_hidden": last}

    def target_mask(self, attention_mask: torch.Tensor) -> torch.Tensor:
        """The target's attention mask as the 4-D causal-and-padding mask its sdpa attention applies:
        given the 2-D mask, transformers reads it back to the host every forward (to choose between
        the causal kernel and a mask); given the 4-D one, it uses it as it is."""
        if self.target.model.config._attn_implementation != "sdpa":
            return attention_mask
        positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
        causal = positions[None, :] <= positions[:, None]
        return causal[None, None] & attention_mask.bool()[:, None, None, :]

    def step(self, batch: dict, head_tokens: int | None = None):
        """(loss, per-step counts on the device): eagle3.train.ttt.ttt_loss."""
        return ttt_loss(
            self.drafter,
            self.with_hidden_states(batch),
            self.lm_head_weight,
            self.tcfg.ttt_length,
            self.tcfg.step_decay,
            self.tcfg.attention,
            head_tokens,
            compile_setting("compile_loss", self.tcfg.compile_loss, self.device),
            compile_setting("compile_unroll", self.tcfg.compile_unroll, self.device),
        )

    def training_step(self, batch: dict, batch_idx: int):
        """The step reads nothing back to the host: its metrics stay on the device and are read where
        they are logged, its loss is checked for NaN/inf there and before every checkpoint."""
        loss, counts = self.step(batch)
        where = (self.global_step, self.current_epoch, batch_idx, list(batch["id"]))
        self.unchecked_losses.append((torch.isfinite(loss.detach()), where))
        tau = tau_hat_on_device(counts[:, 1], counts[:, 2])
        if self.metrics_used():
            self.stop_if_not_finite()
            size = len(batch["id"])
            accuracies = counts[:, 1] / counts[:, 2].clamp(min=1)
            self.log("train/loss", loss.detach(), prog_bar=True, batch_size=size)
            self.log("train/tau_hat", tau, prog_bar=True, batch_size=size)
            for k in range(self.tcfg.ttt_length):
                self.log(f"train/acc_{k}", accuracies[k], batch_size=size)
        return {"loss": loss, "tau_hat": tau}

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

    def stop_if_not_finite(self) -> None:
        """Read the losses' finiteness since the last check (one host read, one collective on every
        rank at the same steps: the log steps and every checkpoint) and stop at the first bad one."""
        unchecked, self.unchecked_losses = self.unchecked_losses, []
        flags = torch.stack([ok for ok, _ in unchecked]).tolist() if unchecked else []
        bad = next((where for ok, (_, where) in zip(flags, unchecked) if not ok), None)
        if self.trainer.strategy.reduce_boolean_decision(bad is None, all=True):
            return
        kept = f"The last good checkpoint is kept in {self.trainer.default_root_dir}/{CHECKPOINTS}"
        if bad is None:
            steps = f"{unchecked[0][1][0]}-{unchecked[-1][1][0]}" if unchecked else "?"
            raise Eagle3Error(
                f"non-finite training loss (another rank) at one of steps {steps}; stopped. {kept}"
            )
        step, epoch, batch_idx, ids = bad
        raise Eagle3Error(
            f"non-finite training loss (this rank) at step {step}, epoch {epoch}, batch {batch_idx} "
            f"(sample ids {ids}); stopped. {kept}"
        )

    def on_validation_epoch_start(self) -> None:
        # per step: weighted loss sum, correct, count, and correct / count over the head (ttt_loss)
        self.val_sums = torch.zeros(
            self.tcfg.ttt_length, 5, dtype=torch.float64, device=self.device
        )

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        head_tokens = self.tcfg.val_head_tokens
        _, counts = self.step(batch, head_tokens)
        counts = counts.double()
        loss, correct, count = counts[:, 0], counts[:, 1], counts[:, 2]
        head = counts[:, 3:5] if head_tokens else torch.zeros_like(counts[:, :2])
        self.val_sums += torch.cat(
            [(loss * count)[:, None], correct[:, None], count[:, None], head], 1
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
        if self.tcfg.val_head_tokens:
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
            weight_decay=self.tcfg.weight_decay,
            betas=tuple(self.tcfg.betas),
            **adamw_options(self.tcfg.adamw, self.tcfg.lr, self.device),
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
        self.stop_if_not_finite()  # never a checkpoint of weights a non-finite loss has touched
        state = checkpoint["state_dict"]
        for key in [k for k in state if k.startswith("drafter.embed_tokens.")]:
            del state[key]
