"""Training callbacks: checkpoints (last every N steps and each epoch, best by val tau_hat, each
written whole or not at all), a stop at a step's end on a signal, and throughput logging."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException

from eagle3.core.common import Eagle3Error, log
from eagle3.core.lifecycle import STOP_SIGNALS, Stopped


class AtomicCheckpointIO(TorchCheckpointIO):
    """Each checkpoint is written to a temporary name beside its own (`.<name>.<pid>.tmp`), flushed
    to the disk and renamed over it: a save cut short (a full disk, a kill) leaves the previous
    checkpoint whole, and a full disk is one line naming the file."""

    def save_checkpoint(self, checkpoint: dict, path, storage_options=None) -> None:
        if storage_options is not None:
            raise TypeError("AtomicCheckpointIO.save_checkpoint takes no storage_options")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            with open(partial, "wb") as handle:
                torch.save(checkpoint, handle)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(partial, path)
        except OSError as err:
            partial.unlink(missing_ok=True)
            kept = "the previous one is kept" if path.exists() else "there is no earlier one"
            raise Eagle3Error(
                f"cannot write the checkpoint {path} ({err.strerror or err}); {kept}: free the "
                "space and rerun the same command to resume"
            ) from err
        except BaseException:
            partial.unlink(missing_ok=True)
            raise


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


def busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of (start, end) intervals: the time at least one of them runs (kernels on
    several streams overlap; each moment counts once)."""
    busy, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            busy += end - max(start, reach)
            reach = end
    return busy


class GpuBusy:
    """The share of wall time the GPU runs kernels or copies over `steps` training steps from step
    `first` on (torch.profiler's device activity; the window starts and ends with a synchronize).
    None where there is no CUDA device or the fit ends before the window does."""

    def __init__(self, first: int, steps: int):
        self.first, self.steps = first, steps
        self.profiler, self.started, self.percent = None, 0.0, None

    def step_starts(self, step: int, device: torch.device) -> None:
        if (
            device.type != "cuda"
            or self.steps < 1
            or step != self.first
            or self.profiler is not None
        ):
            return
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize(device)
        self.profiler = profile(activities=[ProfilerActivity.CUDA])
        self.profiler.__enter__()
        self.started = time.perf_counter()

    def step_ended(self, step: int, device: torch.device) -> None:
        if self.profiler is None or self.percent is not None or step < self.first + self.steps:
            return
        torch.cuda.synchronize(device)
        wall = time.perf_counter() - self.started
        self.profiler.__exit__(None, None, None)
        intervals = [
            (event.time_range.start, event.time_range.end)  # microseconds
            for event in self.profiler.events()
            if event.device_type == torch.autograd.DeviceType.CUDA
        ]
        self.percent = 100 * busy_seconds(intervals) / 1e6 / wall


class Throughput(Callback):
    """Sequences and tokens per second over the fit, all ranks together and per device (start-up
    excluded, validation included; tokens are the batches' real tokens, padding not counted): the
    numbers compared across device counts and with other trainers. With `log_every` > 0 (the progress
    bar off: logs, batch jobs) rank 0 also logs a progress line every `log_every` batches with the
    samples/s and tokens/s per device of that window, so a run cut short still tells its speed, and
    the share of that window spent between steps (loading and collating the next batch, Lightning).
    `busy` measures the GPU's busy share over a window of steps (GpuBusy)."""

    def __init__(self, log_every: int = 0, busy: GpuBusy | None = None):
        self.log_every, self.busy = log_every, busy or GpuBusy(0, 0)

    def on_train_start(self, trainer, module) -> None:
        self.started, self.sequences, self.tokens, self.padded = time.perf_counter(), 0, 0, 0
        self.window, self.batches, self.first_step = (
            (self.started, 0, 0, 0.0),
            0,
            trainer.global_step,
        )  # > 0 on resume
        self.between, self.last_end = 0.0, None

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        if self.last_end is not None:
            self.between += time.perf_counter() - self.last_end
        self.busy.step_starts(trainer.global_step, module.device)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.busy.step_ended(trainer.global_step, module.device)
        self.last_end = time.perf_counter()
        self.sequences += batch["input_ids"].shape[0]
        self.padded += batch["input_ids"].numel()
        self.tokens += batch.get("tokens", batch["input_ids"].numel())
        self.batches += 1
        if self.log_every and trainer.is_global_zero and self.batches % self.log_every == 0:
            self.log_progress(trainer, outputs)

    def log_progress(self, trainer, outputs) -> None:
        now, (since, sequences, tokens, between) = time.perf_counter(), self.window
        rate = (self.sequences - sequences) * trainer.world_size / (now - since)
        device_tokens = (self.tokens - tokens) / (now - since)
        between_share = 100 * (self.between - between) / (now - since)
        total, step = trainer.estimated_stepping_batches, trainer.global_step
        loss, tau = outputs["loss"], outputs["tau_hat"]  # DrafterModule.training_step's
        eta = (now - self.started) / max(step - self.first_step, 1) * (total - step)
        log.info(
            "train: step %d/%d epoch %d loss %.4f tau_hat %.3f  %.1f samples/s, %.0f tokens/s per "
            "device (%.0f%% between steps)  elapsed %.0fs eta %.0fs",
            step,
            total,
            trainer.current_epoch,
            float(loss),
            float(tau),
            rate,
            device_tokens,
            between_share,
            now - self.started,
            eta,
        )
        self.window = (now, self.sequences, self.tokens, self.between)

    def on_train_end(self, trainer, module) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        seconds = time.perf_counter() - self.started
        world = trainer.world_size
        self.result = {
            "train/seconds": seconds,
            "train/samples_per_s": self.sequences * world / seconds,
            "train/tokens_per_s": self.tokens * world / seconds,
            "train/tokens_per_s_per_device": self.tokens / seconds,  # this rank's; ranks alike
            "train/padding_share": 1 - self.tokens / max(self.padded, 1),
            "train/devices": world,
        }
        if self.busy.percent is not None:
            self.result["train/gpu_busy_pct"] = self.busy.percent
        if module.device.type == "cuda":  # this rank's; ranks hold the same shapes
            self.result["train/peak_memory_gib"] = (
                torch.cuda.max_memory_allocated(module.device) / 2**30
            )
        if trainer.is_global_zero:
            busy = "n/a on CPU" if module.device.type != "cuda" else self.busy_text()
            log.info(
                "train: %.1f samples/s, %.0f tokens/s per device (%.1f%% padding), GPU busy %s",
                self.result["train/samples_per_s"],
                self.result["train/tokens_per_s_per_device"],
                100 * self.result["train/padding_share"],
                busy,
            )
        if trainer.logger is not None:
            trainer.logger.log_metrics(self.result, step=trainer.global_step)

    def busy_text(self) -> str:
        if self.busy.steps < 1:
            return "not measured (trainer.gpu_busy_steps=0)"
        if self.busy.percent is None:
            return f"not measured (the fit ended before step {self.busy.first + self.busy.steps})"
        return f"{self.busy.percent:.0f}% over steps {self.busy.first}-{self.busy.first + self.busy.steps - 1}"
