"""Training callbacks: checkpoints (last every N steps and each epoch, best by val tau_hat), a stop
at a step's end on a signal, and throughput logging."""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException

from eagle3.core.common import log
from eagle3.core.lifecycle import STOP_SIGNALS, Stopped


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


class StopAtStepEnd(Callback):
    """SIGTERM, SIGHUP or Ctrl-C during a one-process fit: the step under way ends, last.ckpt is
    written at it and the run stops as the signal would, so the same command resumes there with no
    step lost (a second signal stops at once). Multi-process fits stop at once, as before: their
    ranks could see the signal at different steps."""

    def __init__(self, last: Path):
        self.last, self.signum, self.active = last, None, False

    @contextlib.contextmanager
    def installed(self, enabled: bool):
        self.active = enabled and threading.current_thread() is threading.main_thread()
        if not self.active:
            yield
            return
        signals = (*STOP_SIGNALS, signal.SIGINT)
        previous = {sig: signal.getsignal(sig) for sig in signals}
        for sig, handler in previous.items():
            if handler is not signal.SIG_IGN:  # an ignored signal stays ignored
                signal.signal(sig, self.note)
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def note(self, signum, _frame) -> None:
        if self.signum is not None:
            raise Stopped(signum)
        self.signum = signum
        log.warning(
            "train: %s: stopping at the end of this step (send it again to stop at once)",
            signal.Signals(signum).name,
        )

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if self.signum is None:
            return
        trainer.save_checkpoint(self.last)
        log.warning(
            "train: stopped at step %d, saved in %s (the same command resumes there)",
            trainer.global_step,
            self.last,
        )
        raise Stopped(self.signum)

    def on_exception(self, trainer, module, exception) -> None:
        if self.active and isinstance(exception, SIGTERMException):  # Lightning's, in validation
            trainer.save_checkpoint(self.last)
            log.warning("train: stopped in validation, saved in %s", self.last)


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
        loss, tau = outputs["loss"], outputs["tau_hat"]  # DrafterModule.training_step's
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
