"""`python -m eagle3.export.checkpoint`: a training stopped by SIGTERM (as a job's time limit stops
it) exported from its newest checkpoint, bit-exact, into a folder named by that checkpoint."""

from __future__ import annotations

import os
import signal

import lightning as L
import pytest
import torch
from support import BASE, peaked_target, synthetic_fit

from eagle3.core.common import Eagle3Error
from eagle3.core.drafter_io import CHECKPOINTS, FINAL_WEIGHTS, drafter_weights, load_drafter
from eagle3.core.lifecycle import Stopped
from eagle3.core.outputs import train_output
from eagle3.export.checkpoint import chosen_checkpoint, export_checkpoint, newest_checkpoint

CUT_AT_STEP = 8


def exported(cfg):
    """What `python -m eagle3.export.checkpoint` exports for `cfg`."""
    checkpoint = newest_checkpoint(chosen_checkpoint(cfg.export) or train_output(cfg).path)
    return export_checkpoint(
        checkpoint, cfg.export, cfg.target, cfg.drafter, cfg.train, cfg.paths.artifacts
    )


class SigtermAt(L.Callback):
    """Sends this process a real SIGTERM at the end of a training step."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def assert_exported(folder, checkpoint) -> None:
    """Every tensor of the checkpoint's drafter (weights and vocab map) equals the exported one."""
    expected = drafter_weights(checkpoint)
    for engine in ("sglang", "vllm"):
        exported = load_drafter(folder, aux_convention=engine).state_dict()
        assert set(expected) == set(exported) - {"embed_tokens.weight"}
        for key, value in expected.items():
            assert torch.equal(exported[key], value), (engine, key)


def test_stopped_training_exports_its_newest_checkpoint(make_cfg, own_artifacts):
    cfg = make_cfg(*BASE, "train.epochs=3", f"paths.artifacts={own_artifacts}")
    folder = train_output(cfg).path
    with pytest.raises(Stopped):
        synthetic_fit(cfg, folder, [SigtermAt(CUT_AT_STEP)], peaked_target(cfg))
    assert not (folder / FINAL_WEIGHTS).exists()  # an unfinished training: checkpoints only
    last = folder / CHECKPOINTS / "last.ckpt"
    assert torch.load(last, weights_only=True)["global_step"] == CUT_AT_STEP

    out = exported(cfg)
    assert sorted(out.manifest()["counts"]["folders"]) == ["sglang", "vllm"]
    assert out.manifest()["recipe"]["checkpoint"] == str(last)
    assert_exported(out.path, last)
    written = out.manifest_path.stat().st_mtime_ns
    assert exported(cfg).path == out.path  # the same checkpoint again: a no-op
    assert out.manifest_path.stat().st_mtime_ns == written

    # an older checkpoint made the newest: another folder, holding that checkpoint's weights
    epoch = next((folder / CHECKPOINTS).glob("epoch*.ckpt"))
    assert not torch.equal(drafter_weights(epoch)["fc.weight"], drafter_weights(last)["fc.weight"])
    os.utime(epoch)
    again = exported(cfg)
    assert again.path != out.path
    assert_exported(again.path, epoch)


def test_a_checkpoint_of_another_drafter_shape_is_refused(make_cfg, own_artifacts, tmp_path):
    cfg = make_cfg(*BASE, "train.epochs=1", f"paths.artifacts={own_artifacts}")
    synthetic_fit(cfg, tmp_path / "run", target=peaked_target(cfg))
    other = make_cfg(
        *BASE,
        "drafter.num_layers=2",
        f"paths.artifacts={own_artifacts}",
        f"export.checkpoint={tmp_path / 'run'}",
    )
    with pytest.raises(Eagle3Error, match=r"does not fit the drafter .*missing \['layers.1"):
        exported(other)
    empty = make_cfg(*BASE, f"paths.artifacts={own_artifacts}")
    with pytest.raises(Eagle3Error, match=r"holds no checkpoint \(\*\.ckpt\)"):
        exported(empty)
